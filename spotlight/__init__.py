"""Spotlight: a compact Llama-family inference engine with hashed sparse decode attention.

The front door for code outside this package:

    from spotlight import Engine, Context, KVRows, Fingerprints, ReadMeter, AttentionTally, Step, Stats
    from spotlight import release_freed_memory  # the C heap's free pages back to the system
    from spotlight import installed_models, InstalledModel, packaged_model_names, DEFAULT_MODEL  # models
    from spotlight import EncoderTraining, TrainingProgress, trained_encoders, encoder_dirs

with configurations from `spotlight.config` and errors from `spotlight.errors`. Kept
import-light: these names (and torch, transformers) load on first use.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine", "Fingerprints": "engine",
    "Context": "generate", "Step": "generate", "Stats": "generate",
    "KVRows": "cache",
    "release_freed_memory": "heap",  # the C heap's free pages back to the system (standard library only)
    "ReadMeter": "observers", "AttentionTally": "observers", "StepObserver": "observers",
    "installed_models": "catalog", "InstalledModel": "catalog", "packaged_model_names": "catalog",
    "DEFAULT_MODEL": "catalog",
    # Spotlight encoders: where they are found, and training them in the background (Settings)
    "encoder_dirs": "engine", "trained_encoders": "engine",
    "EncoderTraining": "training", "TrainingProgress": "training",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'spotlight' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
