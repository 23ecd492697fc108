"""The engine: a loaded model + tokenizer, and the only calls code outside spotlight/ makes.

    engine = Engine.load(EngineConfig(), home, spotlight=SpotlightConfig())
    context = engine.new_context()
    meter = ReadMeter()
    for step in engine.stream(context, engine.chat_ids(messages), sampling, observers=[meter]):
        print(step.text, end="")

Everything a caller needs goes through `Engine` (tokenizer, prefill, stream with observers,
fingerprints, which way it decodes, `with_spotlight`, `warm_up`) and `Context` (its token ids
and the row API that stored spans use). The model, policy and tokenizer attributes are the
engine's own; callers never swap them.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

import kernels

from . import loading
from .attention import CodeSelector, DecodePolicy, DenseDecode, SpotlightDecode
from .beyond import fitted_config
from .cache import BufferPool, KVCache, kv_buffer_bytes
from .config import EngineConfig, ModelArgs, SamplingConfig, SpotlightConfig
from .errors import ContextTooLong, DeviceUnavailable, EncoderMismatch
from .hashing import EncoderSpec, Encoders, checkpoint_matches, load_encoders
from .heap import release_freed_memory
from .generate import Context, ProgressFn, Step, prefill, stream
from .model import Transformer, build_model
from .observers import StepObserver
from .onerow import use_onerow_linear
from .quantized import build_quantized_model, far_dtype, quantize_to_q8_0, use_fused_decode
from .tokens import PieceTokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INITIAL_CAPACITY = 1024  # tokens; the cache grows geometrically beyond this
_POOL_TOKENS_MAX = 16384  # the default buffer pool covers the model's window up to this many tokens (see _pool_tokens)
_WARM_UP_TOKENS = 2  # tokens decoded by warm_up: the first runs the decode path once
# Until cached rows live outside RAM (issue #21, Build 3) one conversation's K/V rows, key codes and
# byte planes must fit in memory: past the window they may take at most this share of the machine's
# physical RAM.
KV_MEMORY_SHARE = 0.5
CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"  # shipped encoder checkpoints
log = logging.getLogger("spotlight")


@dataclass(frozen=True)
class Fingerprints:
    """What cached K/V and key codes depend on: a stored span is reused only when all match."""

    model: str  # the model's weights (loading.ModelSource.fingerprint)
    encoders: str  # the Spotlight encoders behind the key codes; "" when the engine has no codes
    kv_dtype: str  # dtype name of the K/V cache rows, e.g. "float32"


@dataclass
class Engine:
    """A loaded model, tokenizer and decode policy (see the module docstring)."""

    config: EngineConfig
    args: ModelArgs
    model: Transformer
    tokenizer: object
    source: loading.ModelSource
    policy: DecodePolicy
    load_seconds: float = 0.0
    warnings: tuple[str, ...] = ()
    buffers: BufferPool = field(default_factory=lambda: BufferPool(0))  # kept K/V memory (KVCache)
    encoder_dirs: tuple[Path, ...] = (CHECKPOINTS,)  # where trained encoders are looked for (encoder_dirs)

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
        source = loading.resolve(config.model_path, home, fp32_weights=not wants_quantized(config),
                                 locate=loading.locator(config.packages_dir))
        args = loading.load_args(source)
        tokenizer = loading.load_tokenizer(source)
        if quantizes(config, source):  # built from the GGUF's blocks, no fp32 copy (spotlight/quantized.py)
            model, _ = build_quantized_model(source.gguf_file, args, config.activations, far_dtype(config.far_products))
        else:
            model = build_model(args, loading.load_state_dict(source), dtype=_DTYPES[config.dtype],
                                device=config.device)
        use_onerow_linear(model)  # decode steps' weight products on the one-row kernel (spotlight/onerow.py)
        if config.quantize == "q8_0" and source.gguf_file is None and wants_quantized(config):
            # a Hugging Face model's linears into Q8_0 blocks
            quantize_to_q8_0(model, config.activations, far_dtype(config.far_products))
        use_fused_decode(model)  # decode steps' block work in compiled calls where the linears allow
        policy, warnings = DenseDecode(), []
        if spotlight is not None and spotlight.enabled:
            spotlight = fitted_config(spotlight, args.max_seq_len, config.prefill_chunk)
            encoders, warnings = find_encoders(args, source.fingerprint, spotlight.bits, config.encoder_path,
                                               encoder_dirs(home))
            policy = SpotlightDecode(spotlight, CodeSelector(encoders.to(config.device)))
        for warning in warnings:
            log.warning(warning)
        buffers = BufferPool(2 * kv_buffer_bytes(args, kv_dtype(config, model), _pool_tokens(config, args)))
        release_freed_memory()  # what reading the files left in the heap (the tokenizer's parse: ~50 MiB)
        return cls(config, args, model, tokenizer, source, policy, time.perf_counter() - started, tuple(warnings),
                   buffers, encoder_dirs(home))

    def with_spotlight(self, spotlight: SpotlightConfig) -> "Engine":
        """This engine decoding as `spotlight` says: itself when it already does, else a new
        Engine sharing model, tokenizer and buffers with a new decode policy. The encoders are
        kept when their code width fits, else found as `load` finds them. This engine is left
        unchanged, so a reply still running on it is not affected."""
        if not spotlight.enabled:
            return self if self.decodes_densely else dataclasses.replace(self, policy=DenseDecode(), warnings=())
        spotlight = fitted_config(spotlight, self.args.max_seq_len, self.config.prefill_chunk)
        if self.spotlight == spotlight:
            return self
        selector = self.policy.selector if isinstance(self.policy, SpotlightDecode) else None
        encoders = getattr(selector, "encoders", None)  # a CodeSelector's; other selectors have none
        warnings = self.warnings
        if encoders is None or encoders.spec.bits != spotlight.bits:
            encoders, found = find_encoders(self.args, self.fingerprint, spotlight.bits, self.config.encoder_path,
                                            self.encoder_dirs)
            encoders, warnings = encoders.to(self.config.device), tuple(found)
        return dataclasses.replace(self, policy=SpotlightDecode(spotlight, CodeSelector(encoders)), warnings=warnings)

    def with_encoders_found(self) -> "Engine":
        """This engine with its Spotlight encoders looked up again in `encoder_dirs` (a checkpoint
        trained since it loaded, from Settings: spotlight/training.py): itself when it decodes
        densely, uses an explicit `encoder_path`, or finds the encoders it has; else a new Engine
        sharing model, tokenizer and buffers. This engine is left unchanged (as `with_spotlight`)."""
        if self.spotlight is None or self.config.encoder_path is not None:
            return self
        encoders, warnings = find_encoders(self.args, self.fingerprint, self.spotlight.bits, None, self.encoder_dirs)
        current = getattr(self.policy.selector, "encoders", None)  # a CodeSelector's; other selectors have none
        if current is not None and current.fingerprint == encoders.fingerprint:
            return self
        policy = SpotlightDecode(self.spotlight, CodeSelector(encoders.to(self.config.device)))
        return dataclasses.replace(self, policy=policy, warnings=tuple(warnings))

    @property
    def uses_trained_encoders(self) -> bool:
        """Whether Spotlight decodes with trained encoders (False: untrained codes, or dense)."""
        encoders = getattr(getattr(self.policy, "selector", None), "encoders", None)
        return self.spotlight is not None and encoders is not None and encoders.trained

    def warm_up(self) -> float:
        """One short prefill + decode on a throwaway context; the seconds it took. The buffer
        pool is prefaulted first; with Spotlight the decode also runs once through the sparse path
        in every layer, so the first long reply does not pay the selection and attention kernels'
        one-time start (~5 s on 2 cores when numba compiles them, milliseconds from its cache)."""
        started = time.perf_counter()
        self.prefault_buffers()  # the first resume's K/V memory, mapped in now rather than then
        ids = self.encode("Warm up.") or [0]
        sampling = SamplingConfig(max_new_tokens=_WARM_UP_TOKENS)
        for _ in self.stream(self.new_context(len(ids) + _WARM_UP_TOKENS), ids, sampling):
            pass
        if self.spotlight is not None:
            sparse = dataclasses.replace(self.spotlight, dense_layers=(), dense_below=0, sinks=1, window=1, k_min=1)
            policy = SpotlightDecode(sparse, self.policy.selector)
            context = self.new_context(len(ids) + _WARM_UP_TOKENS)
            for _ in stream(self.model, self.tokenizer, context, ids, policy, sampling, eos_ids=set(),
                            max_context=self.max_context, chunk=self.config.prefill_chunk):
                pass
        return time.perf_counter() - started

    @property
    def max_context(self) -> int:
        """The most tokens a conversation may hold: Spotlight's cap (`max_context`), reading past
        the model's window through retrieval (spotlight/beyond.py), and no more than `memory_tokens`;
        the window when dense."""
        if self.spotlight is None:
            return self.native_window
        return max(min(self.spotlight.max_context, self.memory_tokens), self.native_window)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V rows one cached token takes (every layer and KV head)."""
        itemsize = self.kv_dtype.itemsize
        return 2 * self.args.n_layers * self.args.n_kv_heads * self.args.head_dim * itemsize

    @property
    def stored_bytes_per_token(self) -> int:
        """Bytes one cached token takes in a span file: its K/V rows and, with Spotlight, its key
        codes (a file's header and code summaries are a few KB per span on top)."""
        return self.kv_bytes_per_token + self.code_bytes_per_token

    @property
    def code_bytes_per_token(self) -> int:
        """Bytes of one cached token's key codes (every layer and KV head); 0 without Spotlight."""
        return 0 if self.spotlight is None else self.args.n_layers * self.args.n_kv_heads * self.spotlight.bits // 8

    @property
    def memory_bytes_per_token(self) -> int:
        """Bytes one cached token holds in RAM: its K/V rows and, with Spotlight, its key codes, which
        a host cache also keeps as byte planes for the far scan (kernels/planes.py): their bytes twice."""
        planes = self.spotlight is not None and self.config.device == "cpu" and kernels.planes_fit(
            self.args.n_heads, self.args.n_kv_heads, kernels.words_for(self.spotlight.bits))
        return self.stored_bytes_per_token + (self.code_bytes_per_token if planes else 0)

    @property
    def kv_dtype(self) -> torch.dtype:
        """How the cache stores K/V rows (EngineConfig.kv_dtype: float16 on the CPU by default)."""
        return kv_dtype(self.config, self.model)

    @property
    def memory_tokens(self) -> int:
        """The most tokens whose cached rows (memory_bytes_per_token) fit in KV_MEMORY_SHARE of this
        machine's physical RAM."""
        return int(KV_MEMORY_SHARE * physical_memory_bytes()) // self.memory_bytes_per_token

    @property
    def memory_bound(self) -> bool:
        """True when this machine's memory, not Spotlight's cap, limits a conversation's length."""
        return self.spotlight is not None and self.memory_tokens < self.spotlight.max_context

    @property
    def far_products(self) -> str:
        """What prefill chunks past the native window multiply their weights in: "bfloat16" where
        EngineConfig.far_products lowered a quantized model's products, else "float32"."""
        return "float32" if self.model.far_products is None else "bfloat16"

    @property
    def native_window(self) -> int:
        """The model's own context window (what it was trained on), in tokens."""
        return self.args.max_seq_len

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint (`fingerprints.model`)."""
        return self.source.fingerprint

    @property
    def fingerprints(self) -> Fingerprints:
        dtype = str(self.kv_dtype).removeprefix("torch.")  # the stored spans' precision
        return Fingerprints(self.source.fingerprint, self.policy.encoder_fingerprint, dtype)

    @property
    def spotlight(self) -> SpotlightConfig | None:
        """The Spotlight configuration the engine decodes with; None when it decodes densely."""
        return self.policy.spotlight

    @property
    def decodes_densely(self) -> bool:
        return self.spotlight is None

    @property
    def eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            token = self.tokenizer.convert_tokens_to_ids(name)
            if isinstance(token, int) and token != self.tokenizer.unk_token_id:
                ids.add(token)
        return {i for i in ids if i is not None}

    def new_context(self, capacity: int = _INITIAL_CAPACITY) -> Context:
        """An empty Context with room for `capacity` tokens (it grows beyond)."""
        cache = KVCache(self.args, capacity, dtype=self.kv_dtype,
                        device=self.config.device, code_words=self.policy.code_words, pool=self.buffers)
        return Context(cache)

    def prefault_buffers(self) -> None:
        """Fill the buffer pool now with one cache's K and V for `kv_pool_tokens` tokens, every
        page written once, so the next long context (a resume) does not fault them in."""
        if self.config.device == "cpu" and self.buffers.max_bytes:
            self.buffers.prefault(self.buffers.max_bytes // 2, 2)

    @functools.cached_property
    def pieces(self) -> PieceTokenizer:
        """The tokenizer with each piece between added tokens memoised (spotlight/tokens.py)."""
        return PieceTokenizer(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (memoised piece by piece)."""
        return self.pieces(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def count_tokens(self, text: str) -> int:
        return len(self.pieces(text))

    def token_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids of `text`, the char offset where each token starts), in one tokenizer pass.

        Needs a tokenizer that reports offsets (Hugging Face fast tokenizers, as `load` loads
        them, and spotlight/testing.py's ByteTokenizer); the ids equal `encode(text)`."""
        try:
            encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError as error:  # a slow (Python) Hugging Face tokenizer
            raise ValueError("token offsets need a fast (Rust) Hugging Face tokenizer; give the model "
                             "directory a tokenizer.json") from error
        return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]

    def chat_text(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """A conversation rendered by the model's chat template, as text (special tokens included)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def chat_ids(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template (its text, tokenised
        piece by piece: a long document already seen in this process is not tokenised again)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.pieces(text)

    def check_fits(self, n_tokens: int, reply_tokens: int = 0) -> None:
        """Raise ContextTooLong unless `n_tokens` + `reply_tokens` fit `max_context`."""
        if n_tokens + reply_tokens <= self.max_context:
            return
        if self.spotlight is None:
            raise ContextTooLong(
                f"{n_tokens:,} prompt tokens + {reply_tokens:,} reply tokens exceed the model's context "
                f"window of {self.max_context:,} tokens with Spotlight off; turn Spotlight on to read "
                f"beyond the window, or shorten the input"
            )
        why = " (what this machine's memory holds)" if self.memory_bound else ""
        raise ContextTooLong(
            f"{n_tokens:,} prompt tokens + {reply_tokens:,} reply tokens exceed the limit of "
            f"{self.max_context:,} tokens per conversation{why}; shorten the input or raise the limit"
        )

    def prefill(self, context: Context, ids: list[int], *, progress: ProgressFn | None = None,
                cancel: threading.Event | None = None) -> bool:
        """Append `ids` to the context in chunks of `config.prefill_chunk`; True when all were
        appended, False when cancelled (the context then holds the chunks computed, consistently).
        `progress(done, total)` is called after each chunk."""
        start = len(context.tokens)
        self.check_fits(start + len(ids))
        prefill(self.model, context, ids, self.policy, chunk=self.config.prefill_chunk, cancel=cancel,
                progress=progress)
        return len(context.tokens) == start + len(ids)

    def stream(
        self, context: Context, prompt_ids: list[int], sampling: SamplingConfig,
        *, cancel: threading.Event | None = None, progress: ProgressFn | None = None,
        observers: Sequence[StepObserver] = (),
    ) -> Iterator[Step]:
        """Prefill what the context lacks of `prompt_ids`, then decode: one Step per token, the
        last with the finish reason and Stats. Each decode step reports to `observers`
        (spotlight/observers.py) for this call only."""
        return stream(
            self.model, self.tokenizer, context, prompt_ids, self.policy, sampling,
            eos_ids=self.eos_ids, max_context=self.max_context, chunk=self.config.prefill_chunk,
            cancel=cancel, progress=progress, observers=observers,
        )


def kv_dtype(config: EngineConfig, model) -> torch.dtype:
    """The cache's K/V dtype (EngineConfig.cache_dtype: float16 on the CPU unless set); where that
    is the compute dtype, the rows as the model computes them (its embedding's dtype)."""
    if config.cache_dtype == config.dtype:
        return model.tok_embeddings.weight.dtype
    return _DTYPES[config.cache_dtype]


def wants_quantized(config: EngineConfig) -> bool:
    """Whether a GGUF model would keep its weights quantized under this config (config.weights)."""
    return config.weights == "quantized" and config.device == "cpu" and config.dtype == "float32"


def quantizes(config: EngineConfig, source: loading.ModelSource) -> bool:
    """Whether the model keeps its GGUF weights quantized (read from the file, no fp32 copy)."""
    return wants_quantized(config) and source.gguf_file is not None


def _pool_tokens(config: EngineConfig, args: ModelArgs) -> int:
    """Tokens of the cache the buffer pool keeps memory for (0: no pool; host caches only).

    At most _POOL_TOKENS_MAX: a kept buffer serves a cache that needs at least half of it
    (BufferPool.take), so Qwen2.5's whole 32K window prefaulted 384 MiB at warm-up that no
    conversation under 16K tokens could use; an 8K one allocated 96 MiB more beside it (app path
    at 8K, ad hoc: peak 1,538-1,551 MiB, 1,228-1,235 with 16K; docs/DECISIONS.md)."""
    if config.device != "cpu":
        return 0
    return min(args.max_seq_len, _POOL_TOKENS_MAX) if config.kv_pool_tokens is None else config.kv_pool_tokens


def encoder_dirs(home: Path) -> tuple[Path, ...]:
    """Where trained encoder checkpoints are looked for, in order: the shipped ones, then the
    user's own under `<home>/encoders` (what training from Settings writes)."""
    return (CHECKPOINTS, Path(home) / "encoders")


def trained_encoders(fingerprint: str, bits: int, dirs: tuple[Path, ...]) -> Path | None:
    """The first checkpoint in `dirs` trained for this model fingerprint at `bits`, read from its
    metadata only (cheap enough to label every installed model); None when there is none."""
    for directory in dirs:
        for candidate in sorted(Path(directory).glob("*.safetensors")):
            if checkpoint_matches(candidate, fingerprint, bits):
                return candidate
    return None


def find_encoders(args: ModelArgs, fingerprint: str, bits: int, path: str | None,
                  dirs: tuple[Path, ...] = (CHECKPOINTS,)) -> tuple[Encoders, list[str]]:
    """The encoder checkpoint for this model: the given path, else the first one in `dirs` whose
    model fingerprint and bits match, else untrained identity-like encoders (with a warning)."""
    if path is not None:  # an explicit checkpoint must fit; errors are the user's to fix
        return load_encoders(Path(path), model_fingerprint=fingerprint, bits=bits), []
    found = trained_encoders(fingerprint, bits, dirs)
    if found is not None:
        return load_encoders(found, model_fingerprint=fingerprint, bits=bits), []
    warning = (f"no trained Spotlight encoders for this model at {bits} bits: using untrained (identity-like) "
               f"codes, which retrieve less precisely; train them in Settings -> Encoders or with "
               f"`python -m spotlight.train`")
    return Encoders(EncoderSpec.for_model(args, bits), model_fingerprint=fingerprint), [warning]


def physical_memory_bytes() -> int:
    """This machine's physical RAM in bytes (POSIX sysconf; 16 GiB where it cannot be read)."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 16 << 30
