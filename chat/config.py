"""The app's configuration: every part's config composed once at the entry point (app.py, bench).

Each part owns its own frozen dataclass (`spotlight.config` for the engine, sampling and
Spotlight; `memory.config` for the store); `AppConfig` only composes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from memory.config import StoreConfig
from spotlight.config import (ACTIVATIONS, ACTIVATIONS_HELP, FAR_PRODUCTS, FAR_PRODUCTS_HELP, KERNEL_THREADS_HELP, KV_DTYPE_HELP, KV_DTYPES, QUANTIZE, QUANTIZE_HELP,
                              WEIGHTS, WEIGHTS_HELP, EngineConfig, SamplingConfig, SpotlightConfig, default_home)
from spotlight.config import TrainingJobConfig

# Regenerate samples (a greedy rerun would repeat the reply word for word): at this temperature and
# top-p when the configured sampling is greedy, else at the configured ones; a fresh seed each time.
REGENERATE_TEMPERATURE = 0.7
REGENERATE_TOP_P = 0.9

__all__ = ["GB", "size_text", "ACTIVATIONS", "ACTIVATIONS_HELP", "FAR_PRODUCTS", "FAR_PRODUCTS_HELP", "KERNEL_THREADS_HELP", "KV_DTYPE_HELP", "KV_DTYPES", "MB", "QUANTIZE", "QUANTIZE_HELP", "REGENERATE_TEMPERATURE",
           "REGENERATE_TOP_P", "SOURCES", "WEIGHTS",
           "WEIGHTS_HELP", "AppConfig", "EngineConfig", "SamplingConfig", "SpotlightConfig", "StoreConfig",
           "TrainingJobConfig", "UploadLimits"]

MB = 1000 * 1000  # bytes: the megabyte file managers show
GB = 1000 * MB


def size_text(n_bytes: int) -> str:
    """A size as file managers show it: '850 KB', '4.2 MB', '310 MB', '13.1 GB'."""
    if n_bytes < MB:
        return f"{n_bytes / 1000:,.0f} KB"
    if n_bytes < GB:
        return f"{n_bytes / MB:,.1f} MB" if n_bytes < 10 * MB else f"{n_bytes / MB:,.0f} MB"
    return f"{n_bytes / GB:,.1f} GB"


@dataclass(frozen=True)
class UploadLimits:
    """What one uploaded file may be; both are checked before any long work.

    `max_bytes` is checked against the file's size on disk before it is read (the refusal
    reads nothing). 20 MB: the text that fits any window we target is far smaller (a
    32K-token window holds ~130 KB of prose), but PDFs and .docx files carry fonts and
    images, and a 100-page report with figures is commonly 2-20 MB; beyond 20 MB an upload
    is almost always a scan or a media-heavy file with little usable text, while reading a
    20 MB file stays cheap (~2x its size in memory, under a second for text). `max_tokens`
    caps one document's tokens (None: only the model's context window does); tokens are
    counted in slices that stop at the cap, so a long text costs ~`max_tokens` tokens of
    work and no list of ids."""

    max_bytes: int = 20 * MB
    max_tokens: int | None = None

    def __post_init__(self):
        if self.max_bytes <= 0:
            raise ValueError(f"the upload size limit must be positive, got {self.max_bytes} bytes")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"the document token limit must be positive, got {self.max_tokens}")


SOURCES = ("related", "all")  # AppConfig.sources


@dataclass(frozen=True)
class AppConfig:
    """Everything the app needs, composed once at the entry point."""

    home: Path = field(default_factory=default_home)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(repetition_penalty=1.1))
    spotlight: SpotlightConfig = field(default_factory=SpotlightConfig)
    uploads: UploadLimits = field(default_factory=UploadLimits)
    training: TrainingJobConfig = field(default_factory=TrainingJobConfig)  # encoders trained from Settings
    # Chosen by bench.docqa (docs/DECISIONS.md, "Prompt framing"): the instruction to answer briefly in
    # the document's words, in the system prompt, so what the user typed is sent as typed.
    system_prompt: str = ("You are a helpful assistant. Answer from the document when one is given, in a few words, "
                          "with the document's own wording.")
    # tokens a summary may run to (Summarize): its own request, longer than a reply (sampling.max_new_tokens)
    summary_tokens: int = 768
    # sources under a reply: "related" shows only passages sharing a salient word with it (chat/sources.py);
    # "all" every top-attended passage
    sources: str = "related"
    # Reading a document into the cache stores its finished spans every this many tokens, so a stop, a
    # crash or a restart part way loses at most this much work (about 17 s of the default model's
    # prefill on 2 cores); a multiple of the engine's prefill chunk keeps the chunks where they were.
    checkpoint_tokens: int = 4096
    # disk the KV cache files may use (least recently used spans are evicted beyond it); a document
    # whose cache would not fit it is refused before it is read (`--disk-budget-gb`)
    disk_budget_bytes: int = StoreConfig.disk_budget_bytes
    host: str = "127.0.0.1"
    port: int = 7860

    def __post_init__(self):
        if self.summary_tokens < 1:
            raise ValueError(f"a summary needs at least 1 token (summary_tokens), got {self.summary_tokens}")
        if self.sources not in SOURCES:
            raise ValueError(f"sources must be one of {', '.join(SOURCES)}; got {self.sources!r}")
        if self.checkpoint_tokens < 1:
            raise ValueError(f"checkpoint_tokens must be at least 1, got {self.checkpoint_tokens}")
        if self.disk_budget_bytes <= 0:
            raise ValueError(f"the disk budget for the cache must be positive, got {self.disk_budget_bytes} bytes")

    @property
    def store(self) -> StoreConfig:
        return StoreConfig(root=self.home / "store", disk_budget_bytes=self.disk_budget_bytes)

    @property
    def scratch_dir(self) -> Path:
        """Short-lived files (uploads while read, exports for download): memory/scratch.py."""
        return self.home / "tmp"

    def with_(self, **changes) -> "AppConfig":
        return replace(self, **changes)
