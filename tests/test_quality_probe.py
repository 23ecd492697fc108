"""bench/quality's retrieval probe: what it counts as a hit, overall and for distant top keys. Issue #4."""
import math

import torch

from bench.quality_methods import Method, RetrievalProbe
from bench.quality_tasks import prefill
from conftest import tiny_pair
from spotlight.attention import OracleSelector, SinkWindowSelector


def probe_after(methods: dict, far: int) -> dict:
    """Summary of a probe that watched a tiny model decode 4 tokens after a 296-token prefill."""
    _, model = tiny_pair("llama", max_position_embeddings=512)
    ids = torch.randint(211, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    probe = RetrievalProbe(methods, (0.1,), 4, 16, 304, model.args, far=far)
    cache = prefill(model, ids[:296], 304, policy=probe)
    with torch.inference_mode():
        for token in ids[296:]:
            model(torch.tensor([token]), cache, probe)
    return probe.summary()


def test_distant_recall_is_one_for_the_exact_top_k_and_zero_for_a_longer_window():
    methods = {"oracle": Method("oracle", OracleSelector(), "oracle"),
               "window": Method("window", SinkWindowSelector(), "window")}
    # 10 % of ~300 tokens extends the 16-token window by ~30: none of it reaches 128 tokens back
    summary = probe_after(methods, far=128)
    layers = range(2)
    assert [summary[("oracle", 0.1, l)]["far"] for l in layers] == [1.0, 1.0]
    assert [summary[("oracle", 0.1, l)]["recall"] for l in layers] == [1.0, 1.0]
    assert [summary[("window", 0.1, l)]["far"] for l in layers] == [0.0, 0.0]
    assert all(0.0 < summary[("window", 0.1, l)]["recall"] < 1.0 for l in layers)


def test_distant_recall_is_nan_when_no_top_key_lies_that_far_back():
    summary = probe_after({"oracle": Method("oracle", OracleSelector(), "oracle")}, far=1000)
    assert all(math.isnan(summary[("oracle", 0.1, l)]["far"]) for l in range(2))
