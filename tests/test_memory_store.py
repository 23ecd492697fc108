"""The persistent store (memory/store.py, with memory/lru.py and memory/migrations.py)."""

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import sqlite_utils

from memory import (
    CacheSize,
    DocumentRecord,
    FingerprintMismatch,
    MalformedSpan,
    MessageNotFound,
    MessageRecord,
    PrefixNotFound,
    SchemaTooNew,
    SegmentRecord,
    SegmentSpec,
    SessionNotFound,
    SessionRecord,
    SpanCorrupt,
    SpanEvicted,
    SpanKey,
    SpanMissing,
    SpanSlotTaken,
    SpanTensors,
    SpanUnavailable,
    Store,
    StoreCorrupt,
    StoreError,
    StoreLocked,
    StoreWriteError,
    blobs,
    prefix_hash,
    verify,
)
from memory.lru import EvictionCandidate, PinTable, TouchBuffer, plan_eviction
from memory.store import KVSTORE
from memory.config import StoreConfig

REPO = Path(__file__).resolve().parents[1]
FP = dict(model_fp="smollm2-135m@abc", encoder_fp="enc@def")
KEY = SpanKey(FP["model_fp"], FP["encoder_fp"], "00112233aabbccdd")


@pytest.fixture
def clock():
    ticks = itertools.count(1000)
    return lambda: float(next(ticks))


@pytest.fixture
def config(tmp_path):
    return StoreConfig(root=tmp_path / "home")


@pytest.fixture
def store(config, clock):
    with Store(config, clock=clock) as store:
        yield store


def tensors(n_tokens: int, first_token: int = 0, seed: int = 0) -> SpanTensors:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, 1, n_tokens, 4)).astype(np.float32)  # [L, Hkv, T, D]
    codes = rng.integers(0, 2**64, size=(2, 1, 1, n_tokens), dtype=np.uint64)  # [L, Hkv, W, T]
    return SpanTensors(k=k, v=-k, token_ids=np.arange(first_token, first_token + n_tokens), key_codes=codes)


def conversation(store, title="Trip planning"):
    """u1 -> a1 -> u2 -> a2, all on one branch."""
    session = store.transcript.create_session(title, system_prompt="Be brief.")
    u1 = store.transcript.add_message(session.id, "user", "Where should I go in May?")
    a1 = store.transcript.add_message(session.id, "assistant", "Lisbon is lovely in May.")
    u2 = store.transcript.add_message(session.id, "user", "And for food?")
    a2 = store.transcript.add_message(session.id, "assistant", "Try pastel de nata.")
    return session, [u1, a1, u2, a2]


# ----------------------------------------------------------------------------- schema


def test_migrations_apply_in_order_and_are_recorded(store, config):
    conn = sqlite3.connect(config.db_path)
    assert conn.execute("SELECT migration_set, name FROM _sqlite_migrations ORDER BY id").fetchall() == [
        ("kvstore", "m001_core_tables"),
        ("kvstore", "m002_full_text_search"),
        ("kvstore", "m003_span_key_columns"),
        ("kvstore", "m004_attachment_names_and_settings"),
        ("kvstore", "m005_session_versions"),
    ]
    assert conn.execute("PRAGMA user_version").fetchone() == (5,)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_pending_migration_runs_on_open_and_indexes_old_rows(config, clock):
    config.root.mkdir()
    db = sqlite_utils.Database(config.db_path)
    KVSTORE.apply(db, stop_before="m002_full_text_search")
    db["sessions"].insert(
        {
            "id": "old",
            "title": "Quarterly budget",
            "created": 1.0,
            "updated": 1.0,
            "system_prompt": "",
            "settings": "{}",
            "active_leaf_id": None,
        }
    )
    db.close()
    with Store(config, clock=clock) as store:
        assert [session.id for session in store.transcript.search_sessions("budget")] == ["old"]
    conn = sqlite3.connect(config.db_path)
    assert conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id").fetchall() == [
        ("m001_core_tables",),
        ("m002_full_text_search",),
        ("m003_span_key_columns",),
        ("m004_attachment_names_and_settings",),
        ("m005_session_versions",),
    ]


def _snapshot(root: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != "store.lock"}


@pytest.mark.parametrize("future", ["migration", "user_version"])
def test_newer_schema_is_refused_and_left_untouched(config, clock, future):
    Store(config, clock=clock).close()
    conn = sqlite3.connect(config.db_path)
    if future == "migration":
        conn.execute(
            "INSERT INTO _sqlite_migrations (migration_set, name, applied_at) "
            "VALUES ('kvstore', 'm006_from_the_future', 'later')"
        )
    conn.execute("PRAGMA user_version = 6")
    conn.commit()
    conn.close()
    (config.spans_dir / ".leftover.safetensors.tmp").write_bytes(b"partial")
    before = _snapshot(config.root)
    with pytest.raises(SchemaTooNew, match="has schema version 6 .* knows only 5; upgrade Spotlight Chat"):
        Store(config, clock=clock)
    assert _snapshot(config.root) == before


def test_garbage_database_is_store_corrupt(config):
    config.root.mkdir()
    config.db_path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreCorrupt, match="not a readable Spotlight Chat index"):
        Store(config)


# ----------------------------------------------------------------------------- sessions


