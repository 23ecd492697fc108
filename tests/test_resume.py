"""Resuming conversations from persisted KV spans (chat/cachesync.py, chat/turns.py, bench/crash.py).

Issue: "Persistent cross-turn KV memory: conversations that resume instantly and never lose
data". A restart is simulated by a new `ChatService` (hence a new `Store`) on the same
data directory. Logit tolerances, stated once:
  - resumed vs the same conversation never interrupted: bit-identical (`torch.equal`);
    the K/V read from disk are the bytes that were computed;
  - resumed vs recomputing the whole conversation from scratch in one prefill: max abs
    difference <= 1e-4 on logits of magnitude ~35 (measured 2.2e-5 on SmolLM2), with the
    same argmax. The difference is float32 reassociation between the multi-turn history
    (prefill chunks + one-token decode steps) and a single prefill, not reuse error.
  - a span recomputed after damage or eviction: <= 1e-5 (tiny model).
"""
import os

import numpy as np
import pytest
import torch

from chat.cachesync import CacheKey, prefix_layout
from chat.render import Renderer
from chat.service import ChatService
from spotlight.testing import tiny_engine
from memory import verify
from chat.config import AppConfig
from memory.config import StoreConfig
from spotlight.config import SamplingConfig
from spotlight.generate import prefill

DOCUMENT = "The meeting is on Tuesday at 3 pm in room 12. Bring the budget report. " * 5


def make(home, engine, *, budget=None, max_new_tokens=8):
    config = AppConfig(home=home, sampling=SamplingConfig(max_new_tokens=max_new_tokens, repetition_penalty=1.1))
    store = StoreConfig(home / "store", budget) if budget else None
    return ChatService(config, _engine=engine, store_config=store)


def finish(turns):
    turn = None
    for turn in turns:
        pass
    assert turn is not None and turn.done
    return turn


def conversation(service, session_id, *extra):
    conv = service._conversation(session_id, service._visible(session_id))
    for role, content in extra:
        conv = conv.plus(role, content)
    return conv


def next_logits(engine, context, ids):
    """Logits (V,) after `ids`, continuing `context` (prefilled from its common prefix)."""
    context.truncate(min(context.common_prefix(ids), len(ids) - 1))
    return prefill(engine.model, context, ids[len(context.tokens):], engine.policy, chunk=engine.config.prefill_chunk)


def scratch_logits(engine, ids):
    return prefill(engine.model, engine.new_context(len(ids)), ids, engine.policy, chunk=engine.config.prefill_chunk)


def chat(service, *texts, document=DOCUMENT):
    session = service.create()
    if document:
        service.attach_text(session.id, "notes.txt", document)
    turns = [finish(service.send(session.id, text)) for text in texts]
    return session.id, turns


# ----------------------------------------------------------------------------- the real model


@pytest.mark.model
def test_resumed_logits_equal_the_warm_cache_and_a_full_recompute(engine, tmp_path):
    first = make(tmp_path, engine)
    session_id, _ = chat(first, "When is the meeting?", "Where?")
    held = list(Renderer(engine).full(conversation(first, session_id)).ids)
    ids = list(Renderer(engine).prompt(conversation(first, session_id, ("user", "What should I bring?"))).ids)
    warm = next_logits(engine, first._pool.get(session_id), ids)
    first.close()

    second = make(tmp_path, engine)
    report = second.resume(session_id)
    assert (report.from_memory, report.restored_tokens, report.computed_tokens) == (False, len(held), 0)
    assert (report.n_tokens, report.notices) == (len(held), [])
    resumed_context = second._pool.get(session_id)
    assert resumed_context.tokens == held
    resumed = next_logits(engine, resumed_context, ids)
    assert torch.equal(resumed, warm)
    scratch = scratch_logits(engine, ids)
    # the held tokens' K/V came from decode steps, whose int16 activations move logits by up to
    # ~2e-4 of their scale against a recompute by prefill (tests/test_quantized.py)
    assert (resumed - scratch).abs().max().item() <= 5e-4 * scratch.abs().max().item()
    assert resumed.argmax() == scratch.argmax()
    second.close()


@pytest.mark.model
def test_an_evicted_conversation_answers_the_same(engine, tmp_path):
    budget = 5 * 1024**2  # bytes: one of the two conversations (~3.7 MiB each, fp16 K/V)
    first = make(tmp_path, engine, budget=budget)
    a, (before,) = chat(first, "When is the meeting?")
    b, _ = chat(first, "Summarise.", document="Order 40 chairs and 6 tables for the spring fair in the hall. " * 5)
    assert first.store.disk_usage() <= budget
    assert first.cache_size(a).evicted_spans > 0
    first.close()

    second = make(tmp_path, engine, budget=budget)
    again = finish(second.regenerate(a, sampling=second.config.sampling))  # the same prompt as `before`, cold, greedy
    assert again.text == before.text
    assert any("evicted to stay within the disk budget" in notice for notice in again.notices)
    assert again.prefill_tokens > 1
    assert second.store.disk_usage() <= budget
    second.close()


