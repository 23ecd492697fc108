"""bench/longconv.py: the 60-turn script, its scoring, and one short run through the service."""
from bench.longconv import FACTS, answered, fact_rows, filler_questions, kept_share, run, script
from chat.config import AppConfig
from chat.service import ChatService
from spotlight.config import SamplingConfig
from spotlight.testing import tiny_engine

DOCUMENT = "The harvest festival gathers farmers together. Farmers celebrate harvest traditions together. " * 20


def test_the_full_script_tells_and_asks_ten_facts_then_asks_them_again_after_thirty_other_turns():
    turns = script(10, 30, DOCUMENT)
    assert len(turns) == 60
    assert [t.kind for t in turns[:4]] == ["tell", "ask early", "tell", "ask early"]
    assert turns[0].text == "Please remember this for later: my locker code is 4721."
    assert (turns[1].text, turns[1].fact) == ("What is my locker code?", 0)
    assert {t.kind for t in turns[20:50]} == {"filler"}
    assert sorted(t.fact for t in turns[50:]) == list(range(10)) and [t.kind for t in turns[50:]] == ["ask late"] * 10
    assert [t.fact for t in turns[50:]] != list(range(10))  # in another order


def test_filler_questions_name_the_documents_common_long_words():
    questions = filler_questions(DOCUMENT, 4)
    assert len(questions) == 4
    assert all(any(word in q for word in ("harvest", "farmers", "festival", "celebrate", "together", "traditions"))
               for q in questions)


def test_scoring():
    assert answered(FACTS[0], "Your locker code is 4721.") and not answered(FACTS[0], "It is 4712.")
    assert answered(FACTS[1], "ORLA") and not answered(FACTS[1], "Olga")
    rows = [{"turn": 2, "kind": "ask early", "question": FACTS[0].question, "right": True, "reply": "4721"},
            {"turn": 4, "kind": "ask early", "question": FACTS[1].question, "right": True, "reply": "Orla"},
            {"turn": 5, "kind": "ask late", "question": FACTS[1].question, "right": False, "reply": "Olga"},
            {"turn": 6, "kind": "ask late", "question": FACTS[0].question, "right": True, "reply": "4721"}]
    facts = fact_rows(rows, 2)
    assert [(f["fact"], f["early"], f["late"], f["turn told"], f["turn asked again"]) for f in facts] == [
        ("4721", True, True, 1, 6), ("Orla", True, False, 3, 5)]
    assert kept_share(facts) == 0.5
    assert kept_share([{"early": False, "late": True}]) is None


def test_a_short_script_runs_through_the_service(tmp_path):
    service = ChatService(AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=4)),
                          _engine=tiny_engine(seed=2))
    turns = script(2, 1, DOCUMENT)
    rows = run(service, turns, DOCUMENT, progress=lambda text: None)
    assert [(r["turn"], r["kind"]) for r in rows] == [(1, "tell"), (2, "ask early"), (3, "tell"), (4, "ask early"),
                                                      (5, "filler"), (6, "ask late"), (7, "ask late")]
    assert [r["right"] is None for r in rows] == [True, False, True, False, True, False, False]  # the asks are scored
    (session,) = service.list_sessions()
    history = service.history(session.id)
    assert [m.content for m in history if m.role == "user"] == [t.text for t in turns]
    assert rows[-1]["tokens"] > rows[0]["tokens"]
    service.close()
