"""bench/common.py's targets table and bench.quality's perplexity windows (no model)."""
import pytest

from bench.common import Target, targets_table


def test_a_miss_that_rounds_to_the_goal_shows_its_digits():
    table = targets_table([Target("PPL / dense", 1.0106, 1.01, higher_is_better=False),
                           Target("accuracy", 0.667, 0.6), Target("tok/s", 24.2, 25.0)])
    assert table.splitlines()[2:] == [
        "| PPL / dense | 1.0106 | <= 1.01 | **no** (1.0006x of goal) |",
        "| accuracy | 0.667 | >= 0.6 | yes |",
        "| tok/s | 24.20 | >= 25.00 | **no** (0.97x of goal) |",
    ]


def test_perplexity_windows_that_do_not_fit_say_how_many_do():
    from bench.quality import perplexity_windows

    sizes = {"ppl_prefix": 8, "ppl_tokens": 1, "retrieval_docs": 1, "retrieval_len": 5}  # windows of 10 after 5
    ids = list(range(27))
    assert perplexity_windows(ids, {**sizes, "ppl_docs": 2}) == [list(range(5, 15)), list(range(15, 25))]
    for asked in (0, 3):
        with pytest.raises(SystemExit, match=r"^the essays hold 27 tokens: room for 2 perplexity windows of 10 "
                                             r"after the retrieval part's; ask for 1 to 2 \(--ppl-docs\)$"):
            perplexity_windows(ids, {**sizes, "ppl_docs": asked})
