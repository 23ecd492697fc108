"""Spotlight decode attention and the baseline selectors. Issue #3."""
import pytest
import torch

from conftest import tiny_pair
from spotlight.attention import (CodeSelector, DenseDecode, OracleSelector, QuestSelector, SinkWindowSelector,
                                 SpotlightDecode)
from spotlight.cache import KVCache
from spotlight.config import SpotlightConfig
from spotlight.hashing import EncoderSpec, Encoders


def model_and_encoders(bits=128, seed=0):
    _, model = tiny_pair("llama", seed=seed, max_position_embeddings=4096)
    encoders = Encoders(EncoderSpec.for_model(model.args, bits), seed=seed)
    return model, encoders


def decode_logits(model, policy, prompt, steps, code_words=0):
    """Prefill `prompt`, then feed `steps` more tokens one at a time; logits of every step."""
    cache = KVCache(model.args, 64, code_words=code_words)
    out = []
    with torch.inference_mode():
        model(torch.tensor(prompt), cache, policy)
        for token in steps:
            out.append(model(torch.tensor([token]), cache, policy))
    return (torch.stack(out) if out else None), cache


PROMPT = [(i * 37) % 211 for i in range(300)]
STEPS = [5, 17, 99, 3, 140]


def spotlight(encoders, **overrides):
    fields = dict(dense_layers=(), dense_below=0, sinks=4, window=16, ratio=0.05, k_min=8, bits=encoders.spec.bits)
    fields.update(overrides)
    return SpotlightDecode(SpotlightConfig(**fields), CodeSelector(encoders))


def test_ratio_100_percent_equals_dense():
    model, encoders = model_and_encoders()
    dense, _ = decode_logits(model, DenseDecode(), PROMPT, STEPS)
    sparse, _ = decode_logits(model, spotlight(encoders, ratio=1.0), PROMPT, STEPS, code_words=2)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-5)


@pytest.mark.parametrize("selector", [OracleSelector(), QuestSelector(page=16), SinkWindowSelector()])
def test_every_selector_at_100_percent_equals_dense(selector):
    model, _ = model_and_encoders()
    dense, _ = decode_logits(model, DenseDecode(), PROMPT, STEPS)
    policy = SpotlightDecode(SpotlightConfig(dense_layers=(), dense_below=0, ratio=1.0), selector)
    sparse, _ = decode_logits(model, policy, PROMPT, STEPS)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-5)


class Refuse:
    """A selector that must not be asked."""

    code_words = 0

    def on_new_tokens(self, layer, q, k, cache):
        pass

    def select(self, *args):
        raise AssertionError("select() called where attention must be dense")


def test_dense_below_and_dense_layers_are_honoured():
    model, _ = model_and_encoders()
    policy = SpotlightDecode(SpotlightConfig(dense_layers=(), dense_below=len(PROMPT) + 10), Refuse())
    decode_logits(model, policy, PROMPT, STEPS[:3])  # N stays below dense_below
    all_layers = tuple(range(model.args.n_layers))
    policy = SpotlightDecode(SpotlightConfig(dense_layers=all_layers, dense_below=0), Refuse())
    decode_logits(model, policy, PROMPT, STEPS[:3])
    policy = SpotlightDecode(SpotlightConfig(enabled=False, dense_layers=(), dense_below=0), Refuse())
    decode_logits(model, policy, PROMPT, STEPS[:3])


def test_only_non_dense_layers_select():
    model, encoders = model_and_encoders()
    policy = spotlight(encoders, dense_layers=(0,))
    decode_logits(model, policy, PROMPT, STEPS[:1], code_words=2)
    assert [policy.selection(layer) is not None for layer in range(model.args.n_layers)] == [False, True]


