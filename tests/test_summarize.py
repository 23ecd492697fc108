"""ChatService.summarize: one pass when it fits, map-reduce over segment groups when not."""
import pytest

from chat.service import ChatService
from spotlight.testing import tiny_engine
from chat.config import AppConfig
from spotlight.config import SamplingConfig

PARAGRAPH = "The harbour town trades fish and salt. Its lighthouse was built in 1820. "


def _service(tmp_path, max_seq_len, max_new_tokens):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=max_new_tokens), system_prompt="Be brief.")
    return ChatService(config, _engine=tiny_engine(seed=3, max_seq_len=max_seq_len))


def test_short_document_is_summarised_in_one_pass(tmp_path):
    service = _service(tmp_path, 8192, 6)
    session = service.create()
    service.attach_text(session.id, "short.txt", PARAGRAPH * 3)
    turns = list(service.summarize(session.id))
    final = turns[-1]
    assert final.done and not final.text.startswith("Summary (map-reduce")
    history = service.history(session.id)
    assert [m.role for m in history] == ["user", "assistant"]
    assert history[0].content == "Summarize the document."


def test_long_document_is_summarised_by_map_reduce(tmp_path):
    service = _service(tmp_path, 700, 200)
    session = service.create()
    text = "\n\n".join(PARAGRAPH * 2 for _ in range(4))  # ~580 bytes: attachable, not summarisable in one pass
    service.attach_text(session.id, "long.txt", text)
    calls = []
    turns = list(service.summarize(session.id, progress=lambda done, total, what: calls.append((done, total))))
    final = turns[-1]
    assert final.text.startswith("Summary (map-reduce over ")
    parts = int(final.text.split("over ")[1].split(" parts")[0])
    assert parts >= 2
    assert [n for n in final.notices if n.startswith("Summarised part")] == [
        f"Summarised part {i} of {parts}" for i in range(1, parts + 1)]
    assert calls[-1] == (parts + 1, parts + 1)
    history = service.history(session.id)
    assert [m.role for m in history] == ["user", "assistant"]
    assert history[-1].content == final.text and history[-1].stats["summary"] == "map-reduce"


def test_summarize_without_a_document_is_refused(tmp_path):
    from chat.errors import InvalidAction

    service = _service(tmp_path, 8192, 6)
    session = service.create()
    with pytest.raises(InvalidAction):
        list(service.summarize(session.id))
