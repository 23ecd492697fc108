"""The engine: a loaded model + tokenizer, and the calls the chat service and CLI make.

    engine = Engine.load(EngineConfig(), home)
    context = engine.new_context()
    for step in engine.stream(context, engine.chat_ids(messages), sampling):
        print(step.text, end="")
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import kernels

from . import loading
from .attention import CodeSelector, DenseDecode, SpotlightDecode
from .cache import BufferPool, KVCache, kv_buffer_bytes
from .config import EngineConfig, ModelArgs, SamplingConfig, SpotlightConfig
from .errors import ContextTooLong, DeviceUnavailable, EncoderMismatch
from .hashing import EncoderSpec, Encoders, load_encoders
from .generate import Context, ProgressFn, Step, stream
from .model import Transformer, build_model
from .tokens import SegmentEncoder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INITIAL_CAPACITY = 1024  # tokens; the cache grows geometrically beyond this
_POOL_TOKENS_MAX = 32768  # the default buffer pool covers the model's window up to this many tokens
CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"  # shipped encoder checkpoints
log = logging.getLogger("spotlight")


@dataclass
class Engine:
    config: EngineConfig
    args: ModelArgs
    model: Transformer
    tokenizer: object
    source: loading.ModelSource
    policy: object
    load_seconds: float = 0.0
    warnings: tuple[str, ...] = ()
    buffers: BufferPool = field(default_factory=lambda: BufferPool(0))  # kept K/V memory (KVCache)

    @classmethod
    def load(cls, config: EngineConfig, home: Path, spotlight: SpotlightConfig | None = None) -> "Engine":
        """Resolve (and on first use convert) the model, then load weights, tokenizer and encoders.

        `spotlight=None` (or disabled) decodes densely.
        """
        started = time.perf_counter()
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise DeviceUnavailable("CUDA was requested but no GPU is available; use --device cpu")
        if config.threads:
            torch.set_num_threads(config.threads)
        kernels.set_threads(config.kernel_threads)  # ValueError naming the limit when numba has fewer
        source = loading.resolve(config.model_path, home)
        _, args = loading.load_config(source)
        tokenizer = loading.load_tokenizer(source)
        model = build_model(args, loading.load_state_dict(source), dtype=_DTYPES[config.dtype], device=config.device)
        policy, warnings = DenseDecode(), []
        if spotlight is not None and spotlight.enabled:
            encoders, warnings = find_encoders(args, source.fingerprint, spotlight.bits, config.encoder_path)
            policy = SpotlightDecode(spotlight, CodeSelector(encoders.to(config.device)))
        for warning in warnings:
            log.warning(warning)
        buffers = BufferPool(2 * kv_buffer_bytes(args, _DTYPES[config.dtype], _pool_tokens(config, args)))
        return cls(config, args, model, tokenizer, source, policy, time.perf_counter() - started, tuple(warnings),
                   buffers)

    @property
    def max_context(self) -> int:
        return self.args.max_seq_len

    @property
    def fingerprint(self) -> str:
        return self.source.fingerprint

    @property
    def eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            token = self.tokenizer.convert_tokens_to_ids(name)
            if isinstance(token, int) and token != self.tokenizer.unk_token_id:
                ids.add(token)
        return {i for i in ids if i is not None}

    def new_context(self, capacity: int = _INITIAL_CAPACITY) -> Context:
        cache = KVCache(self.args, capacity, dtype=self.model.tok_embeddings.weight.dtype,
                        device=self.config.device, code_words=self.policy.code_words, pool=self.buffers)
        return Context(cache)

    def prefault_buffers(self) -> None:
        """Fill the buffer pool now with one cache's K and V for `kv_pool_tokens` tokens, every
        page written once, so the next long context (a resume) does not fault them in."""
        if self.config.device == "cpu" and self.buffers.max_bytes:
            self.buffers.prefault(self.buffers.max_bytes // 2, 2)

    @functools.cached_property
    def segments(self) -> SegmentEncoder:
        """The tokenizer with each piece between added tokens memoised (spotlight/tokens.py)."""
        return SegmentEncoder(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.segments(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_text(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """A conversation rendered by the model's chat template, as text (special tokens included)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def token_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids of `text`, the character offset where each token starts), in one pass.

        Fast tokenizers report offsets themselves; for others each token's start is the length
        of the text its predecessors decode to (exact for byte- and piece-level vocabularies)."""
        tokenizer = self.tokenizer
        if getattr(tokenizer, "is_fast", False):
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        starts, position = [], 0
        for token in ids:
            starts.append(position)
            position += len(tokenizer.decode([token], skip_special_tokens=False))
        return ids, starts

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (its text, tokenised
        piece by piece: a long document already seen in this process is not tokenised again)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.segments(text)

    def check_fits(self, n_tokens: int, reply_tokens: int = 0) -> None:
        if n_tokens + reply_tokens > self.max_context:
            raise ContextTooLong(
                f"{n_tokens} prompt tokens + {reply_tokens} reply tokens exceed the model's context "
                f"window of {self.max_context} tokens; shorten the input or lower max_new_tokens"
            )

    def stream(
        self, context: Context, prompt_ids: list[int], sampling: SamplingConfig,
        *, cancel: threading.Event | None = None, progress: ProgressFn | None = None,
    ) -> Iterator[Step]:
        return stream(
            self.model, self.tokenizer, context, prompt_ids, self.policy, sampling,
            eos_ids=self.eos_ids, max_context=self.max_context, chunk=self.config.prefill_chunk,
            cancel=cancel, progress=progress,
        )


def _pool_tokens(config: EngineConfig, args: ModelArgs) -> int:
    """Tokens of the cache the buffer pool keeps memory for (0: no pool; host caches only)."""
    if config.device != "cpu":
        return 0
    return min(args.max_seq_len, _POOL_TOKENS_MAX) if config.kv_pool_tokens is None else config.kv_pool_tokens


def find_encoders(args: ModelArgs, fingerprint: str, bits: int, path: str | None) -> tuple[Encoders, list[str]]:
    """The encoder checkpoint for this model: the given path, else a shipped one whose model
    fingerprint matches, else untrained identity-like encoders (with a warning saying so)."""
    if path is not None:  # an explicit checkpoint must fit; errors are the user's to fix
        return load_encoders(Path(path), model_fingerprint=fingerprint, bits=bits), []
    for candidate in sorted(CHECKPOINTS.glob("*.safetensors")):
        try:
            return load_encoders(candidate, model_fingerprint=fingerprint, bits=bits), []
        except EncoderMismatch:
            continue
    warning = (f"no trained Spotlight encoders for this model at {bits} bits: using untrained (identity-like) "
               f"codes, which retrieve less precisely; train them with `python -m spotlight.train`")
    return Encoders(EncoderSpec.for_model(args, bits), model_fingerprint=fingerprint), [warning]
