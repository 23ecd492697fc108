"""chat/cachesync.py: the span layout read from one rendering, and what happens when the store
refuses a span (issue #18)."""
import torch

import memory
from chat.cachesync import SPAN_TOKENS, prefix_layout
from chat.config import AppConfig
from chat.render import DocumentSegment, Rendering, SegmentRange
from chat.service import ChatService
from spotlight.testing import tiny_engine
from spotlight.config import SamplingConfig


def rendering(prefix_len: int, ranges: list[tuple[int, int, str]]) -> Rendering:
    segments = tuple(SegmentRange(0, DocumentSegment(i, 0, 0, id=ident), start, end)
                     for i, (start, end, ident) in enumerate(ranges))
    return Rendering(tuple(range(prefix_len + 5)), tuple(range(prefix_len + 5)), prefix_len, (), segments, (0,))


def test_the_prefix_is_cut_where_each_document_segment_ends_but_the_last():
    layout = prefix_layout(rendering(100, [(20, 40, "s0"), (40, 70, "s1"), (72, 95, "s2")]))
    assert layout == [(0, 40, "s0"), (40, 70, "s1"), (70, 100, "s2")]


def test_a_prefix_without_segments_is_one_span_and_long_runs_are_cut_in_blocks():
    assert prefix_layout(rendering(30, [])) == [(0, 30, None)]
    n = 2 * SPAN_TOKENS + 10
    assert prefix_layout(rendering(n, [(5, n - 3, "only")])) == [
        (0, SPAN_TOKENS, "only"), (SPAN_TOKENS, 2 * SPAN_TOKENS, "only"), (2 * SPAN_TOKENS, n, "only")]


def test_a_span_the_store_refuses_is_a_notice_and_the_store_stays_consistent(tmp_path):
    """K/V in float64 (a precision span files cannot hold): the reply is kept, the turn says the
    cache could not be saved, and the store verifies clean."""
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=3), system_prompt="Be brief.")
    service = ChatService(config, _engine=tiny_engine(dtype=torch.float64))
    session = service.create()
    service.attach_text(session.id, "notes.txt", "The harvest was late that year. " * 20)
    final = list(service.send(session.id, "When was the harvest?"))[-1]
    assert final.finish is not None
    assert [n for n in final.notices if n.startswith("Could not save")] == [
        "Could not save part of this conversation's cache (k must be float32, float16 or bfloat16, got float64; "
        "cast it first). The conversation itself is saved; that part is recomputed when needed."]
    assert [m.role for m in service.history(session.id)] == (["user", "assistant"] if final.text else ["user"])
    service.close()
    report = memory.verify(config.store.root)
    assert (report["ok"], report["spans_checked"], report["orphan_files"], report["temp_files"]) == (True, 0, [], [])