def test_session_crud(store):
    session = store.transcript.create_session("First", system_prompt="Be kind.", settings={"temperature": 0.2})
    assert session == SessionRecord(
        id=session.id,
        title="First",
        created=1000.0,
        updated=1000.0,
        system_prompt="Be kind.",
        settings={"temperature": 0.2},
        active_leaf_id=None,
    )
    second = store.transcript.create_session("Second")
    assert store.transcript.get_session(session.id) == session
    assert [s.title for s in store.transcript.list_sessions()] == ["Second", "First"]
    renamed = store.transcript.update_session(session.id, title="Renamed", settings={"temperature": 0.7})
    assert renamed == SessionRecord(
        id=session.id,
        title="Renamed",
        created=1000.0,
        updated=1002.0,
        system_prompt="Be kind.",
        settings={"temperature": 0.7},
        active_leaf_id=None,
    )
    assert [s.title for s in store.transcript.list_sessions(limit=1)] == ["Renamed"]
    assert [s.title for s in store.transcript.list_sessions(limit=5, offset=1)] == ["Second"]
    store.transcript.delete_session(second.id)
    assert store.transcript.list_sessions() == [renamed]


def test_session_version_moves_with_every_change_a_tab_shows(store):
    """Issue #19 item 7: a tab compares the version it showed with this one."""
    transcript = store.transcript
    session, other = transcript.create_session("Versions"), transcript.create_session("Other")
    seen = [transcript.session_version(session.id)]
    user = transcript.add_message(session.id, "user", "Hi")
    seen.append(transcript.session_version(session.id))
    reply = transcript.add_message(session.id, "assistant", "Hello")
    seen.append(transcript.session_version(session.id))
    transcript.add_sibling(reply.id, "Hello again")
    seen.append(transcript.session_version(session.id))
    transcript.switch_branch(reply.id)
    seen.append(transcript.session_version(session.id))
    transcript.set_message_metadata(user.id, {"undone": True})
    seen.append(transcript.session_version(session.id))
    transcript.update_session(session.id, title="Renamed")
    seen.append(transcript.session_version(session.id))
    transcript.add_document("notes.txt", "Some notes.", session_id=session.id)
    seen.append(transcript.session_version(session.id))
    transcript.copy_documents(session.id, other.id)
    assert seen == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (transcript.session_version(session.id), transcript.session_version(other.id)) == (7, 1)
    assert [d.name for d in transcript.session_documents(other.id)] == ["notes.txt"]
    assert transcript.active_path(other.id) == []
    transcript.delete_session(session.id)
    with pytest.raises(SessionNotFound):
        transcript.session_version(session.id)


def test_unknown_session_is_named_and_helpful(store):
    with pytest.raises(SessionNotFound, match="no session with id 'nope'.*store.transcript.list_sessions"):
        store.transcript.get_session("nope")
    with pytest.raises(SessionNotFound):
        store.transcript.add_message("nope", "user", "hi")
    with pytest.raises(SessionNotFound):
        store.transcript.delete_session("nope")


def test_search_sessions_over_titles_and_messages(store):
    trip, _ = conversation(store, "Trip planning")
    other = store.transcript.create_session("Tax return")
    store.transcript.add_message(other.id, "user", "Which receipts do I keep?")
    assert store.transcript.search_sessions("lisbon") == [store.transcript.get_session(trip.id)]
    assert [s.id for s in store.transcript.search_sessions("tax")] == [other.id]
    assert [s.id for s in store.transcript.search_sessions("recei")] == [other.id]  # word prefixes match
    assert [s.id for s in store.transcript.search_sessions("May trip")] == [trip.id]  # every word must match
    assert store.transcript.search_sessions('NOT "unbalanced (*') == []  # FTS syntax is inert
    assert store.transcript.search_sessions("   ") == []
    store.transcript.delete_session(trip.id)
    assert store.transcript.search_sessions("lisbon") == []


# ----------------------------------------------------------------------------- messages and branches


def test_messages_form_a_chain(store):
    session, (u1, a1, u2, a2) = conversation(store)
    assert u1 == MessageRecord(
        id=u1.id,
        session_id=session.id,
        parent_id=None,
        role="user",
        content="Where should I go in May?",
        created=1001.0,
        n_tokens=None,
        metadata={},
    )
    assert store.transcript.active_path(session.id) == [u1, a1, u2, a2]
    assert store.transcript.get_session(session.id).active_leaf_id == a2.id
    assert store.transcript.siblings(u1.id) == [u1]  # the only root


def test_edit_and_regenerate_create_siblings_and_keep_old_branches(store):
    session, (u1, a1, u2, a2) = conversation(store)
    regenerated = store.transcript.add_sibling(a2.id, "Try bacalhau.", n_tokens=4, metadata={"seed": 2})
    assert regenerated == MessageRecord(
        id=regenerated.id,
        session_id=session.id,
        parent_id=u2.id,
        role="assistant",
        content="Try bacalhau.",
        created=1005.0,
        n_tokens=4,
        metadata={"seed": 2},
    )
    assert store.transcript.active_path(session.id) == [u1, a1, u2, regenerated]
    edited = store.transcript.add_sibling(u2.id, "And for museums?")
    reply = store.transcript.add_message(session.id, "assistant", "The Gulbenkian.")
    assert store.transcript.active_path(session.id) == [u1, a1, edited, reply]
    assert store.transcript.siblings(u2.id) == [u2, edited]
    assert store.transcript.siblings(a2.id) == [a2, regenerated]
    assert store.transcript.path_to(a2.id) == [u1, a1, u2, a2]  # nothing was overwritten
    assert store.transcript.switch_branch(u2.id) == [u1, a1, u2, regenerated]  # newest leaf below u2
    assert store.transcript.get_session(session.id).active_leaf_id == regenerated.id
    assert store.transcript.switch_branch(a2.id) == [u1, a1, u2, a2]


