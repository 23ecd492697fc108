"""bench/decode.py's bytes a decode step reads (its floor), on the test engine (SmolLM2-135M:
30 layers, 3 KV heads of 64, fp16 K/V: 768 bytes per token and layer; 128-bit codes: 2 words)."""
from bench.decode import step_cache_bytes
from spotlight.config import SpotlightConfig


def test_a_dense_step_reads_every_row_of_every_layer(engine):
    assert [step_cache_bytes(engine, n) for n in (1024, 4096)] == [1024 * 768 * 30, 4096 * 768 * 30]


def test_a_spotlight_step_reads_its_selection_and_the_key_codes_in_sparse_layers(engine):
    spotlight = engine.with_spotlight(SpotlightConfig(dense_below=2048))  # the default reads the 8K window densely
    below, inside, past = 1024, 4096, 16384  # dense below 2,048; the 8K window; the far budget past it
    selected = 4 + int(0.15 * inside) + 512  # sinks + 15 % + window
    far = 4 + 4096 + 1024  # sinks + far_retrieved + far_window, every layer
    assert [step_cache_bytes(spotlight, n) for n in (below, inside, past)] == [
        below * 768 * 30,
        2 * inside * 768 + 28 * (selected * 768 + inside * 3 * 2 * 8),
        30 * (far * 768 + past * 3 * 2 * 8),
    ]