# ----------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine(seed=3, prefill_chunk=32)


def test_stored_chain_is_exactly_the_rendered_conversation(tiny, tmp_path):
    service = make(tmp_path, tiny, max_new_tokens=12)
    session_id, turns = chat(service, "first", "second")
    assert any("\ufffd" in turn.text for turn in turns)  # re-tokenising the reply changed its ids
    full = list(Renderer(tiny).full(conversation(service, session_id)).ids)
    key = service._pool.get(session_id)
    assert key.tokens == full
    spans = service.store.spans.session_chain(session_id, _span_key(service, session_id))
    stored = [t for span in spans for t in service.store.spans.read_span(span.id, span.key).token_ids.tolist()]
    assert stored == full
    assert [span.owner for span in spans] == ["prefix"] + ["message"] * 4
    service.close()


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_a_damaged_span_file_is_detected_and_recomputed(tiny, tmp_path, damage):
    first = make(tmp_path, tiny)
    session_id, _ = chat(first, "first question", "second question")
    ids = list(Renderer(tiny).prompt(conversation(first, session_id, ("user", "third"))).ids)
    reference = next_logits(tiny, first._pool.get(session_id), ids)
    chain = first.store.spans.session_chain(session_id, _span_key(first, session_id))
    victim = chain[2]  # the first reply's span, in the middle of the chain
    path = first.store.config.spans_dir / victim.file
    first.close()
    if damage == "flip a byte":
        data = bytearray(path.read_bytes())
        data[-7] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        path.unlink()

    second = make(tmp_path, tiny)
    report = second.resume(session_id)
    reason = "missing" if damage == "delete" else "corrupt"
    assert report.notices == [
        f"Recomputed {victim.n_tokens} tokens of this conversation because their cache file was "
        + ("missing (deleted outside Spotlight Chat?)." if reason == "missing"
           else "corrupt (size, checksum or header did not match).")
    ]
    total = sum(span.n_tokens for span in chain)
    assert (report.restored_tokens, report.computed_tokens, report.n_tokens) == (
        total - victim.n_tokens, victim.n_tokens, total)
    resumed = next_logits(tiny, second._pool.get(session_id), ids)
    assert (resumed - reference).abs().max().item() <= 1e-5
    second.close()
    assert verify(tmp_path / "store")["ok"]  # repaired in place (refill_span)
    third = make(tmp_path, tiny)
    assert (third.resume(session_id).restored_tokens, third.resume(session_id).notices) == (total, [])
    third.close()


def test_a_model_fingerprint_change_recomputes_and_says_so(tiny, tmp_path):
    first = make(tmp_path, tiny)
    session_id, (turn,) = chat(first, "question")
    first.close()
    other = tiny_engine(seed=3, prefill_chunk=32, fingerprint="another-model-build")
    second = make(tmp_path, other)
    again = finish(second.regenerate(session_id, sampling=second.config.sampling))  # greedy, as `turn` was
    assert any("computed with another model" in notice and "another-model-build" in notice
               for notice in again.notices)
    assert (again.cached_tokens, again.restored_tokens) == (0, 0)  # nothing reused
    assert again.text == turn.text  # same weights here, so the same greedy reply
    second.close()


def test_key_codes_round_trip_and_an_encoder_change_recomputes(tmp_path):
    spotlight = tiny_engine(seed=5, spotlight=True)
    first = make(tmp_path, spotlight)
    session_id, _ = chat(first, "question")
    ids = list(Renderer(spotlight).prompt(conversation(first, session_id, ("user", "more"))).ids)
    warm_context = first._pool.get(session_id)
    codes = warm_context.cache.codes[..., : len(warm_context.tokens)].copy()  # (L, Hkv, W, N)
    warm = next_logits(spotlight, warm_context, ids)
    first.close()
    second = make(tmp_path, spotlight)
    assert second.resume(session_id).computed_tokens == 0
    resumed_context = second._pool.get(session_id)
    assert (resumed_context.cache.codes[..., : codes.shape[-1]] == codes).all()
    assert torch.equal(next_logits(spotlight, resumed_context, ids), warm)
    second.close()
    retrained = tiny_engine(seed=5, spotlight=True, encoder_seed=6)
    third = make(tmp_path, retrained)
    report = third.resume(session_id)
    assert report.restored_tokens == 0 and any("other Spotlight encoders" in n for n in report.notices)
    third.close()


