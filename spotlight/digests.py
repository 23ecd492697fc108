"""Facts about large files computed once and remembered while the file is unchanged.

    stamps = FileStamps(home / "cache" / "file-stamps.json")
    digest = stamps.sha256(path)            # hashed once; later calls read the stamp
    facts = stamps.get(path, "gguf", read)  # any JSON value computed from the file

A stamp is keyed by the file's resolved path and holds its size and mtime_ns with what was
computed; a file whose size or mtime changed is read again. Hashing a 98 MB GGUF takes ~0.3 s
and parsing its metadata with gguf's reader ~5 s on 2 busy cores, so start and the model
listing pay them once per file. The stamps file is written through a temporary file and a
rename; where it cannot be written (a read-only data directory) nothing is remembered and
every call computes again. `read_json` / `write_json` are the same small-file pattern for the
other JSON files the engine keeps (the training job's record, train.py's progress file).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

_BLOCK = 1 << 22  # bytes read at a time while hashing


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: Path, default=None):
    """The JSON value in `path`; `default` when it is missing or unreadable (write_json's rename
    means a reader never sees a half-written file)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def write_json(path: Path, value) -> None:
    """Write `value` as JSON through a temporary file in the same folder and a rename, so the
    final name only ever holds a whole file. Raises OSError when the folder is not writable."""
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class FileStamps:
    """Remembered per-file values (see the module docstring); safe to share between threads."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def sha256(self, file: Path) -> str:
        return self.get(file, "sha256", sha256_file)

    def get(self, file: Path, key: str, compute: Callable[[Path], object]):
        """`compute(file)`, or the value remembered for this file's current size and mtime.
        Whatever `compute` raises is raised and nothing is remembered."""
        file = Path(file).resolve()
        stat = file.stat()
        where = [stat.st_size, stat.st_mtime_ns]
        with self._lock:
            record = self._read().get(str(file), {})
        if record.get("stat") == where and key in record:
            return record[key]
        value = compute(file)
        with self._lock:
            stamps = self._read()
            record = stamps.get(str(file), {})
            if record.get("stat") != where:
                record = {"stat": where}
            record[key] = value
            stamps[str(file)] = record
            self._write(stamps)
        return value

    def _read(self) -> dict:
        stamps = read_json(self.path, {})
        return stamps if isinstance(stamps, dict) else {}

    def _write(self, stamps: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json(self.path, stamps)
        except OSError:
            pass  # not writable: nothing is remembered
