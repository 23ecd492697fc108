"""`python -m memory verify` (memory/__main__.py), run as a subprocess on temporary stores (issue #19)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from memory import SpanKey, SpanTensors, Store
from memory.config import StoreConfig

REPO = Path(__file__).resolve().parents[1]
KEY = SpanKey("model@1", "", "")


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memory", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def root(tmp_path) -> Path:
    """A store with one session, two messages, one document and two spans (one evicted)."""
    root = tmp_path / "home" / "store"
    with Store(StoreConfig(root)) as store:
        session = store.transcript.create_session("Checked")
        store.transcript.add_document("a.txt", "text", session_id=session.id)
        for position, role in enumerate(["user", "assistant"]):
            message = store.transcript.add_message(session.id, role, f"message {position}")
            k = np.zeros((1, 1, 2, 4), np.float32)  # [L, Hkv, T, D]
            span = store.spans.put_message_span(
                message.id, 0, SpanTensors(k, k, np.arange(2)), KEY, start_pos=2 * position
            )
        store.spans.drop_session_cache(session.id)
        store.spans.refill_span(span.id, SpanTensors(k, k, np.arange(2)), KEY)
    return root


def test_clean_store_exits_0_and_says_what_it_checked(root):
    result = run_cli("verify", str(root))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines() == [
        f"Spotlight Chat store at {root}",
        "  schema version   5 (this Spotlight Chat knows 5)",
        "  integrity check  ok",
        "  foreign keys     0 violations",
        "  sessions         1",
        "  messages         2",
        "  documents        1",
        "  spans            1 ready, 1 evicted",
        "  span files       1 present",
        "  checksums        1 checked",
        "  leftovers        0 temp files, 0 orphan files (allowed: the next open removes them)",
        "OK: no problems found.",
    ]


def test_deleted_span_file_exits_1_and_names_the_span(root):
    (victim,) = (root / "spans").iterdir()
    victim.unlink()
    result = run_cli("verify", str(root))
    lines = result.stdout.splitlines()
    assert (result.returncode, lines[8:10], lines[-3:-1], lines[-1]) == (
        1,
        ["  span files       0 present", "  checksums        1 checked"],
        ["Problems:", lines[-2]],
        "1 problem(s) found.",
    )
    assert f"file {victim} is missing" in lines[-2]


def test_default_path_is_spotlight_home_store(root):
    result = run_cli("verify", env={"SPOTLIGHT_HOME": str(root.parent)})
    assert (result.returncode, result.stdout.splitlines()[0]) == (0, f"Spotlight Chat store at {root}")


def test_store_in_use_or_absent_exits_2(root, tmp_path):
    with Store(StoreConfig(root)):
        result = run_cli("verify", str(root))
    assert (result.returncode, result.stdout) == (2, "")
    assert f"another Spotlight Chat process (pid {os.getpid()}) is using {root}" in result.stderr
    result = run_cli("verify", str(tmp_path / "nothing"))
    assert (result.returncode, result.stdout) == (2, "")
    assert "no Spotlight Chat store at" in result.stderr


def test_help():
    result = run_cli("verify", "--help")
    assert result.returncode == 0
    assert "Exit status: 0 clean, 1 problems found, 2 not checked" in " ".join(result.stdout.split())
