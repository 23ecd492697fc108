"""The store's configuration (the app composes it into `chat.config.AppConfig`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StoreConfig:
    """Persistent memory: where the index and tensor files live, and how much disk they may use."""

    root: Path
    disk_budget_bytes: int = 8 * 1024**3

    @property
    def db_path(self) -> Path:
        return self.root / "index.db"

    @property
    def spans_dir(self) -> Path:
        return self.root / "spans"
