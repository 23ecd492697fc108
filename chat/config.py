"""The app's configuration: every part's config composed once at the entry point (app.py, bench).

Each part owns its own frozen dataclass (`spotlight.config` for the engine, sampling and
Spotlight; `memory.config` for the store); `AppConfig` only composes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from memory.config import StoreConfig
from spotlight.config import QUANTIZE, QUANTIZE_HELP, WEIGHTS, WEIGHTS_HELP, EngineConfig, SamplingConfig, SpotlightConfig, default_home

# Regenerate samples (a greedy rerun would repeat the reply word for word): at this temperature and
# top-p when the configured sampling is greedy, else at the configured ones; a fresh seed each time.
REGENERATE_TEMPERATURE = 0.7
REGENERATE_TOP_P = 0.9

__all__ = ["QUANTIZE", "QUANTIZE_HELP", "REGENERATE_TEMPERATURE", "REGENERATE_TOP_P", "WEIGHTS", "WEIGHTS_HELP",
           "AppConfig", "EngineConfig", "SamplingConfig", "SpotlightConfig", "StoreConfig"]


@dataclass(frozen=True)
class AppConfig:
    """Everything the app needs, composed once at the entry point."""

    home: Path = field(default_factory=default_home)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(repetition_penalty=1.1))
    spotlight: SpotlightConfig = field(default_factory=SpotlightConfig)
    system_prompt: str = "You are a helpful assistant. Answer from the document when one is given."
    # tokens a summary may run to (Summarize): its own request, longer than a reply (sampling.max_new_tokens)
    summary_tokens: int = 768
    host: str = "127.0.0.1"
    port: int = 7860

    def __post_init__(self):
        if self.summary_tokens < 1:
            raise ValueError(f"a summary needs at least 1 token (summary_tokens), got {self.summary_tokens}")

    @property
    def store(self) -> StoreConfig:
        return StoreConfig(root=self.home / "store")

    @property
    def scratch_dir(self) -> Path:
        """Short-lived files (uploads while read, exports for download): memory/scratch.py."""
        return self.home / "tmp"

    def with_(self, **changes) -> "AppConfig":
        return replace(self, **changes)
