"""ChatService.summarize: one pass when it fits, map-reduce over segment groups when not.

Issue #19 item 11: a summary is its own request over the documents (no earlier turn rendered),
with its own token budget (AppConfig.summary_tokens), shown as the summary of which documents.
"""
import pytest

from chat.render import AttachedDocument, Conversation, Renderer
from chat.service import ChatService
from fakes import echo_engine
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
    assert history[0].content == 'Summarize the document "short.txt".'
    assert history[1].stats["summary"] == "one pass"


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


def _echo_service(tmp_path, engine, summary_tokens=300):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=6), system_prompt="Be brief.",
                       summary_tokens=summary_tokens)
    return ChatService(config, _engine=engine)


def _summary_prompt(engine, documents):
    request = 'Summarize the document "short.txt".'
    return list(Renderer(engine).prompt(Conversation("Be brief.", documents, (("user", request),))).ids)


def _one_exchange_over_a_document(tmp_path):
    """(echo engine, service, conversation) with short.txt attached and one question answered."""
    engine = echo_engine()
    service = _echo_service(tmp_path, engine)
    session = service.create()
    service.attach_text(session.id, "short.txt", PARAGRAPH * 3)
    list(service.send(session.id, "Who owns the harbour cat?"))
    return engine, service, session


def test_a_summary_inside_a_conversation_renders_the_documents_and_the_request_only(tmp_path):
    engine, service, session = _one_exchange_over_a_document(tmp_path)
    final = list(service.summarize(session.id))[-1]
    prompt, sampling = engine.requests[-1]
    assert prompt == _summary_prompt(engine, (AttachedDocument("", "short.txt", PARAGRAPH * 3),))
    assert sampling.max_new_tokens == 300  # the summary's budget, not the reply's 6
    assert final.text == 'Echo: Summarize the document "short.txt".'
    history = service.history(session.id)
    assert [(m.role, m.content) for m in history] == [
        ("user", "Who owns the harbour cat?"), ("assistant", "Echo: Who owns the harbour cat?"),
        ("user", 'Summarize the document "short.txt".'), ("assistant", final.text)]
    # the conversation goes on after it, and its whole cache is stored where each message stands
    list(service.send(session.id, "Thanks"))
    service.close()
    again = _echo_service(tmp_path, engine)
    report = again.resume(session.id)
    assert (report.computed_tokens, report.restored_tokens) == (0, report.n_tokens)
    again.close()


def test_the_summary_budget_is_cut_to_what_the_window_leaves(tmp_path):
    engine = echo_engine(max_seq_len=600)
    service = _echo_service(tmp_path, engine, summary_tokens=768)
    session = service.create()
    service.attach_text(session.id, "short.txt", PARAGRAPH * 3)
    list(service.summarize(session.id))
    prompt, sampling = engine.requests[-1]
    assert sampling.max_new_tokens == 600 - len(prompt)
    service.close()


def test_regenerating_a_summary_summarises_again(tmp_path):
    engine, service, session = _one_exchange_over_a_document(tmp_path)
    list(service.summarize(session.id))
    list(service.regenerate(session.id))
    prompt, sampling = engine.requests[-1]
    assert (prompt, sampling.max_new_tokens) == (
        _summary_prompt(engine, (AttachedDocument("", "short.txt", PARAGRAPH * 3),)), 300)
    assert service.history(session.id)[-1].branches == 2
    service.close()
