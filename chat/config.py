"""The app's configuration: every part's config composed once at the entry point (app.py, bench).

Each part owns its own frozen dataclass (`spotlight.config` for the engine, sampling and
Spotlight; `memory.config` for the store); `AppConfig` only composes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from memory.config import StoreConfig
from spotlight.config import QUANTIZE, QUANTIZE_HELP, WEIGHTS, WEIGHTS_HELP, EngineConfig, SamplingConfig, SpotlightConfig, default_home

__all__ = ["QUANTIZE", "QUANTIZE_HELP", "WEIGHTS", "WEIGHTS_HELP", "AppConfig", "EngineConfig", "SamplingConfig", "SpotlightConfig", "StoreConfig"]


@dataclass(frozen=True)
class AppConfig:
    """Everything the app needs, composed once at the entry point."""

    home: Path = field(default_factory=default_home)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(repetition_penalty=1.1))
    spotlight: SpotlightConfig = field(default_factory=SpotlightConfig)
    system_prompt: str = "You are a helpful assistant. Answer from the document when one is given."
    host: str = "127.0.0.1"
    port: int = 7860

    @property
    def store(self) -> StoreConfig:
        return StoreConfig(root=self.home / "store")

    def with_(self, **changes) -> "AppConfig":
        return replace(self, **changes)