def test_message_errors(store):
    session, (u1, *_) = conversation(store)
    other = store.transcript.create_session("Other")
    with pytest.raises(MessageNotFound, match="in session"):
        store.transcript.add_message(other.id, "user", "hi", parent_id=u1.id)
    with pytest.raises(ValueError, match="role must be one of"):
        store.transcript.add_message(session.id, "robot", "beep")
    with pytest.raises(MessageNotFound):
        store.transcript.add_sibling("missing", "x")
    root = store.transcript.add_message(session.id, "user", "New topic", parent_id=None)
    assert store.transcript.active_path(session.id) == [root]


def test_message_metadata_merges_and_content_stays(store):
    session, (u1, *_) = conversation(store)
    store.transcript.set_message_metadata(u1.id, {"liked": True})
    updated = store.transcript.set_message_metadata(u1.id, {"tokens_per_s": 12.5})
    assert (
        updated
        == store.transcript.get_message(u1.id)
        == MessageRecord(
            id=u1.id,
            session_id=session.id,
            parent_id=None,
            role="user",
            content=u1.content,
            created=u1.created,
            n_tokens=None,
            metadata={"liked": True, "tokens_per_s": 12.5},
        )
    )


# ----------------------------------------------------------------------------- documents


def test_documents_and_segments(store):
    session = store.transcript.create_session("Reading")
    text = "# Intro\nHello.\n# Body\nWorld."
    specs = [
        SegmentSpec(0, 15, page=1, heading="Intro", n_tokens=4),
        {"char_start": 15, "char_end": len(text), "page": 2, "heading": "Body"},
    ]
    document = store.transcript.add_document(
        "notes.md",
        text,
        segments=specs,
        pages=2,
        n_tokens=9,
        metadata={"reader": "md"},
        session_id=session.id,
    )
    assert document == DocumentRecord(
        id=document.id,
        name="notes.md",
        sha256=document.sha256,
        n_chars=len(text),
        pages=2,
        n_tokens=9,
        metadata={"reader": "md"},
        created=1001.0,
    )
    assert store.transcript.document_text(document.id) == text
    first, second = store.transcript.segments(document.id)
    assert [first, second] == [
        SegmentRecord(
            id=first.id,
            document_id=document.id,
            ordinal=0,
            char_start=0,
            char_end=15,
            page=1,
            heading="Intro",
            n_tokens=4,
        ),
        SegmentRecord(
            id=second.id,
            document_id=document.id,
            ordinal=1,
            char_start=15,
            char_end=len(text),
            page=2,
            heading="Body",
            n_tokens=None,
        ),
    ]
    other = store.transcript.create_session("Again")
    again = store.transcript.add_document("copy.md", text, session_id=other.id)  # same content: same document
    assert again == replace(document, name="copy.md")  # issue #19 item 10: the name is the attachment's
    assert store.transcript.session_documents(other.id) == [again]
    assert store.transcript.session_documents(session.id) == [document]
    with pytest.raises(ValueError, match="segments must be in order"):
        store.transcript.add_document("bad.txt", "abc", segments=[SegmentSpec(0, 5)])


def test_identical_text_keeps_each_attachments_name_in_listings_and_exports(store):
    """Issue #19 item 10: content is shared, names belong to each attachment (session x document)."""
    text = "Only the owner may open the vault."
    first, second = store.transcript.create_session("First"), store.transcript.create_session("Second")
    owner = store.transcript.add_document("owner_only.pdf", text, session_id=first.id)
    good = store.transcript.add_document("good.pdf", text, session_id=second.id)
    assert good.id == owner.id  # one stored copy of the text
    assert [d.name for d in store.transcript.session_documents(first.id)] == ["owner_only.pdf"]
    assert [d.name for d in store.transcript.session_documents(second.id)] == ["good.pdf"]
    assert [d["name"] for d in store.transcript.export_session(second.id)["documents"]] == ["good.pdf"]
    renamed = store.transcript.add_document("renamed.pdf", text, session_id=second.id)  # the same text again
    assert renamed == replace(good, name="renamed.pdf")
    assert [d.name for d in store.transcript.session_documents(second.id)] == ["renamed.pdf"]
    imported = store.transcript.import_session(store.transcript.export_session(first.id))
    assert [d.name for d in store.transcript.session_documents(imported)] == ["owner_only.pdf"]