@pytest.mark.parametrize("selector_name", ["spotlight", "oracle", "quest", "sinkwindow"])
def test_selection_has_sinks_window_and_exactly_the_budget(selector_name):
    model, encoders = model_and_encoders()
    selector = {"spotlight": CodeSelector(encoders), "oracle": OracleSelector(), "quest": QuestSelector(),
                "sinkwindow": SinkWindowSelector()}[selector_name]
    config = SpotlightConfig(dense_layers=(), dense_below=0, sinks=4, window=16, ratio=0.05, k_min=8)
    policy = SpotlightDecode(config, selector)
    decode_logits(model, policy, PROMPT, STEPS[:1], code_words=selector.code_words)
    n = len(PROMPT) + 1
    budget = config.budget(n)
    for layer in range(model.args.n_layers):
        idx = torch.as_tensor(policy.selection(layer))
        assert idx.shape == (model.args.n_kv_heads, budget)
        for row in idx.tolist():
            assert row == sorted(set(row)), "indices ascending and distinct"
            assert set(range(4)) <= set(row) and set(range(n - 16, n)) <= set(row)
            assert all(0 <= i < n for i in row)


def test_codes_appended_incrementally_equal_codes_computed_at_once():
    import kernels

    model, encoders = model_and_encoders()
    policy = spotlight(encoders)
    tokens = PROMPT[:100]
    cache = KVCache(model.args, 8, code_words=2)
    with torch.inference_mode():
        model(torch.tensor(tokens[:37]), cache, policy)  # a prefill chunk, then growth and single steps
        for t in tokens[37:60]:
            model(torch.tensor([t]), cache, policy)
        model(torch.tensor(tokens[60:]), cache, policy)
        n = len(tokens)
        for layer in range(model.args.n_layers):
            h = encoders.key_bits(layer, cache.keys(layer))  # all cached keys at once: (Hkv, N, C)
            at_once = kernels.pack(h.numpy()).transpose(0, 2, 1)  # (Hkv, W, N)
            assert (cache.codes[layer, :, :, :n] == at_once).all(), f"layer {layer}"


def test_a_decode_step_codes_its_key_with_the_fused_kernel_and_the_codes_match_prefill():
    """Regression (the chat service's Spotlight decode at ~2.5 s per token): through torch, one
    token's key encoder is three tiny batched GEMMs per layer, each a threaded MKL call that
    waited ~8 ms for the second core of a busy 2-core machine. Decode steps use mlp_codes."""
    import kernels

    model, encoders = model_and_encoders()
    with torch.no_grad():
        encoders.key.w2.normal_(0, 0.2)  # a residual block that changes the codes, like a trained one
    torch_codes, calls = encoders.key_bits, []
    encoders.key_bits = lambda layer, k: (calls.append(k.shape[1]), torch_codes(layer, k))[1]
    _, cache = decode_logits(model, spotlight(encoders), PROMPT, STEPS, code_words=2)
    assert calls == [len(PROMPT)] * model.args.n_layers  # the prefill only: no decode step ran torch's encoder
    n = len(PROMPT) + len(STEPS)
    for layer in range(model.args.n_layers):
        with torch.inference_mode():
            h = torch_codes(layer, cache.keys(layer))  # every cached key at once: (Hkv, N, C)
        at_once = kernels.pack(h.numpy()).transpose(0, 2, 1)  # (Hkv, W, N)
        assert (cache.codes[layer, :, :, :n] == at_once).all(), f"layer {layer}"

def test_untrained_identity_codes_are_the_signs_of_the_keys():
    model, encoders = model_and_encoders(bits=64)
    k = torch.randn(model.args.n_kv_heads, 5, model.args.head_dim)
    h = encoders.key_bits(0, k)
    assert torch.equal(h[..., : k.shape[-1]] > 0, k > 0)  # identity projection on the first D bits, zero residual


def test_sparse_attention_is_close_to_dense_with_oracle_at_small_budget():
    model, _ = model_and_encoders()
    dense, _ = decode_logits(model, DenseDecode(), PROMPT, STEPS)
    policy = SpotlightDecode(SpotlightConfig(dense_layers=(), dense_below=0, ratio=0.3, k_min=8, window=16),
                             OracleSelector())
    sparse, _ = decode_logits(model, policy, PROMPT, STEPS)
    assert (sparse - dense).abs().max() < (dense.abs().max() * 0.5)
    assert not torch.equal(sparse, dense)
