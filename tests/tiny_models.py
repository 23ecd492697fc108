"""Tiny model files written by tests: a random Hugging Face directory that loads and chats, and
GGUF files carrying only metadata and a random tensor (what the models folder lists)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from conftest import tiny_hf_config

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|im_start|>", "<|im_end|>")
HF_WINDOW = 512  # tiny_hf_config's max_position_embeddings


def byte_tokenizer():
    """A fast byte-level tokenizer (256 byte tokens, no merges) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=SPECIALS[1],
                                        additional_special_tokens=[SPECIALS[0]])
    tokenizer.chat_template = CHATML
    return tokenizer


def write_tiny_hf_dir(directory: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A random 2-layer `arch` model (conftest.tiny_hf_config) with the byte tokenizer, saved as a
    Hugging Face directory (config.json, model.safetensors, tokenizer files)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    config = tiny_hf_config(arch, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


def write_tiny_gguf(path: Path, arch: str = "llama", window: int = 2048, seed: int = 0) -> Path:
    """A GGUF holding `arch` metadata (its context length `window`) and one small random tensor:
    enough for gguf's reader, not a runnable model."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(window)
    writer.add_block_count(1)
    rows = np.random.default_rng(seed).standard_normal((8, 32)).astype(np.float32)  # (8, 32)
    writer.add_tensor("token_embd.weight", rows)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
