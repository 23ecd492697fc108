"""Sources: the document passages an answer attended to most (chat/sources.py), with the
page of a PDF and the heading of a DOCX (issue #18)."""
import numpy as np
import pytest

from chat.config import AppConfig
from chat.documents import ingest, segment_document
from chat.render import AttachedDocument, Conversation, Renderer
from chat.service import ChatService
from chat.sources import SourceTracker, likely_right, related, salient_words
from spotlight.testing import tiny_engine
from files import make_docx, make_pdf
from spotlight.config import SamplingConfig
from segmenter import Document

FILLER = [
    "The river valley has many farms that grow wheat and barley in the summer months.",
    "Local markets open on weekends and sell bread, cheese and vegetables to visitors.",
    "The old bridge was rebuilt in stone after a flood damaged the wooden one.",
    "Children attend a small school near the church at the centre of the village.",
]
FACT = ("The secret password for the vault is PURPLE-ELEPHANT-42. "
        "Only the mayor knows the vault password, which is PURPLE-ELEPHANT-42.")


def planted_document() -> str:
    paragraphs = [" ".join(FILLER[(i + j) % 4] for j in range(8)) for i in range(10)]
    paragraphs[6] = FACT
    return "\n\n".join(f"Section {i + 1}\n\n{p}" for i, p in enumerate(paragraphs))


def planted_ranking():
    """(tracker, its ranked sources) for the planted document with attention mass put on the
    fact's tokens (the tiny engine's rendering; no decoding)."""
    engine = tiny_engine(seed=2)
    text = planted_document()
    document = AttachedDocument("d", "village.txt", text,
                                tuple(segment_document(Document("village.txt", "txt", text), engine.count_tokens)))
    conversation = Conversation("Be brief.", (document,), (("user", "Password?"),))
    rendering = Renderer(engine).prompt(conversation)
    tracker = SourceTracker.for_rendering(conversation, rendering)
    start = rendering.token_at(0, text.index("PURPLE-ELEPHANT-42"))
    mass = np.full(tracker.observer.mass.shape, 0.001)
    mass[start : start + 18] = 1.0
    return tracker, tracker.rank(mass)


def test_constructed_attention_picks_the_planted_sentence():
    """The mass put on the fact's tokens makes its segment the first source, quoting its sentence."""
    tracker, sources = planted_ranking()
    assert len(tracker.ranges) > 3
    assert [s.document for s in sources] == ["village.txt"] * 3
    assert sources[0].quote == "The secret password for the vault is PURPLE-ELEPHANT-42."
    assert sources[0].weight > 0.5 and sources[0].weight + sources[1].weight + sources[2].weight <= 1.0


def test_reply_over_a_document_carries_sources_and_keeps_them(tmp_path):
    """The whole path with the tiny engine: dense tally, sources on the turn and in the stats."""
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=4), system_prompt="Be brief.",
                       sources="all")  # the tiny model's bytes share no word with any passage
    engine = tiny_engine(seed=2)
    service = ChatService(config, _engine=engine)
    session = service.create()
    service.attach_text(session.id, "village.txt", planted_document())
    final = list(service.send(session.id, "What is the password?"))[-1]
    assert final.sources and all(s.document == "village.txt" for s in final.sources)
    assert abs(sum(s.weight for s in final.sources)) <= 1.0 + 1e-9
    stored = service.history(session.id)[-1].stats["sources"]
    assert [s["quote"] for s in stored] == [s.quote for s in final.sources]


def test_reply_without_documents_has_no_sources(tmp_path):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=3), system_prompt="Be brief.")
    service = ChatService(config, _engine=tiny_engine(seed=2))
    session = service.create()
    final = list(service.send(session.id, "Hi"))[-1]
    assert final.sources is None and "sources" not in service.history(session.id)[-1].stats


