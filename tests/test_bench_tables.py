"""bench/common.py's targets table: a value that rounds to its goal shows the digits that tell them apart."""
from bench.common import Target, targets_table


def test_a_miss_that_rounds_to_the_goal_shows_its_digits():
    table = targets_table([Target("PPL / dense", 1.0106, 1.01, higher_is_better=False),
                           Target("accuracy", 0.667, 0.6), Target("tok/s", 24.2, 25.0)])
    assert table.splitlines()[2:] == [
        "| PPL / dense | 1.0106 | <= 1.01 | **no** (1.0006x of goal) |",
        "| accuracy | 0.667 | >= 0.6 | yes |",
        "| tok/s | 24.20 | >= 25.00 | **no** (0.97x of goal) |",
    ]
