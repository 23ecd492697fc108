"""Configuration: one frozen dataclass per concern.

Only entry points (CLI, app) read argv and the environment; the app composes these
with the store's config into `chat.config.AppConfig` once and passes it down. Everything here is plain data with consistency checks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as found in a Hugging Face config (`rope_scaling`)."""

    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3"):
            raise ValueError(
                f"unsupported rope scaling type {self.kind!r}: supported are default, linear, llama3"
            )


@dataclass(frozen=True)
class ModelArgs:
    """Shape of a Llama-family decoder, derived from the Hugging Face config."""

    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int  # query heads H
    n_kv_heads: int  # KV heads Hkv
    head_dim: int  # D
    intermediate_size: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    arch: str = "llama"

    def __post_init__(self):
        assert self.n_heads % self.n_kv_heads == 0, (
            f"query heads {self.n_heads} must be a multiple of KV heads {self.n_kv_heads}"
        )
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

    @property
    def group(self) -> int:
        """G: query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        """Build from a transformers `PretrainedConfig` (Llama, Qwen2, Mistral)."""
        arch = getattr(config, "model_type", "llama")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            max_seq_len=config.max_position_embeddings,
            norm_eps=config.rms_norm_eps,
            rope_theta=_rope_theta(config),
            rope_scaling=_rope_scaling(config),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=attention_bias and arch != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            arch=arch,
        )


def _rope_params(config) -> dict:
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x used `rope_theta` / `rope_scaling`.
    params = getattr(config, "rope_parameters", None) or {}
    legacy = getattr(config, "rope_scaling", None) or {}
    return {**legacy, **params}


def _rope_theta(config) -> float:
    params = _rope_params(config)
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _rope_scaling(config) -> RopeScaling:
    params = _rope_params(config)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", config.max_position_embeddings)
        ),
    )


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpotlightConfig:
    """Spotlight decode attention. Each default is a measured choice (docs/DECISIONS.md)."""

    enabled: bool = True
    bits: int = 128  # C: code bits per query/key
    dense_layers: tuple[int, ...] = (0, 1)
    sinks: int = 4
    # The last 512 tokens, not the paper's 64: a small model leans on its recent context. At 10 %
    # perplexity / dense: Qwen2.5-Coder-0.5B 1.0054 (1.0106 with 256), SmolLM2-135M 1.0054 (1.0096);
    # Qwen's 8K needles 5 of 5 either way (session 8). 256 over 64 had turned SmolLM2's one missed
    # needle into a find. At 8K the 256 extra rows are ~3 % more of the context read (docs/DECISIONS.md).
    window: int = 512
    # Retrieved share of the cached tokens. 15 %, not the paper's 2 %: small models' attention is
    # flatter than a 7B model's, so they need more keys. SmolLM2-135M's needle grid found 14 of dense's
    # 18 needles at 10 % (6 at 2 %); at 32K tokens Qwen2.5-0.5B's document QA lost 5 of dense's answers
    # at 10 % and got 2 of them back at 15 % (and at 20 %; docs/DECISIONS.md, "The budget at 32K").
    ratio: float = 0.15
    k_min: int = 64  # retrieved tokens at least
    # Contexts shorter than this (at most the model's window: beyond.fitted_config) use dense attention
    # everywhere, each step in one compiled call that also codes the new keys (quantized.FusedStep).
    # 8,192, not 2,048: below it that step decoded faster than the sparse one. Side by side on an
    # Intel Xeon 2-core VM (session 41, 4 rounds, medians), through the engine: Qwen2.5-Coder-0.5B
    # 24.7 / 21.2 / 16.9 tokens/s at 4K / 8K / 16K against Spotlight's 18.1 / 17.2 / 16.5 (1.36x /
    # 1.24x / 1.03x); SmolLM2-135M 47.4 / 35.3 at 4K / 8K against 36.4 / 32.6. Through ChatService,
    # whose sources tally reads every row of its layers in a dense step: 20.0 against 18.2 at 8.1K
    # (1.10x) but 15.8 against 17.4 at 15.6K (0.91x), hence 8,192 and not 16,384. Below it the
    # replies are dense's own.
    dense_below: int = 8192
    # Inside the window the flat scan scores every cached code at every length: two-level retrieval
    # (blocks or stored spans by their code counts first) was no faster than the byte-plane flat scan at
    # this budget unless it lost recall, and was retired (docs/DECISIONS.md, "Two-level retrieval retired").
    # Past the model's native window every layer reads sinks + the last `far_window` tokens (true
    # distances) + the `far_retrieved` best others by their codes, re-positioned just before the
    # window (spotlight/beyond.py). A fixed number, not a share of N: about what the model was
    # trained to attend to (the oracle experiment: 2,048 + 2,048 held a needle at 16K).
    # 4,096 retrieved + 1,024 recent, not 2,048 + 2,048: Qwen2.5-Coder-0.5B's 131K needles (the
    # bench.longctx prompt prefilled once, the question and reply under each budget) were found 9
    # of 10 against 5 (2,048 + 2,048), 8 (4,096 + 2,048), 8 (6,144 + 2,048), 6 (3,072 + 1,024),
    # 7 (3,584 + 512); what is retrieved, not the recent window, finds the needles (docs/DECISIONS.md).
    far_window: int = 1024
    far_retrieved: int = 4096
    # A prefill chunk past the window (a document being read, the body of a long message) retrieves
    # this many instead: its rows are what later questions read, but each of its tokens also sees
    # its own sentence in the recent window, so the needles hang on the question's retrieval
    # (far_retrieved), not on this one. Qwen2.5-Coder-0.5B, 8K tokens read past its 32K window (ad hoc,
    # docs/DECISIONS.md): perplexity 31.73 at 4,096, 31.87 at 2,048, 32.06 at 1,024, 32.19 with
    # sinks + recent only; 120-130 tokens/s at 4,096, 149-160 at 2,048 (the first 8K ingest ~144).
    # bench.longctx at 131K: prefill 0.833x the first 8K's speed (0.759x at 4,096), needles 15 of
    # dense's 17 (14 at 4,096).
    far_prefill_retrieved: int = 2048
    # Past the window a key's code is compared with the query turned back by a multiple of this
    # many tokens, so every candidate is scored as if it lay [far_window, far_window + far_fold)
    # tokens back, where it is read after re-positioning (CodeSelector.select_far); scored at its
    # true distance, up to 30x what the codes were trained on, far noise crowds out the answer.
    # 0: true distances (docs/DECISIONS.md). At most half the model's window (beyond.fitted_config:
    # SmolLM2-135M's 8K window keeps 4,096). 8,192, not 4,096: half the turned-back queries to code
    # per layer and step; on Qwen2.5-Coder-0.5B's saved 131K context the 20 needles were answered
    # the same at 4,096, 8,192 and 16,384 (16 found; answer log-prob -1.00, -1.03, -1.10).
    far_fold: int = 8192
    # Past the window, the last `far_alone` prompt tokens before a reply (a question, a new turn)
    # run one at a time as decode steps, each selecting for its own query; the rest of a prompt,
    # and a document read without a reply, run in chunks that share one selection. Qwen2.5-Coder-
    # 0.5B's 131K needles (the bench.longctx prompt prefilled once, each question asked under each
    # rule): 14 of the 17 that dense finds inside its window with every question token alone, 13
    # in pieces of 4, 9 of 8, 7 of 16 and 7 as one chunk (the rule until then); the exact top-k
    # with one selection per chunk 12. A question of ~30 tokens costs ~30 decode steps
    # (docs/DECISIONS.md). 1: only the last token alone.
    far_alone: int = 64
    max_context: int = 1_000_000  # tokens a conversation may hold with Spotlight (the window without)

    def __post_init__(self):
        if not 32 <= self.bits <= 256 or self.bits % 32:
            raise ValueError(f"bits must be a multiple of 32 between 32 and 256; got {self.bits}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if min(self.sinks, self.window, self.k_min, self.dense_below) < 0:
            raise ValueError("sinks, window, k_min and dense_below must be >= 0")
        if min(self.far_window, self.far_retrieved, self.far_prefill_retrieved) < 1:
            raise ValueError("far_window, far_retrieved and far_prefill_retrieved must be >= 1")
        if self.far_alone < 1:
            raise ValueError(f"far_alone must be >= 1 (the prompt's last token always runs alone), got {self.far_alone}")
        if self.far_fold < 0:
            raise ValueError(f"far_fold must be >= 0 (0: score far tokens at their true distances), got {self.far_fold}")
        if self.max_context < 2:
            raise ValueError(f"a conversation must be allowed at least 2 tokens (max_context), got {self.max_context}")

    @property
    def words(self) -> int:
        """W: uint64 words per packed code."""
        return (self.bits + 63) // 64

    def budget(self, n_tokens: int) -> int:
        """Tokens attended per KV head at context length N: sinks + window + retrieved, capped at N."""
        retrieved = max(self.k_min, int(self.ratio * n_tokens))
        return min(n_tokens, self.sinks + self.window + retrieved)


def default_home() -> Path:
    """Data directory: $SPOTLIGHT_HOME, else the user's cache dir."""
    env = os.environ.get("SPOTLIGHT_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spotlight-chat"


WEIGHTS = ("quantized", "fp32")  # EngineConfig.weights
QUANTIZE = ("q8_0",)  # EngineConfig.quantize
ACTIVATIONS = ("int16", "fp32")  # EngineConfig.activations (kernels.quant.ACTIVATIONS, the kernels' names)
KV_DTYPES = ("auto", "float32", "float16")  # EngineConfig.kv_dtype
FAR_PRODUCTS = ("auto", "bfloat16", "float32")  # EngineConfig.far_products
# What each choice costs, in the words of `--help` and the Settings tab (SmolLM2-135M's numbers:
# docs/notes-quant.md).
WEIGHTS_HELP = ("a GGUF's weights: quantized (default) decodes from the file's blocks, no fp32 copy (~1/5 of the "
                "bytes per token, ~0.5 GB peak at load); fp32 first writes a dequantised copy (~4x the GGUF on disk, "
                "a slower first start, ~1.7 GB peak) and reads ~5x the bytes per token")
ACTIVATIONS_HELP = ("a quantized model's one-row products: int16 (default) rounds each decode step's input to int16 "
                    "in runs of 32 and sums exact integer products, 1.2-1.7x faster on the large matrices (products "
                    "move by ~3e-5 relative); fp32 multiplies the exact weights by the input in fp32")
KV_DTYPE_HELP = ("how cached keys and values are kept, in memory and in the cache files: float16 takes half the "
                 "memory and disk of float32 per token (each value rounds by at most ~5e-4 relative; every product "
                 "and sum is still fp32; perplexity moved 4e-5 relative on SmolLM2); auto (default) is float16 on "
                 "the CPU and the model's own dtype on a GPU")
FAR_PRODUCTS_HELP = ("the weight products of a quantized model's prefill chunks past its own context window (a long "
                     "document being read): bfloat16 rounds their inputs to bf16 and sums in fp32, ~1.4x the "
                     "tokens/s there on a CPU with bf16 dot products (AVX512-BF16 or AMX); after 4,096 such tokens "
                     "Qwen2.5-0.5B's next-token logits moved by 1.8 percent of their largest value, the top token the "
                     "same; float32 keeps them exact; auto (default) is bfloat16 where the CPU has them. Inside the "
                     "window every product stays fp32")
QUANTIZE_HELP = ("q8_0: quantize a Hugging Face model's linears at load (seconds; the load still peaks at the fp32 "
                 "size) so decode reads ~1/4 of the fp32 bytes per token; logits move by ~1e-2 relative (default: off)")


def default_kernel_threads() -> int:
    """EngineConfig.kernel_threads' default: 2, or 1 where this process may use one core only."""
    return min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


KERNEL_THREADS_HELP = ("threads of the decode kernels (default: 2, or 1 on a 1-core machine; results are the same "
                       "at any count: 2 decoded Qwen2.5-0.5B 1.8x faster at 1K tokens than 1 on an idle 2-core CPU, "
                       "while on a busy one a parallel step can wait for a core)")


@dataclass(frozen=True)
class EngineConfig:
    """Which model runs where, and how prefill is chunked."""

    model_path: str | None = None  # a packaged model's name or a path; None: the default (loading.DEFAULT_MODEL)
    # Where packaged models' package directories are looked for (folders named as the packages);
    # None: the installed packages. Set from $SPOTLIGHT_PACKAGES by the entry points (tests, a copy elsewhere).
    packages_dir: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    prefill_chunk: int = 1024  # tokens per prefill forward: 1024 measured 3-14 % faster than 512 at 1K-4K, 2048 slower
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    # Threads of the decode kernels (weight GEMVs, attention, retrieval: kernels.set_threads; the
    # results are bit-identical at any count). Default 2 where 2 cores are there: Qwen2.5-0.5B decoded
    # 1.8x faster at 1K and 1.4x at 8K on 2 than on 1 (docs/DECISIONS.md, "Kernel threads").
    kernel_threads: int = field(default_factory=default_kernel_threads)
    encoder_path: str | None = None  # Spotlight encoder checkpoint; None: the shipped one if it matches
    # Host K/V memory kept mapped in for one cache of this many tokens (spotlight/cache.py BufferPool),
    # so a resume does not fault in fresh pages; None: the model's window, at most 16384; 0: off.
    kv_pool_tokens: int | None = None
    # "quantized": a GGUF model's decode reads the file's blocks (spotlight/quantized.py; ~1/6 of the
    # fp32 bytes for SmolLM2); "fp32": every product on the dequantised fp32 copy. Hugging Face
    # directories are always fp32. Quantized needs device cpu and dtype float32, else fp32 is used.
    weights: str = "quantized"
    # "q8_0": a Hugging Face model's linears are quantized at load into Q8_0 blocks and decoded by
    # the quantized kernels (~27 % of the fp32 bytes per token; load takes the quantization time
    # and peaks at the fp32 model's memory). None: fp32. GGUF models ignore it (already quantized).
    quantize: str | None = None
    # The quantized kernels' activations in decode steps (ACTIVATIONS_HELP): "int16" rounds x to
    # int16 in runs of 32 and sums exact integer products (kernels/quant.c; measured faster, its
    # perplexity change in bench.quality, docs/DECISIONS.md); "fp32" keeps x in fp32. Prefill and
    # fp32 models are unaffected.
    activations: str = "int16"
    # How cached K/V rows are stored (KV_DTYPE_HELP): "float16" under fp32 compute halves the
    # cache's memory and span files, the rows widened to fp32 as the attention kernels read them
    # (kernels/attend.c); "auto" is float16 on the CPU, else dtype; "float32" keeps them as computed.
    # A kv_dtype other than dtype is CPU only.
    kv_dtype: str = "auto"
    # The weight products of a quantized model's prefill chunks past its native window (FAR_PRODUCTS_HELP):
    # "bfloat16" runs them on bf16 inputs with fp32 sums (torch's oneDNN GEMM), 2.6x fp32's GFLOP/s on
    # this AVX512-BF16 CPU and 1.33-1.44x the tokens/s of a chunk there (docs/DECISIONS.md, "bf16 weight
    # products past the window"); past the window attention already reads a retrieved subset, and inside
    # it nothing changes. "auto": bfloat16 where the CPU multiplies bf16 natively, else "float32" (exact).
    far_products: str = "auto"

    @property
    def cache_dtype(self) -> str:
        """The K/V dtype `kv_dtype` resolves to ("float32", "float16" or "bfloat16")."""
        if self.kv_dtype == "auto":
            return "float16" if self.device == "cpu" and self.dtype == "float32" else self.dtype
        return self.kv_dtype

    def __post_init__(self):
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {self.kv_dtype!r}")
        if self.kv_dtype not in ("auto", self.dtype) and self.device != "cpu":
            raise ValueError(f"kv_dtype {self.kv_dtype} differs from dtype {self.dtype}, which only the CPU "
                             f"kernels read; use device cpu, or kv_dtype auto on {self.device}")
        if self.far_products not in FAR_PRODUCTS:
            raise ValueError(f"far_products must be one of {', '.join(FAR_PRODUCTS)}; got {self.far_products!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}; got {self.activations!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)} or None; got {self.quantize!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}; got {self.weights!r}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < 0:
            raise ValueError(f"kv_pool_tokens must be >= 0 (0 turns the pool off), got {self.kv_pool_tokens}")
        if self.kernel_threads < 1:
            raise ValueError(f"kernel_threads must be >= 1, got {self.kernel_threads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16; got {self.dtype!r}")


@dataclass(frozen=True)
class TrainingJobConfig:
    """How encoder training from Settings runs (spotlight/training.py): `python -m spotlight.train`
    in a child process at lower priority on `threads` torch threads, so the chat stays responsive,
    saving its state every `save_every` steps (Cancel saves it too). `options`: more
    `python -m spotlight.train` options (tests pass a tiny run's); the defaults train what the
    shipped SmolLM2 encoders were trained with. `cancel_seconds`: how long Cancel waits for the
    child to save its state and exit before it is killed (its last saved state is kept)."""

    threads: int = 1
    nice: int = 10
    save_every: int = 500
    options: tuple[str, ...] = ()
    cancel_seconds: float = 120.0

    def __post_init__(self):
        if self.threads < 1 or self.save_every < 1:
            raise ValueError(f"training needs at least 1 thread and a state saved at least every step; got "
                             f"threads {self.threads}, save_every {self.save_every}")
