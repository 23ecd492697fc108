"""memory/scratch.py: the short-lived files folder (issue #19 item 4: uploads and exports stay
readable by URL). Uploads go once read, exports at the next export, with their conversation, or
after EXPORT_LIFETIME_S; nothing outside the folder is ever deleted."""
import os
from pathlib import Path

import pytest

from memory.scratch import EXPORT_LIFETIME_S, Scratch


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_clear_empties_the_folder_and_creates_gradios(tmp_path):
    scratch = Scratch(tmp_path / "tmp")
    (tmp_path / "tmp" / "gradio" / "abc").mkdir(parents=True)
    (tmp_path / "tmp" / "gradio" / "abc" / "left-by-a-crash.pdf").write_bytes(b"%PDF")
    (tmp_path / "tmp" / "stray.txt").write_text("x")
    scratch.clear()
    assert files(scratch.root) == ["gradio"]


def test_discard_deletes_an_upload_and_its_folder_but_nothing_outside(tmp_path):
    scratch = Scratch(tmp_path / "tmp")
    scratch.clear()
    upload = scratch.gradio_dir / "f00d" / "notes.txt"
    upload.parent.mkdir()
    upload.write_text("notes")
    neighbour = scratch.gradio_dir / "beef" / "other.txt"
    neighbour.parent.mkdir()
    neighbour.write_text("other")
    outside = tmp_path / "mine.txt"
    outside.write_text("mine")
    link = scratch.gradio_dir / "link.txt"
    link.symlink_to(outside)
    assert (scratch.discard(upload), scratch.discard(outside), scratch.discard(link)) == (True, False, False)
    assert files(scratch.root) == ["gradio", "gradio/beef", "gradio/beef/other.txt", "gradio/link.txt"]
    assert outside.read_text() == "mine"
    assert scratch.take(neighbour) == b"other"
    assert files(scratch.root) == ["gradio", "gradio/link.txt"]


def test_an_export_replaces_the_last_one_and_goes_with_its_conversation(tmp_path):
    scratch = Scratch(tmp_path / "tmp")
    scratch.clear()
    first = scratch.write_export("s1", "Trip.md", "# Trip\n")
    assert (first.read_text(), first.parent.parent.parent) == ("# Trip\n", scratch.exports_dir)
    second = scratch.write_export("s1", "Trip.json", "{}")
    other = scratch.write_export("s2", "Other.md", "# Other\n")
    assert (first.exists(), second.exists(), other.exists()) == (False, True, True)
    scratch.drop_exports("s1")
    assert files(scratch.exports_dir) == ["s2", f"s2/{other.parent.name}", f"s2/{other.parent.name}/Other.md"]


def test_exports_older_than_their_lifetime_go_at_the_next_export(tmp_path):
    clock = Clock(1_000_000.0)
    scratch = Scratch(tmp_path / "tmp", clock=clock)
    scratch.clear()
    old = scratch.write_export("s1", "Old.md", "old")
    os.utime(old.parent, (clock.now, clock.now))
    clock.now += EXPORT_LIFETIME_S + 1
    new = scratch.write_export("s2", "New.md", "new")
    assert (old.exists(), new.exists()) == (False, True)
    assert [path.name for path in scratch.exports_dir.iterdir()] == ["s2"]


@pytest.mark.parametrize("session_id, name", [("../x", "a.md"), ("s1", "../../a.md"), ("s1", ""), ("..", "a.md")])
def test_names_that_are_not_plain_file_names_are_refused(tmp_path, session_id, name):
    scratch = Scratch(tmp_path / "tmp")
    with pytest.raises(ValueError, match="is not a plain file name"):
        scratch.write_export(session_id, name, "text")