def test_spotlight_selections_are_tallied(tmp_path):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=4), system_prompt="Be brief.",
                       sources="all")
    engine = tiny_engine(seed=2, spotlight=True)
    service = ChatService(config, _engine=engine)
    session = service.create()
    service.attach_text(session.id, "village.txt", planted_document())
    final = list(service.send(session.id, "What is the password?"))[-1]
    assert final.sources and final.spotlight


@pytest.mark.model
def test_sources_point_at_the_planted_fact_with_the_real_model(engine, tmp_path):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=12))
    service = ChatService(config, _engine=engine)
    session = service.create()
    service.attach_text(session.id, "village.md", planted_document())
    final = list(service.send(session.id, "What is the secret password for the vault?"))[-1]
    assert final.sources, final.text
    assert "PURPLE-ELEPHANT-42" in final.sources[0].quote, (final.text, final.sources)
    assert final.sources[0].weight > 0.3


FILLER_LINES = [f"The harvest of year {1900 + i} was stored in the old barn by the river." for i in range(14)]
PAGE_FACT = "The vault code on this page is 7341, and only the mayor knows it."


@pytest.mark.model
def test_a_pdf_source_names_the_page_of_the_planted_fact(engine, tmp_path):
    path = tmp_path / "ledger.pdf"
    path.write_bytes(make_pdf([FILLER_LINES, FILLER_LINES[::-1], FILLER_LINES[:7] + [PAGE_FACT] + FILLER_LINES[7:]]))
    service = ChatService(AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=16)), _engine=engine)
    session = service.create()
    assert ingest(service, session.id, [str(path)], prefill=False).errors == []
    final = list(service.send(session.id, "What is the vault code that only the mayor knows?"))[-1]
    assert final.sources, final.text
    assert (final.sources[0].page, final.sources[0].quote) == (3, PAGE_FACT), (final.text, final.sources)


@pytest.mark.model
def test_a_docx_source_names_the_heading_of_the_planted_fact(engine, tmp_path):
    body = " ".join(FILLER_LINES)
    path = tmp_path / "manual.docx"
    path.write_bytes(make_docx([(0, "Farm manual"), (1, "Harvest"), (None, body), (1, "Storage"), (None, body),
                                (1, "Security"), (None, " ".join(FILLER_LINES[:5] + [PAGE_FACT] + FILLER_LINES[5:]))]))
    service = ChatService(AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=16)), _engine=engine)
    session = service.create()
    assert ingest(service, session.id, [str(path)], prefill=False).errors == []
    final = list(service.send(session.id, "What is the vault code that only the mayor knows?"))[-1]
    assert final.sources, final.text
    assert (final.sources[0].heading, final.sources[0].quote) == ("Farm manual › Security", PAGE_FACT), (
        final.text, final.sources)


def test_salient_words_are_names_numbers_and_long_uncommon_words():
    assert salient_words("In 1869 Tolstoy wrote about the war; the author's first novel, 2,500 pages.") == {
        "1869", "tolstoy", "author", "novel", "2,500", "pages"}


@pytest.mark.parametrize("quote, reply, expected", [
    ("The secret password for the vault is PURPLE-ELEPHANT-42.", "The password is PURPLE-ELEPHANT-42.", True),
    ("The old bridge was rebuilt in stone after a flood.", "The password is PURPLE-ELEPHANT-42.", False),
    ("Children attend a small school near the church.", "The vault opens at 42 minutes past.", False),
    ("It was built in 1901 by the river.", "It was built in 1901.", True),
    ("There were three of them, after all.", "There were three of them.", False),
])
def test_a_quote_is_related_to_a_reply_only_through_a_salient_word(quote, reply, expected):
    assert related(quote, reply) is expected


def test_only_sources_related_to_the_reply_are_shown():
    """Of the three top-attended segments, the one quoting the answer stays; the filler goes."""
    _, ranked = planted_ranking()
    assert ([s.quote for s in likely_right(ranked, "It is PURPLE-ELEPHANT-42.")], len(ranked),
            likely_right(ranked, "I do not know.")) == (
        ["The secret password for the vault is PURPLE-ELEPHANT-42."], 3, [])