def test_the_same_document_is_prefilled_once_across_conversations(tiny, tmp_path):
    service = make(tmp_path, tiny)
    a, (first,) = chat(service, "What day?")
    prefix_len = Renderer(tiny).full(conversation(service, a)).prefix_len
    assert first.cached_tokens == 0 and first.prefill_tokens > prefix_len
    b, (second,) = chat(service, "Which room?")
    assert (second.cached_tokens, second.restored_tokens) == (prefix_len, prefix_len)
    assert service.cache_size(b).shared_bytes > 0 and service.cache_size(b).session_bytes > 0
    service.close()
    restarted = make(tmp_path, tiny)
    c, (third,) = chat(restarted, "Bring what?")
    assert (third.cached_tokens, third.restored_tokens) == (prefix_len, prefix_len)
    restarted.close()


# ----------------------------------------------------------------------------- segments (issue #6, parts 3-4)


PARAGRAPHS = [" ".join(f"Paragraph {i} sentence {j} tells about topic {i * 7 + j}." for j in range(8))
              for i in range(10)]
LONG_DOCUMENT = "\n\n".join(PARAGRAPHS)  # ~4,500 bytes: a segment or two per paragraph (byte tokenizer)


def test_each_document_segment_is_a_span_and_a_restart_restores_them_all(tmp_path):
    engine = tiny_engine(seed=5, spotlight=True)
    first = make(tmp_path, engine)
    session_id, _ = chat(first, "Which topic?", document=LONG_DOCUMENT)
    rendering = Renderer(engine).full(conversation(first, session_id))
    full, prefix_len = list(rendering.ids), rendering.prefix_len
    ends = [r.end for r in rendering.segments]
    chain = [(span.start_pos, span.end_pos)
             for span in first.store.spans.session_chain(session_id, _span_key(first, session_id))]
    edges = [0, *ends[:-1], prefix_len]
    assert len(ends) > 5
    assert [(a, b) for a, b, _ in prefix_layout(rendering)] == list(zip(edges, edges[1:]))
    assert chain[: len(ends)] == list(zip(edges, edges[1:]))  # one prefix span per document segment
    assert chain[len(ends):] == [(prefix_len, chain[len(ends)][1]), (chain[len(ends)][1], len(full))]  # 2 turns
    fresh = first._pool.get(session_id)
    fresh_rows = fresh.rows(0, len(full))
    first.close()

    second = make(tmp_path, engine)
    assert second.resume(session_id).restored_tokens == len(full)
    restored = second._pool.get(session_id).rows(0, len(full))
    assert restored.token_ids == fresh_rows.token_ids == list(full)
    np.testing.assert_array_equal(restored.key_codes, fresh_rows.key_codes)
    torch.testing.assert_close(restored.k, fresh_rows.k, rtol=0, atol=0)
    second.close()


def test_spotlight_decode_over_a_document_answers_the_same_warm_or_restored(tmp_path):
    engine = tiny_engine(seed=5, spotlight=True)
    warm = make(tmp_path / "warm", engine, max_new_tokens=12)
    session_id, _ = chat(warm, document=LONG_DOCUMENT)
    warm.resume(session_id)  # ingest: the document is prefilled and stored
    warm_turn = finish(warm.send(session_id, "Which topic?"))
    assert warm_turn.decode_tokens > 1
    warm.close()

    cold = make(tmp_path / "cold", engine, max_new_tokens=12)
    other, _ = chat(cold, document=LONG_DOCUMENT)
    cold.resume(other)
    cold.close()
    restored = make(tmp_path / "cold", engine, max_new_tokens=12)
    assert finish(restored.send(other, "Which topic?")).text == warm_turn.text
    restored.close()


def test_kill_9_during_ingestion_and_generation_loses_nothing(tmp_path):
    from bench.crash import soak

    results = soak(tmp_path, trials=2, seed=7)  # + a final check resuming everything
    assert [(r.trial, r.problems) for r in results] == [(0, []), (1, []), (2, [])]
    assert results[-1].sessions >= 1 and results[-1].committed >= 0


def _span_key(service, session_id):
    """The span key the service uses for this conversation."""
    rendering = Renderer(service.engine).full(conversation(service, session_id))
    return CacheKey.for_engine(service.engine, rendering.prefix_ids).span_key


# ----------------------------------------------------------------------------- an ingest stopped part way (#21)

BOOK = " ".join(f"Chapter {i} says the lamp number {i * 7} hangs by the north door." for i in range(80))  # ~5K bytes
CHECKPOINT = 512  # tokens per stored stage in these tests (a multiple of the 256-token prefill chunk)
STAGE_END = 3 * CHECKPOINT  # where the runs below are stopped or killed: after the third stage


