"""Sources: the document segments an answer attended to most (chat/sources.py)."""
import numpy as np
import pytest

from chat.service import ChatService
from chat.sources import AttentionTally, SourceTracker, tally_layers
from chat.testing import tiny_engine
from chat.config import AppConfig
from spotlight.config import SamplingConfig

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


def test_tally_layers_cover_the_second_half():
    assert tally_layers(30) == [15, 20, 24, 29]
    assert tally_layers(2) == [1]


def test_constructed_attention_picks_the_planted_segment(tmp_path):
    """Tiny engine, its decode policy replaced by one that puts the mass on the fact's bytes."""
    engine = tiny_engine(seed=2)
    text = planted_document()
    system = f'Be brief.\n\n<document name="village.txt">\n{text}\n</document>'
    prompt = engine.chat_ids([{"role": "system", "content": system}, {"role": "user", "content": "Password?"}])
    tracker = SourceTracker.for_prompt(engine, system, prompt)
    assert tracker is not None and len(tracker.spans) > 3
    fact_at = system.index("PURPLE-ELEPHANT-42")
    target = tracker.spans[0].start - system.index(text) + fact_at  # byte tokenizer: one token per byte
    tracker.tally = AttentionTally(engine.policy, [1], tracker.limit)
    tracker.tally.mass[:] = 0.001
    tracker.tally.mass[target : target + 18] = 1.0
    tracker.tally.steps = 1
    sources = tracker.sources()
    assert len(sources) == 3 and sources[0].document == "village.txt"
    assert "PURPLE-ELEPHANT-42" in sources[0].quote and sources[0].weight > 0.5
    assert sources[0].weight >= sources[1].weight >= sources[2].weight


def test_reply_over_a_document_carries_sources_and_keeps_them(tmp_path):
    """The whole path with the tiny engine: dense tally, sources on the turn and in the stats."""
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=4), system_prompt="Be brief.")
    engine = tiny_engine(seed=2)
    service = ChatService(config, _engine=engine)
    session = service.create()
    service.attach_text(session.id, "village.txt", planted_document())
    final = list(service.send(session.id, "What is the password?"))[-1]
    assert final.sources and all(s.document == "village.txt" for s in final.sources)
    assert abs(sum(s.weight for s in final.sources)) <= 1.0 + 1e-9
    stored = service.history(session.id)[-1].stats["sources"]
    assert [s["quote"] for s in stored] == [s.quote for s in final.sources]
    assert engine.policy.__class__.__name__ == "DenseDecode"  # the tally proxy is removed again


def test_reply_without_documents_has_no_sources(tmp_path):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=3), system_prompt="Be brief.")
    service = ChatService(config, _engine=tiny_engine(seed=2))
    session = service.create()
    final = list(service.send(session.id, "Hi"))[-1]
    assert final.sources is None and "sources" not in service.history(session.id)[-1].stats


def test_spotlight_selections_are_tallied(tmp_path):
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=4), system_prompt="Be brief.")
    engine = tiny_engine(seed=2, spotlight=True)
    service = ChatService(config, _engine=engine)
    session = service.create()
    service.attach_text(session.id, "village.txt", planted_document())
    final = list(service.send(session.id, "What is the password?"))[-1]
    assert final.sources
    assert engine.policy.record is None  # restored


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
