"""bench/resume.py: its arguments (no model)."""
import pytest


def test_refuses_a_negative_decode_length_before_any_model_loads(capsys):
    from bench.resume import main

    with pytest.raises(SystemExit) as refused:
        main(["--long", "131072", "--decode-tokens", "-5"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m bench.resume: error: --decode-tokens: give a number of reply tokens to time, or 0 to skip; got -5")