def checkpointed(home, engine):
    config = AppConfig(home=home, sampling=SamplingConfig(max_new_tokens=4), checkpoint_tokens=CHECKPOINT)
    return ChatService(config, _engine=engine)


def stored_ends(service, session_id) -> list[int]:
    return [span.end_pos for span in service.store.spans.session_chain(session_id, _span_key(service, session_id))]


def book_ingest(home, engine):
    """A conversation with BOOK attached, not read yet: (its id, its rendering, its prefix spans' ends)."""
    service = checkpointed(home, engine)
    session_id = service.create().id
    service.attach_text(session_id, "book.txt", BOOK)
    rendering = Renderer(engine).full(conversation(service, session_id))
    service.close()
    return session_id, rendering, [end for _, end, _ in prefix_layout(rendering)]


def test_a_stopped_ingest_keeps_its_finished_spans_and_a_restart_reads_on_from_there(tmp_path):
    engine = tiny_engine(seed=3, prefill_chunk=256)
    session_id, rendering, ends = book_ingest(tmp_path, engine)
    first = checkpointed(tmp_path, engine)
    stopped = first.resume(session_id, progress=lambda done, total: done >= STAGE_END - 200 and first.stop(session_id))
    kept = [end for end in ends if end <= STAGE_END]
    assert len(rendering) > 2 * STAGE_END and len(kept) >= 2
    assert (stopped.n_tokens, stored_ends(first, session_id)) == (STAGE_END, kept)
    assert stopped.notices == [f"Reading stopped at 1,536 of {len(rendering):,} tokens. What was read is kept (also "
                               "across a restart); the rest is read with your next question."]
    first.close()

    second = checkpointed(tmp_path, engine)
    seen = []
    resumed = second.resume(session_id, progress=lambda done, total: seen.append((done, total)))
    assert (resumed.restored_tokens, resumed.computed_tokens, resumed.n_tokens) == (
        kept[-1], len(rendering) - kept[-1], len(rendering))
    assert seen[0] == (kept[-1] + 256, len(rendering)) and seen[-1] == (len(rendering), len(rendering))
    assert stored_ends(second, session_id) == ends
    ids = list(rendering.ids) + [0]
    resumed_logits = next_logits(engine, second._pool.get(session_id), ids)
    torch.testing.assert_close(resumed_logits, scratch_logits(engine, ids), atol=1e-4, rtol=0)
    second.close()


_INGEST_CHILD = f"""
import sys, time
from pathlib import Path
from chat.config import AppConfig
from chat.service import ChatService
from spotlight.config import SamplingConfig
from spotlight.testing import tiny_engine

config = AppConfig(home=Path(sys.argv[1]), sampling=SamplingConfig(max_new_tokens=4), checkpoint_tokens={CHECKPOINT})
service = ChatService(config, _engine=tiny_engine(seed=3, prefill_chunk=256))

def progress(done, total):
    print(done, flush=True)
    if done > {STAGE_END}:
        time.sleep(120)  # the parent kills it here, in the fourth stage

service.resume(sys.argv[2], progress=progress)
"""


def test_an_ingest_killed_part_way_resumes_without_recomputing_its_stored_spans(tmp_path):
    import signal
    import subprocess
    import sys

    engine = tiny_engine(seed=3, prefill_chunk=256)
    session_id, rendering, ends = book_ingest(tmp_path, engine)
    child = subprocess.Popen([sys.executable, "-c", _INGEST_CHILD, str(tmp_path), session_id],
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             stdout=subprocess.PIPE, text=True)
    reported = []
    for line in child.stdout:
        reported.append(int(line))
        if reported[-1] > STAGE_END:
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert reported == list(range(256, STAGE_END + 257, 256))
    report = verify(tmp_path / "store")
    assert (report["ok"], report["span_errors"]) == (True, {})

    service = checkpointed(tmp_path, engine)
    kept = [end for end in ends if end <= STAGE_END]
    assert stored_ends(service, session_id) == kept
    question = "Which lamp hangs by the north door?"
    prompt = Renderer(engine).prompt(conversation(service, session_id, ("user", question)))
    readings, turn = [], None
    for turn in service.send(session_id, question):  # reads the rest of the document first, stage by stage
        readings.append(turn.reading)
    assert turn.done
    end = prompt.prefix_len
    stages = [*range(kept[-1] + CHECKPOINT, end, CHECKPOINT), end]
    assert readings[: len(stages) + 1] == [(kept[-1], end)] + [(stage, end) for stage in stages]
    assert set(readings[len(stages) + 1:]) == {None}  # then the reply streams
    assert (turn.restored_tokens, turn.cached_tokens, turn.prefill_tokens) == (
        kept[-1], kept[-1], len(prompt) - kept[-1])
    assert stored_ends(service, session_id)[: len(ends)] == ends
    service.close()
