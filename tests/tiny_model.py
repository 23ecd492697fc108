"""A tiny random Hugging Face model on disk (config, safetensors, a byte-level BPE tokenizer with a
ChatML template) and a small text corpus: what a child `python -m spotlight.train --model DIR`
loads in seconds. Built in tests, never shipped."""
from __future__ import annotations

import random
from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the courier comes at dawn with letters from the harbour and the mill while the river runs "
         "past old stone walls where sheep and ravens keep the hill").split()
# A run small enough for a test on a busy 2-core machine: 2 recorded sequences of 640 tokens,
# 8 queries a step (train.py's defaults need min_query 512, so seq_len >= 512 + 8 * queries)
TINY_RUN = ("--seq-len", "640", "--sequences", "2", "--queries", "8", "--others", "64", "--tops", "4",
            "--mined-others", "4", "--hard-others", "2", "--width", "16")


def corpus_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def write_tiny_model(folder: Path, max_positions: int = 1024) -> Path:
    """A 2-layer random Llama (GQA 4/2, head dim 16) with a 300-token tokenizer in `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from conftest import tiny_hf_config

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([corpus_text(2000, seed=0)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = tiny_hf_config("llama", vocab_size=300, max_position_embeddings=max_positions,
                            eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def write_corpus(folder: Path) -> Path:
    """Two text files, each longer than one 640-token training window."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        (folder / f"text{i}.txt").write_text(corpus_text(1500, seed=1 + i))
    return folder
