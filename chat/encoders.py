"""The Spotlight encoders of the model in use, and training them in the background (issue #22).

What Settings -> Encoders shows and does, through `ChatService.encoder_status`,
`train_encoders`, `cancel_encoder_training` and `with_trained_encoders`. The training itself
is `spotlight.EncoderTraining`, a child process under the data directory; this module only says
where the model stands:

    untrained --Train--> training --(done)--> ready --(with_trained_encoders)--> trained
                  ^          |Cancel, app stopped
                  +-Resume-- paused            (failed: Train again, resuming the saved state)

"ready": trained encoders for the model exist but the engine still decodes with the untrained
codes it loaded; the service reloads them (`with_trained_encoders`) and the next reply uses them.
Their key codes differ from the untrained ones, so conversations are restored from spans under
the new encoder fingerprint: the old ones are recomputed, with a notice (chat/cachesync.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spotlight import EncoderTraining, TrainingProgress, trained_encoders

from .config import AppConfig

__all__ = ["EncoderStatus", "cancel", "status", "train"]


@dataclass(frozen=True)
class EncoderStatus:
    """state: "unloaded" (no model yet), "off" (Spotlight off: no codes), "trained" (in use),
    "untrained", "training", "paused", "failed" (`progress.message` says why), "ready" (trained,
    used once the service reloads them). `checkpoint`: the trained file (trained, ready)."""

    state: str
    checkpoint: Path | None = None
    progress: TrainingProgress | None = None
    trained_here: bool = False  # the checkpoint was trained from Settings (its job finished)


def _job(config: AppConfig, bits: int) -> EncoderTraining:
    return EncoderTraining.of(config.engine.model_path, config.home, bits)


def status(engine, config: AppConfig) -> EncoderStatus:
    """Where the encoders of `engine` (None: not loaded) stand, and its training job's progress."""
    if engine is None:
        return EncoderStatus("unloaded")
    if engine.spotlight is None:
        return EncoderStatus("off")
    bits = engine.spotlight.bits
    progress = _job(config, bits).progress()
    found = trained_encoders(engine.fingerprint, bits, engine.encoder_dirs)
    here = progress.status == "done" and found == progress.checkpoint
    if engine.uses_trained_encoders:
        explicit = config.engine.encoder_path
        return EncoderStatus("trained", Path(explicit) if explicit else found, progress, here)
    if found is not None:
        return EncoderStatus("ready", found, progress, here)
    if progress.status in ("running", "paused", "failed"):
        return EncoderStatus("training" if progress.status == "running" else progress.status, None, progress)
    return EncoderStatus("untrained", None, progress)


def train(engine, config: AppConfig) -> EncoderStatus:
    """Start (or resume) training the encoders of `engine`'s model in the background."""
    if engine is not None and engine.spotlight is not None:
        EncoderTraining.start(config.engine.model_path, config.home, engine.spotlight.bits, config.training)
    return status(engine, config)


def cancel(engine, config: AppConfig) -> EncoderStatus:
    """Stop the running training; its state is saved, so Resume continues it."""
    if engine is not None and engine.spotlight is not None:
        _job(config, engine.spotlight.bits).cancel(config.training.cancel_seconds)
    return status(engine, config)