def test_store_from_before_m004_names_each_attachment_as_its_document(config, clock):
    config.root.mkdir()
    db = sqlite_utils.Database(config.db_path)
    KVSTORE.apply(db, stop_before="m004_attachment_names_and_settings")
    db["sessions"].insert({"id": "s", "title": "Old", "created": 1.0, "updated": 1.0, "system_prompt": "",
                           "settings": "{}", "active_leaf_id": None})
    db["documents"].insert({"id": "d", "name": "old.txt", "sha256": "x", "text": "t", "n_chars": 1, "pages": None,
                            "n_tokens": None, "metadata": "{}", "created": 1.0})
    db["session_documents"].insert({"session_id": "s", "document_id": "d", "ordinal": 0, "added": 1.0})
    db.execute("PRAGMA user_version = 3")
    db.close()
    with Store(config, clock=clock) as store:
        assert [d.name for d in store.transcript.session_documents("s")] == ["old.txt"]
        assert store.settings.get() == {}


def test_settings_round_trip_through_a_reopened_store(config, clock):
    """Issue #19 item 9: saved settings survive closing and reopening the store."""
    with Store(config, clock=clock) as store:
        assert store.settings.get() == {}
        store.settings.put({"max_new_tokens": 700, "temperature": 0.3, "system_prompt": "Be kind."})
        store.settings.put({"temperature": 0.5, "spotlight_enabled": False})  # other keys are kept
    with Store(config, clock=clock) as store:
        assert store.settings.get() == {"max_new_tokens": 700, "temperature": 0.5, "system_prompt": "Be kind.",
                                        "spotlight_enabled": False}


# ----------------------------------------------------------------------------- spans


def test_message_span_round_trip_with_fingerprints(store):
    session, (u1, *_) = conversation(store)
    data = tensors(6, seed=3)
    record = store.spans.put_message_span(u1.id, 0, data, KEY, start_pos=0)
    assert (
        record.state,
        record.owner,
        record.session_id,
        record.message_id,
        record.key,
        record.dtype,
        record.n_tokens,
        record.start_pos,
    ) == ("ready", "message", session.id, u1.id, KEY, "float32", 6, 0)
    assert store.spans.get_span(record.id) == record
    span = store.spans.read_span(record.id, KEY)
    np.testing.assert_array_equal(span.k, data.k)
    np.testing.assert_array_equal(span.v, data.v)
    np.testing.assert_array_equal(span.key_codes, data.key_codes)
    assert (span.key, span.start_pos, span.token_ids.tolist()) == (KEY, 0, [0, 1, 2, 3, 4, 5])
    with pytest.raises(FingerprintMismatch, match="model fingerprint 'smollm2-135m@abc'.*'other'"):
        store.spans.read_span(record.id, replace(KEY, model_fp="other"))
    with pytest.raises(FingerprintMismatch, match="encoder fingerprint"):
        store.spans.read_span(record.id, replace(KEY, encoder_fp="untrained"))
    with pytest.raises(FingerprintMismatch, match="prefix digest '00112233aabbccdd'.*'ffffffffffffffff'"):
        store.spans.read_span(record.id, replace(KEY, prefix_digest="f" * 16))


def test_prefix_and_session_chain(store):
    session, (u1, a1, u2, a2) = conversation(store)
    ids = np.arange(10)
    key = prefix_hash(ids, **FP)
    first = store.spans.put_prefix_span(key, 0, tensors(4), KEY, start_pos=0, session_id=session.id)
    second = store.spans.put_prefix_span(key, 1, tensors(6, first_token=4), KEY, start_pos=4)
    prefix = store.spans.complete_prefix(key, 10)
    assert (prefix.hash, prefix.complete, prefix.n_tokens, prefix.spans) == (key, True, 10, [first, second])
    assert store.spans.find_prefix(key) == prefix
    assert store.spans.find_prefix(prefix_hash(ids[:5], **FP)) is None
    turn1 = store.spans.put_message_span(u1.id, 0, tensors(3), KEY, start_pos=10)
    turn2 = store.spans.put_message_span(a1.id, 0, tensors(2), KEY, start_pos=13)
    gap = store.spans.put_message_span(a2.id, 0, tensors(2), KEY, start_pos=99)  # not where a1 ended: cut
    other = SpanKey("other-model", "enc", "")
    store.spans.put_message_span(u1.id, 0, tensors(3), other, start_pos=10)
    assert store.spans.session_chain(session.id, KEY) == [first, second, turn1, turn2]
    assert gap.state == "ready"
    assert store.spans.session_chain(session.id, other) == []
    with pytest.raises(PrefixNotFound):
        store.spans.complete_prefix(prefix_hash([1], **FP), 1)


def test_span_key_is_checked():
    assert SpanKey("m", "", "") == SpanKey("m", "", "")
    with pytest.raises(ValueError, match="16 lowercase hex digits"):
        SpanKey("m", "", "not-a-digest")
    with pytest.raises(ValueError, match="must name the model"):
        SpanKey("", "enc", "")


