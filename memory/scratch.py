"""Short-lived files under the data directory: uploads while they are read, exports for one download.

Nothing here outlives its use: an upload's text is in the store once it has been read, and an
export is written for one download. The layout under `root` (`<home>/tmp`, chat.config):

    root/gradio/                                   Gradio's own folder (GRADIO_TEMP_DIR, set by app.py):
                                                   uploads arrive here, and Gradio serves files of it
    root/gradio/exports/<session id>/<token>/<name>   one export, served from there as it is (a
                                                   file already in Gradio's folder is not copied)

The app empties `root` at start (`clear`, once the store's directory lock is taken, so a second
instance on the same data directory never empties the first one's). An upload is deleted once it
has been read or refused (`discard`); a conversation's export is replaced by its next export,
deleted with the conversation (`drop_exports`), and any export older than EXPORT_LIFETIME_S is
deleted by the next export. A file outside `root` is never deleted (tests and the API read files
that belong to the caller).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from memory import blobs

EXPORT_LIFETIME_S = 600.0  # an export is a download link, not a copy to keep: 10 minutes
_TOKEN_BYTES = 8  # of each export's folder name: one folder per export request


class Scratch:
    """The short-lived files folder of one data directory (see the module docstring)."""

    def __init__(self, root: Path, *, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.clock = clock

    @property
    def gradio_dir(self) -> Path:
        """Gradio's temporary folder: where uploads arrive and what its file route serves."""
        return self.root / "gradio"

    @property
    def exports_dir(self) -> Path:
        return self.gradio_dir / "exports"

    def clear(self) -> None:
        """Delete everything under `root` (left by an earlier run) and create Gradio's folder."""
        shutil.rmtree(self.root, ignore_errors=True)
        self.gradio_dir.mkdir(parents=True, exist_ok=True)

    def holds(self, path: str | Path) -> bool:
        """Whether `path` lies under `root` (links resolved)."""
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(self.root))

    def discard(self, path: str | Path) -> bool:
        """Delete the file `path` if it lies under `root`, and the folders it leaves empty
        (Gradio puts each upload in a folder of its own); True if it was under `root`."""
        if not self.holds(path):
            return False
        path = Path(os.path.realpath(path))
        blobs.remove_quietly(path)
        stop = Path(os.path.realpath(self.gradio_dir))
        for folder in path.parents:
            if folder == stop or not folder.is_relative_to(stop):
                break
            try:
                folder.rmdir()
            except OSError:  # not empty (another upload), or gone already
                break
        return True

    def take(self, path: str | Path) -> bytes:
        """The file's bytes; the file is then discarded (if it lies under `root`)."""
        try:
            return Path(path).read_bytes()
        finally:
            self.discard(path)

    def write_export(self, session_id: str, name: str, text: str) -> Path:
        """Write one export of the conversation as `name` in a new folder, replacing the
        conversation's earlier export and deleting every export older than EXPORT_LIFETIME_S;
        returns its path."""
        _check_name(session_id, "conversation id")
        _check_name(name, "export file name")
        self.drop_exports(session_id)
        self._expire()
        folder = self.exports_dir / session_id / secrets.token_hex(_TOKEN_BYTES)
        folder.mkdir(parents=True)
        path = folder / name
        path.write_text(text, encoding="utf-8")
        return path

    def drop_exports(self, session_id: str) -> None:
        """Delete the conversation's exports."""
        _check_name(session_id, "conversation id")
        shutil.rmtree(self.exports_dir / session_id, ignore_errors=True)

    def _expire(self) -> None:
        if not self.exports_dir.is_dir():
            return
        deadline = self.clock() - EXPORT_LIFETIME_S
        for conversation in self.exports_dir.iterdir():
            for export in conversation.iterdir() if conversation.is_dir() else ():
                try:
                    if export.stat().st_mtime < deadline:
                        shutil.rmtree(export, ignore_errors=True)
                except OSError:  # removed meanwhile
                    continue
            try:
                conversation.rmdir()  # only once empty
            except OSError:
                pass


def _check_name(name: str, what: str) -> None:
    if not name or name in (".", "..") or Path(name).name != name:
        raise ValueError(f"the {what} {name!r} is not a plain file name")
