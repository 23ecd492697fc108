"""bench/longctx.py's needle planting and scoring, on strings (no model), and its ingest on a tiny random engine."""
from bench.longctx import NEEDLES, found, needle_rows, needle_targets, plant


def sentence_start(text, at):
    """The first position at or before `at` that follows a '.'."""
    while at > 0 and text[at - 1] != ".":
        at -= 1
    return at


def test_needles_are_planted_at_sentence_starts_in_depth_order():
    body = "Aaaa.Bbbb.Cccc.Dddd."  # 20 characters, sentences start at 0, 5, 10, 15
    planted = plant(body, [(0.6, "[y]"), (0.3, "[x]"), (0.0, "[w]")], sentence_start)
    assert "".join(planted) == "[w]Aaaa.[x]Bbbb.[y]Cccc.Dddd."


def test_two_needles_in_one_sentence_keep_their_order():
    planted = plant("Aaaa.Bbbbbbbbb.", [(0.5, "[1]"), (0.9, "[2]")], sentence_start)
    assert "".join(planted) == "Aaaa.[1][2]Bbbbbbbbb."


def test_found_ignores_case_and_quotes_and_needs_the_whole_answer():
    assert [found("The secret word is 'Blue Lantern'.", "blue lantern"), found("It is 748.", "7481"),
            found("the number is 7481.", "7481"), found("blue", "blue lantern")] == [True, False, True, False]


def test_the_needles_cover_two_formats_at_ten_depths_each_with_distinct_answers():
    kinds = {kind: sorted(n.depth for n in NEEDLES if n.kind == kind) for kind in ("number", "phrase")}
    assert kinds == {"number": [0.05, 0.2, 0.25, 0.4, 0.45, 0.6, 0.65, 0.8, 0.85, 0.98],
                     "phrase": [0.1, 0.15, 0.3, 0.35, 0.5, 0.55, 0.7, 0.75, 0.9, 0.95]}
    assert len({n.answer for n in NEEDLES}) == len({n.question for n in NEEDLES}) == len(NEEDLES)
    assert len({n.frame for n in NEEDLES}) == len(NEEDLES)  # each its own frame
    assert all(n.answer in n.sentence and n.answer not in n.question for n in NEEDLES)
    # no answer holds another (found() matches substrings)
    assert [(a.answer, b.answer) for a in NEEDLES for b in NEEDLES if a is not b and a.answer in b.answer] == []


def test_the_forced_reply_is_the_needle_sentence_up_to_its_answer():
    number, phrase = NEEDLES[0], NEEDLES[1]
    assert [(number.frame, number.forced_answer), (phrase.frame, phrase.forced_answer)] == [
        ("The special magic number for the city of Lisbon is", " 7481"),
        ("The secret word for the old harbor is", " 'blue lantern")]


def test_a_run_of_fewer_methods_tabulates_only_those_beside_the_reference():
    hit, miss = {"found": True, "logprob": -0.5, "reply": "yes"}, {"found": False, "logprob": -9.0, "reply": "no"}
    n = len(NEEDLES)
    cells = {(100, "spotlight"): [hit] * 4 + [miss] * (n - 4), (100, "dense in window"): [hit] * 8 + [miss] * (n - 8)}
    rows = needle_rows([100], {100: 98}, cells, ("spotlight", "dense in window"))
    summary = [(r["method"], r["found"], r["of dense in window's"]) for r in rows if "method" in r]
    assert summary == [("spotlight", 4, 4), ("dense in window", 8, 8)]
    detail = [r for r in rows if "depth" in r]
    assert len(detail) == len(NEEDLES) and set(detail[0]) == {
        "part", "length", "depth", "answer", "spotlight", "dense in window", "spotlight's reply"}


def test_an_unknown_method_is_refused_before_any_model_loads(capsys):
    import pytest

    from bench.longctx import main

    with pytest.raises(SystemExit) as stopped:
        main(["--methods", "spotlight,oracle"])
    assert stopped.value.code == 2
    assert ("--methods takes spotlight (always) and any of sinks+window, truncated; got 'spotlight,oracle'"
            in capsys.readouterr().err)


def test_ingest_beside_llama_cpp_is_tabulated_with_its_target_only_when_measured():
    from bench.longctx import LLAMA_PART, llama_rows, llama_targets

    speed = {"prefill_short": 90.0, "prefill_long": 45.0}
    llama = {"tokens": 32_768, "tps": 60.0}
    rows = llama_rows(131_034, speed, llama)
    assert rows == [
        {"part": LLAMA_PART, "engine": "ours: Spotlight past the window", "prompt tokens": 131_034,
         "prefill tokens/s": 45.0},
        {"part": LLAMA_PART, "engine": "llama.cpp (llama-bench pp): its window, dense", "prompt tokens": 32_768,
         "prefill tokens/s": 60.0}]
    (target,) = llama_targets(131_072, speed, llama)
    assert (target.name, target.value, target.target, target.met) == (
        "prefill tokens/s at 131,072 / llama.cpp's at its window (32,768)", 0.75, 1.5, False)
    assert llama_rows(131_072, speed, None) == [] and llama_targets(131_072, speed, None) == []


