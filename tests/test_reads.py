"""The read share of a reply: measured at every decode step (the engine's ReadMeter observer,
tested step by step in tests/test_engine.py), stored with the turn,
shown under the chat. Issue: "The chat app decodes with Spotlight attention when it is enabled,
and shows Spotlight's measured share of the context read per decode step"."""
import pytest

from chat import ui_model as ui
from chat.config import AppConfig
from chat.service import ChatService
from spotlight.config import SamplingConfig, SpotlightConfig
from spotlight.testing import tiny_engine

DOCUMENT = " ".join(f"Line {i}: the courier arrives on day {i % 7}." for i in range(12))  # ~480 bytes = tokens
NEW_TOKENS = 5


def reply(tmp_path, engine, text, document=None):
    """(service, final Turn, prompt length) of one reply on a new conversation."""
    config = AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=NEW_TOKENS), system_prompt="Be brief.",
                       sources="all")  # every tallied source, related to the tiny model's bytes or not
    service = ChatService(config, _engine=engine)
    session = service.create()
    if document:
        service.attach_text(session.id, "courier.txt", document)
    turn = list(service.send(session.id, text))[-1]
    return service, turn, turn.cached_tokens + turn.prefill_tokens


def test_spotlight_turn_reads_the_budget_and_reports_the_recorded_share(tmp_path):
    engine = tiny_engine(seed=2, spotlight=True)
    config = engine.spotlight  # dense_layers (0,), dense_below 64, 16 retrieved at least
    service, turn, prompt = reply(tmp_path, engine, "When does the courier come?", DOCUMENT)
    assert (turn.finish, turn.decode_tokens) == ("length", NEW_TOKENS)
    assert turn.sources  # the sources tally observed the same steps
    # One decode step per generated token (the last one's forward too); layer 0 dense, layer 1 Spotlight.
    sizes = [prompt + i for i in range(1, NEW_TOKENS + 1)]
    assert all(config.budget(n) < n for n in sizes)  # the sparse layer really read less
    expected = sum((n + config.budget(n)) / (2 * n) for n in sizes) / len(sizes)
    assert turn.read_share == pytest.approx(expected, abs=1e-12) and turn.spotlight
    stats = service.history(turn.session_id)[-1].stats
    assert (stats["read_share"], stats["spotlight"]) == (round(turn.read_share, 4), True)
    shown = f"Spotlight read {100 * stats['read_share']:.1f}% of the context per step"
    assert shown in ui.turn_line(stats, config).split(" · ")
    service.close()


def test_below_dense_below_every_step_reads_everything(tmp_path):
    engine = tiny_engine(seed=2, spotlight=True)
    config = engine.spotlight
    service, turn, prompt = reply(tmp_path, engine, "Hi")
    assert prompt + NEW_TOKENS < config.dense_below
    assert (turn.read_share, turn.spotlight) == (1.0, True)
    stats = service.history(turn.session_id)[-1].stats
    assert ui.spotlight_share(config, prompt, stats["read_share"], measured_spotlight=stats["spotlight"]) == \
        "Spotlight read 100.0% of the context per step (dense below 64 tokens)"
    service.close()


def test_a_dense_engine_reports_full_reads_as_spotlight_off(tmp_path):
    service, turn, prompt = reply(tmp_path, tiny_engine(seed=2), "When does the courier come?", DOCUMENT)
    assert (turn.read_share, turn.spotlight) == (1.0, False)
    stats = service.history(turn.session_id)[-1].stats
    assert "Spotlight off: every step read the whole context" in ui.turn_line(stats, SpotlightConfig()).split(" · ")
    service.close()