def test_message_slot_is_per_key_and_a_taken_slot_is_named(store, config):
    """Issue #18: a taken slot raises SpanSlotTaken (not ValueError) and leaves the store as it was."""
    session, (u1, *_) = conversation(store)
    first = store.spans.put_message_span(u1.id, 0, tensors(3), KEY, start_pos=0)
    other_prefix = replace(KEY, prefix_digest="ffffffffffffffff")
    second = store.spans.put_message_span(u1.id, 0, tensors(3), other_prefix, start_pos=0)
    with pytest.raises(SpanSlotTaken, match=f"message {u1.id} already has span {first.id} at ordinal 0: "
                       "that span is already stored") as taken:
        store.spans.put_message_span(u1.id, 0, tensors(3, seed=1), KEY, start_pos=0)
    assert (taken.value.span_id, taken.value.ordinal, isinstance(taken.value, StoreError)) == (first.id, 0, True)
    ids = np.arange(3)
    prefix = prefix_hash(ids, **FP)
    held = store.spans.put_prefix_span(prefix, 0, tensors(3), KEY, start_pos=0)
    with pytest.raises(SpanSlotTaken, match=f"prefix {prefix} already has span {held.id}"):
        store.spans.put_prefix_span(prefix, 0, tensors(3), KEY, start_pos=0)
    assert store.spans.session_chain(session.id, KEY, prefix_hash=None) == [first]
    assert store.spans.session_chain(session.id, other_prefix) == [second]
    store.close()
    report = verify(config.root)
    assert (report["ok"], report["spans_ready"], report["files_present"], report["orphan_files"]) == (
        True, 3, 3, []
    )


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: replace(t, k=t.k.astype(np.float64), v=t.v.astype(np.float64)),  # dtype
        lambda t: replace(t, v=t.v[:, :, :2]),  # k and v disagree
        lambda t: replace(t, token_ids=t.token_ids[:2]),  # token count disagrees
    ],
    ids=["dtype", "k-v-shapes", "token-count"],
)
def test_malformed_span_is_named_and_stores_nothing(store, config, bad):
    """Issue #18: wrong shapes or dtypes raise MalformedSpan from put and refill, nothing is written."""
    session, (u1, a1, *_) = conversation(store)
    good = store.spans.put_message_span(u1.id, 0, tensors(4), KEY, start_pos=0)
    with pytest.raises(MalformedSpan):
        store.spans.put_message_span(a1.id, 0, bad(tensors(4)), KEY, start_pos=4)
    with pytest.raises(MalformedSpan):
        store.spans.refill_span(good.id, bad(tensors(4)), KEY)
    assert store.spans.get_span(good.id) == good
    assert store.spans.session_chain(session.id, KEY) == [good]
    store.close()
    report = verify(config.root)
    assert (report["ok"], report["spans_ready"], report["files_present"], report["temp_files"]) == (True, 1, 1, [])


def test_prefix_span_stores_its_document_segment(store):
    session = store.transcript.create_session()
    document = store.transcript.add_document(
        "a.txt", "one two", segments=[SegmentSpec(0, 3), SegmentSpec(3, 7)], session_id=session.id
    )
    segment = store.transcript.segments(document.id)[1]
    prefix = prefix_hash([1, 2], **FP)
    record = store.spans.put_prefix_span(prefix, 0, tensors(2), KEY, start_pos=0, segment_id=segment.id)
    assert (record.segment_id, store.spans.get_span(record.id)) == (segment.id, record)


def _old_span(db, spans_dir, span_id, owner, n_tokens, start_pos, encoder_fp, **columns):
    """A span file and row written as the code before m003 did (the prefix digest packed into encoder_fp)."""
    data = tensors(n_tokens, first_token=start_pos)
    prepared = blobs.prepare(data)
    meta = {"format": blobs.FORMAT, "model_fp": FP["model_fp"], "encoder_fp": encoder_fp,
            "dtype": "float32", "start_pos": str(start_pos), "n_tokens": str(n_tokens)}
    written = blobs.write_span_file(spans_dir, f"{span_id}.0{blobs.SUFFIX}", prepared, meta)
    row = {"id": span_id, "state": "ready", "file": written.name, "owner": owner, "prefix_hash": None,
           "message_id": None, "session_id": None, "ordinal": 0, "segment_id": None, "model_fp": FP["model_fp"],
           "encoder_fp": encoder_fp, "dtype": "float32", "n_tokens": n_tokens, "start_pos": start_pos,
           "tokens_sha256": blobs.tokens_sha256(data.token_ids), "bytes": written.bytes,
           "checksum": written.checksum, "created": 1.0, "last_used": 1.0}
    db["spans"].insert({**row, **columns})
    return data