def test_the_prefill_is_metered_per_slice_from_its_offset_and_at_its_end():
    from bench.longctx import SLICE, slice_meter

    ticks = iter(range(100))  # one second per reading of the clock
    slices = []
    progress = slice_meter(1000, slices, clock=lambda: float(next(ticks)))
    total = 2 * SLICE + 500
    for done in range(1024, total, 1024):
        progress(done, total)
    progress(total, total)
    assert [(a, b) for a, b, _ in slices] == [(1000, 1000 + 8 * 1024), (1000 + 8 * 1024, 1000 + 16 * 1024),
                                              (1000 + 16 * 1024, 1000 + total)]
    assert [tps for _, _, tps in slices] == [8 * 1024, 8 * 1024, total - 16 * 1024]


def test_a_failing_llama_bench_leaves_the_run_its_rows(tmp_path):
    """A llama-bench that fails (or runs past its time) is logged and not measured: the run goes on."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, TEST_HOME

    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho 'no such model' >&2\nexit 3\n")
    fake.chmod(0o755)
    env = dict(os.environ, LLAMA_BENCH=str(fake), SPOTLIGHT_HOME=str(TEST_HOME))
    code = ("from bench.longctx import llama_prompt_speed; "
            "print('measured:', llama_prompt_speed('smollm2-135m-instruct', 64))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip().splitlines()[-1]) == (0, "measured: None")
    assert "llama.cpp's prompt processing was not measured" in done.stdout + done.stderr


def test_llama_cpp_refuses_a_model_without_a_gguf_by_name(tmp_path):
    import pytest

    from bench.decode import LlamaCppRunner
    from tiny_models import write_tiny_hf_dir

    model = write_tiny_hf_dir(tmp_path / "tiny-hf")
    with pytest.raises(ValueError, match="has no GGUF file: llama.cpp reads GGUF only"):
        LlamaCppRunner(64, str(model))


def test_needle_target_counts_only_the_needles_dense_finds():
    """Spotlight finding a needle dense misses does not make up for one dense finds and it misses."""
    def cell(hits):
        return [{"found": hit, "logprob": -1.0} for hit in hits]

    cells = {(65536, "dense in window"): cell([True, True, False, True] + [False] * 6),
             (65536, "spotlight"): cell([True, False, True, True] + [False] * 6)}
    (target,) = needle_targets([65536], cells)
    assert (target.name, target.value, target.target) == (
        "needles dense finds within the window, found at 65,536 (2 of 3)", 2 / 3, 0.95)


def test_runs_past_128k_other_models_and_fewer_methods_write_sections_of_their_own():
    from bench.longctx import DEFAULT, FULL, QUICK, section
    assert (QUICK["lengths"], DEFAULT["lengths"], FULL["lengths"]) == (
        [16_384, 32_768], [16_384, 32_768, 65_536, 131_072], [16_384, 32_768, 65_536, 131_072, 262_144, 524_288])
    assert [section(None, [16_384, 131_072]), section(None, FULL["lengths"]),
            section("/models/qwen2.5-coder-0.5b-instruct", [131_072]),
            section("qwen2.5-coder-0.5b-instruct", [262_144])] == [
        ("longctx", "Long context: needles and speed past the window (issue #21)"),
        ("longctx-512k", "Long context: needles and speed past the window (issue #21), up to 524,288 tokens"),
        ("longctx-qwen2.5-coder-0.5b-instruct",
         "Long context: needles and speed past the window (issue #21): qwen2.5-coder-0.5b-instruct"),
        ("longctx-qwen2.5-coder-0.5b-instruct-256k",
         "Long context: needles and speed past the window (issue #21): qwen2.5-coder-0.5b-instruct, "
         "up to 262,144 tokens")]
    assert [section("qwen2.5-coder-0.5b-instruct", [131_072], ("spotlight", "dense in window")),
            section(None, [16_384], ("spotlight", "sinks+window", "dense in window")),
            section(None, [16_384], ("spotlight", "sinks+window", "truncated", "dense in window"))] == [
        ("longctx-qwen2.5-coder-0.5b-instruct-spotlight",
         "Long context: needles and speed past the window (issue #21): qwen2.5-coder-0.5b-instruct, spotlight only"),
        ("longctx-spotlight-sinks-window",
         "Long context: needles and speed past the window (issue #21), spotlight, sinks+window only"),
        ("longctx", "Long context: needles and speed past the window (issue #21)")]


def test_a_haystack_longer_than_the_essays_reads_them_again_from_the_start():
    from bench.longctx import repeated
    assert (repeated([1, 2, 3], 7), repeated([1, 2, 3], 2)) == ([1, 2, 3, 1, 2, 3, 1], [1, 2])


def test_ingest_times_both_lengths_in_turn_on_a_copy_of_the_first_tokens(capsys):
    from bench.longctx import SPEED_REPEATS, ingest
    from spotlight.testing import tiny_engine

    engine = tiny_engine(seed=1, spotlight=True, max_seq_len=256, prefill_chunk=64)
    ids = [(7 * i) % 200 + 3 for i in range(400)]  # past the tiny model's window
    context, speed = ingest(engine, ids, speed_at=150)
    rounds = [line for line in capsys.readouterr().err.splitlines() if "decode round" in line]
    assert (context.tokens, len(rounds), sorted(speed)) == (
        ids, SPEED_REPEATS,
        ["decode_long", "decode_short", "prefill_long", "prefill_seconds", "prefill_short", "slices"])
    assert min(speed["decode_short"], speed["decode_long"], speed["prefill_short"]) > 0