def test_store_from_before_m003_finds_its_spans_by_the_new_key(config, clock):
    """Issue #18: an old store (migrations 1-2, packed encoder_fp) opens, and its spans are found by SpanKey."""
    digest = "0123456789abcdef"
    packed = f"enc@def+prefix:{digest}"
    config.spans_dir.mkdir(parents=True)
    db = sqlite_utils.Database(config.db_path)
    KVSTORE.apply(db, stop_before="m003_span_key_columns")
    db["sessions"].insert({"id": "s", "title": "Old", "created": 1.0, "updated": 1.0, "system_prompt": "",
                           "settings": "{}", "active_leaf_id": "u"})
    db["messages"].insert({"id": "u", "session_id": "s", "parent_id": None, "role": "user", "content": "hi",
                           "created": 1.0, "n_tokens": 2, "metadata": "{}"})
    old_hash = prefix_hash(np.arange(4), FP["model_fp"], packed)  # how chat hashed prefixes then
    db["prefixes"].insert({"hash": old_hash, "model_fp": FP["model_fp"], "encoder_fp": packed, "n_tokens": 4,
                           "complete": 1, "created": 1.0})
    db["session_prefixes"].insert({"session_id": "s", "prefix_hash": old_hash, "linked": 1.0})
    prefix_data = _old_span(db, config.spans_dir, "p0", "prefix", 4, 0, packed, prefix_hash=old_hash)
    _old_span(db, config.spans_dir, "m0", "message", 2, 4, packed, message_id="u", session_id="s")
    _old_span(db, config.spans_dir, "m1", "message", 2, 4, f"dense+prefix:{digest}", message_id="u",
              session_id="s")
    db.execute("PRAGMA user_version = 2")
    db.close()
    key, dense = SpanKey(FP["model_fp"], "enc@def", digest), SpanKey(FP["model_fp"], "", digest)
    with Store(config, clock=clock) as store:
        chain = store.spans.session_chain("s", key)
        assert [(span.id, span.key) for span in chain] == [("p0", key), ("m0", key)]
        assert store.spans.get_span("m1").key == dense
        assert store.spans.session_chain("s", dense) == []  # no dense prefix stored: nothing starts at 0
        assert store.spans.find_prefix(old_hash).key == key
        read = store.spans.read_span("p0", key)  # the file's header still holds the packed form
        assert (read.key, read.token_ids.tolist()) == (key, prefix_data.token_ids.tolist())
        with pytest.raises(SpanSlotTaken):
            store.spans.put_message_span("u", 0, tensors(2), key, start_pos=4)
    assert verify(config.root)["ok"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_span_files_raise_named_errors_and_refill_repairs(store, config, damage):
    session, (u1, *_) = conversation(store)
    record = store.spans.put_message_span(u1.id, 0, tensors(5), KEY, start_pos=0)
    path = config.spans_dir / record.file
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.unlink()
    expected = SpanMissing if damage == "delete" else SpanCorrupt
    with pytest.raises(expected):
        store.spans.read_span(record.id, KEY)
    store.close()
    assert not verify(config.root)["ok"]
    assert list(verify(config.root)["span_errors"]) == [record.id]
    with Store(config) as reopened:
        with pytest.raises(ValueError, match="other tokens"):
            reopened.spans.refill_span(record.id, tensors(5, first_token=1), KEY)
        with pytest.raises(FingerprintMismatch):
            reopened.spans.refill_span(record.id, tensors(5), replace(KEY, model_fp="other"))
        refilled = reopened.spans.refill_span(record.id, tensors(5), KEY)
        np.testing.assert_array_equal(reopened.spans.read_span(record.id, KEY).k, tensors(5).k)
        assert refilled.file != record.file
    assert verify(config.root)["ok"]


# ----------------------------------------------------------------------------- budget


def test_plan_eviction_is_lru_and_skips_kept():
    candidates = [
        EvictionCandidate("a", 10, 5.0),
        EvictionCandidate("b", 10, 1.0),
        EvictionCandidate("c", 10, 3.0),
        EvictionCandidate("d", 10, 3.0),
    ]
    assert plan_eviction(candidates, 40, 40) == []
    assert plan_eviction(candidates, 40, 25) == ["b", "c"]
    assert plan_eviction(candidates, 40, 25, keep={"b"}) == ["c", "d"]
    assert plan_eviction(candidates, 40, 0, keep={"a", "b", "c", "d"}) == []


def test_pin_table_and_touch_buffer():
    pins = PinTable()
    pins.pin(["a", "a", "b"])
    pins.unpin(["a"])
    assert pins.pinned() == frozenset({"a", "b"})
    pins.unpin(["a", "b"])
    assert pins.pinned() == frozenset()
    with pytest.raises(AssertionError, match="not pinned"):
        pins.unpin(["a"])
    touches = TouchBuffer()
    touches.touch(["a"], 5.0)
    touches.touch(["a", "b"], 3.0)
    assert touches.drain() == {"a": 5.0, "b": 3.0}
    assert touches.drain() == {}


def test_lru_eviction_keeps_budget_respects_pins_and_reports_evicted(config, clock):
    session_id, spans = None, []
    with Store(config, clock=clock) as store:
        session, messages = conversation(store)
        session_id = session.id
        for position, message in enumerate(messages[:3]):
            spans.append(store.spans.put_message_span(message.id, 0, tensors(8), KEY, start_pos=8 * position))
        size = spans[0].bytes
    # Reopen with room for two spans: the oldest goes on open.
    config = StoreConfig(root=config.root, disk_budget_bytes=2 * size + size // 2)
    with Store(config, clock=clock) as store:
        assert [s.state for s in store.spans.session_chain(session_id, KEY)] == ["evicted", "ready", "ready"]
        with pytest.raises(SpanEvicted, match="evicted to stay within the disk budget"):
            store.spans.read_span(spans[0].id, KEY)
        assert not (config.spans_dir / spans[0].file).exists()
        store.spans.read_span(spans[1].id, KEY)  # now spans[2] is the least recently used
        with store.spans.pin([spans[2].id]):
            fourth = store.spans.put_message_span(messages[3].id, 0, tensors(8), KEY, start_pos=24)
            assert [store.spans.get_span(s.id).state for s in spans[1:]] + [fourth.state] == [
                "evicted",
                "ready",
                "ready",
            ]
        assert store.disk_usage() == spans[2].bytes + fourth.bytes <= config.disk_budget_bytes
        assert store.spans.evict_to_budget(0) == [spans[2].id, fourth.id]
        assert store.disk_usage() == 0
        assert sorted(os.listdir(config.spans_dir)) == []
        with pytest.raises(SpanUnavailable):
            store.spans.read_span(fourth.id, KEY)
        refilled = store.spans.refill_span(spans[0].id, tensors(8), KEY)
        assert refilled.state == "ready" and store.disk_usage() == size


def test_session_cache_size_and_drop(store):
    session, (u1, a1, *_) = conversation(store)
    other = store.transcript.create_session("Other")
    shared_key, own_key = prefix_hash([1, 2], **FP), prefix_hash([3, 4], **FP)
    shared = store.spans.put_prefix_span(shared_key, 0, tensors(4), KEY, start_pos=0, session_id=session.id)
    store.spans.link_prefix(other.id, shared_key)
    own = store.spans.put_prefix_span(own_key, 0, tensors(4), KEY, start_pos=0, session_id=session.id)
    turn = store.spans.put_message_span(u1.id, 0, tensors(2), KEY, start_pos=4)
    assert store.spans.session_cache_size(session.id) == CacheSize(
        session_bytes=own.bytes + turn.bytes, shared_bytes=shared.bytes, ready_spans=3, evicted_spans=0
    )
    with store.spans.pin([turn.id]):
        assert store.spans.drop_session_cache(session.id) == [own.id]
    assert store.spans.drop_session_cache(session.id) == [turn.id]
    assert store.spans.session_cache_size(session.id) == CacheSize(
        session_bytes=0, shared_bytes=shared.bytes, ready_spans=1, evicted_spans=2
    )
    assert store.spans.get_span(shared.id).state == "ready"
    assert store.transcript.active_path(session.id)[0] == u1  # the transcript is untouched
    store.transcript.delete_session(session.id)
    assert store.disk_usage() == shared.bytes  # still used by the other session
    store.transcript.delete_session(other.id)
    assert store.disk_usage() == 0 and os.listdir(store.config.spans_dir) == []


# ----------------------------------------------------------------------------- crash safety


def test_unusable_data_directory_is_a_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(StoreWriteError, match="cannot create the data directory .*set SPOTLIGHT_HOME"):
        Store(StoreConfig(root=tmp_path / "a-file" / "home"))


def test_leftover_files_are_removed_on_open(config, clock):
    with Store(config, clock=clock) as store:
        session, (u1, *_) = conversation(store)
        live = store.spans.put_message_span(u1.id, 0, tensors(3), KEY, start_pos=0)
    (config.spans_dir / ".abc.safetensors.tmp").write_bytes(b"half a span")
    (config.spans_dir / "abc.1234.safetensors").write_bytes(b"a span whose row never committed")
    report = verify(config.root)
    assert (report["ok"], report["temp_files"], report["orphan_files"]) == (
        True,
        [".abc.safetensors.tmp"],
        ["abc.1234.safetensors"],
    )
    with Store(config, clock=clock) as store:
        assert store.recovered == {"temp_files": 1, "orphan_files": 1}
        assert os.listdir(config.spans_dir) == [live.file]
        assert store.spans.read_span(live.id, KEY).n_tokens == 3


def test_failed_span_file_write_commits_nothing(store, monkeypatch):
    session, (u1, *_) = conversation(store)

    def disk_full(file, buffer):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blobs, "_write_all", disk_full)
    with pytest.raises(StoreWriteError, match="No space left on device"):
        store.spans.put_message_span(u1.id, 0, tensors(4), KEY, start_pos=0)
    assert store.spans.session_chain(session.id, KEY) == []
    assert os.listdir(store.config.spans_dir) == []


def test_full_database_commits_nothing_half(store):
    session, (u1, a1, u2, a2) = conversation(store)
    store.connections._db.conn.execute("PRAGMA max_page_count = 1")  # every page-allocating write now fails: SQLITE_FULL
    with pytest.raises(StoreWriteError, match="database or disk is full.*Nothing was committed"):
        store.transcript.add_message(session.id, "user", "x" * 100_000)
    # A span row is small enough to fit a free slot: make its commit grow the file too.
    store.connections._db.conn.execute(
        "CREATE TEMP TRIGGER grow AFTER INSERT ON main.spans BEGIN "
        "UPDATE sessions SET system_prompt = printf('%.*c', 100000, 'x'); END"
    )
    with pytest.raises(StoreWriteError):
        store.spans.put_message_span(u1.id, 0, tensors(64), KEY, start_pos=0)
    assert store.transcript.active_path(session.id) == [u1, a1, u2, a2]
    assert store.transcript.get_session(session.id).active_leaf_id == a2.id
    assert os.listdir(store.config.spans_dir) == []  # the span file written before the commit was removed
    store.close()
    assert verify(store.config.root)["ok"]


_CRASH_CHILD = """
import sys, numpy as np
from pathlib import Path
from memory import Store, SpanKey, SpanTensors
from memory.config import StoreConfig
store = Store(StoreConfig(root=Path(sys.argv[1])))
session = store.transcript.create_session("crash")
print("ready", flush=True)
for i in range(100000):
    message = store.transcript.add_message(session.id, "user", f"message {i}")
    k = np.full((2, 2, 256, 64), i, np.float32)
    tensors = SpanTensors(k, k, np.arange(256))
    store.spans.put_message_span(message.id, 0, tensors, SpanKey("m", "e", ""), start_pos=0)
"""


def test_kill_9_during_writes_leaves_a_consistent_store(config):
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASH_CHILD, str(config.root)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    report = verify(config.root)
    assert (report["ok"], report["integrity_check"], report["span_errors"]) == (True, "ok", {})
    with Store(config) as store:
        (session,) = store.transcript.list_sessions()
        path = store.transcript.active_path(session.id)
        assert [m.content for m in path] == [f"message {i}" for i in range(len(path))]
        assert len(path) > 0
    assert verify(config.root)["temp_files"] == []


# ----------------------------------------------------------------------------- concurrency


def test_threads_read_consistent_snapshots_while_writes_commit(store):
    session = store.transcript.create_session("Busy")
    n_writes, errors, done = 60, [], threading.Event()

    def writer():
        try:
            for i in range(n_writes):
                message = store.transcript.add_message(session.id, "user", str(i))
                if i % 10 == 0:
                    store.spans.put_message_span(message.id, 0, tensors(4), KEY, start_pos=0)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            done.set()

    def reader():
        try:
            while not done.is_set():
                path = store.transcript.active_path(session.id)
                assert [m.content for m in path] == [str(i) for i in range(len(path))]
                assert all(
                    child.parent_id == parent.id for parent, child in zip(path, path[1:], strict=False)
                )
                for span in store.spans.session_chain(session.id, KEY):
                    store.spans.read_span(span.id, KEY)
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(store.transcript.active_path(session.id)) == n_writes
    assert len(store.connections._readers) >= 3  # one connection per reading thread


def test_reads_see_committed_state_and_are_not_blocked_by_an_open_write(store):
    session = store.transcript.create_session("Original")
    seen = []
    with store.connections.write() as db:  # a write transaction in progress on this thread
        db["sessions"].update(session.id, {"title": "Uncommitted"})
        reader = threading.Thread(target=lambda: seen.append(store.transcript.get_session(session.id).title))
        reader.start()
        reader.join(timeout=10)
    assert seen == ["Original"]
    assert store.transcript.get_session(session.id).title == "Uncommitted"


_SECOND_PROCESS = """
import sys
from pathlib import Path
from memory import Store, StoreLocked
from memory.config import StoreConfig
try:
    Store(StoreConfig(root=Path(sys.argv[1]))).close()
    print("opened")
except StoreLocked as error:
    print(error)
"""


def test_second_process_gets_store_locked(store, config):
    def run():
        return subprocess.run(
            [sys.executable, "-c", _SECOND_PROCESS, str(config.root)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    assert run() == (
        f"another Spotlight Chat process (pid {os.getpid()}) is using {config.root}; "
        "close it or set SPOTLIGHT_HOME to another directory"
    )
    with pytest.raises(StoreLocked):  # a second Store in the same process is refused too
        Store(config)
    store.close()
    assert run() == "opened"


# ----------------------------------------------------------------------------- export / import


def test_export_import_round_trip(store, tmp_path, clock):
    session, (u1, a1, u2, a2) = conversation(store)
    store.transcript.add_sibling(a1.id, "Porto, maybe.", metadata={"seed": 7})
    text = "Lisbon guide.\nEat well."
    store.transcript.add_document(
        "guide.txt",
        text,
        segments=[SegmentSpec(0, 13, page=1), SegmentSpec(14, len(text))],
        pages=1,
        session_id=session.id,
    )
    store.spans.put_message_span(u1.id, 0, tensors(3), KEY, start_pos=0)  # spans are not exported
    exported = store.transcript.export_session(session.id)
    assert json.loads(json.dumps(exported)) == exported  # plain JSON
    assert exported["session"] == {
        "title": "Trip planning",
        "created": 1000.0,
        "updated": 1005.0,
        "system_prompt": "Be brief.",
        "settings": {},
        "active_leaf": 4,
    }
    assert [(m["parent"], m["role"], m["content"]) for m in exported["messages"]] == [
        (None, "user", "Where should I go in May?"),
        (0, "assistant", "Lisbon is lovely in May."),
        (1, "user", "And for food?"),
        (2, "assistant", "Try pastel de nata."),
        (0, "assistant", "Porto, maybe."),
    ]
    copy = store.transcript.import_session(exported)
    assert copy != session.id
    assert store.transcript.export_session(copy) == exported
    assert store.spans.session_chain(copy, KEY) == []
    with Store(StoreConfig(root=tmp_path / "elsewhere"), clock=clock) as fresh:
        assert fresh.transcript.export_session(fresh.transcript.import_session(exported)) == exported
    with pytest.raises(ValueError, match="not a Spotlight Chat session export"):
        store.transcript.import_session({"format": "something else"})
    broken = json.loads(json.dumps(exported))
    broken["documents"][0]["text"] += "!"
    with pytest.raises(ValueError, match="does not match its sha256"):
        store.transcript.import_session(broken)
    assert len(store.transcript.list_sessions()) == 2  # the failed imports left nothing
