"""GGUF weights kept quantized for decode (spotlight/quantized.py, issue #20).

A tiny random llama model is written to a GGUF by the test (gguf.GGUFWriter, blocks from
gguf.quants.quantize, attn_q / attn_k permuted the way llama.cpp's converter permutes them); its
fp32 twin holds exactly the weights gguf dequantises back (un-permuted). The quantized model must
then give the fp32 model's logits within RELATIVE_TOLERANCE on a decode step and the same bits in
prefill (whose weights are dequantised, bit-identical to gguf's).
"""
from __future__ import annotations

import copy
import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from kernels import quant
from kernels.quant import CorruptTensor
from spotlight import config, loading
from spotlight.attention import CodeSelector, DenseDecode, OracleSelector, SpotlightDecode
from spotlight.cache import KVCache
from spotlight.config import EngineConfig, SpotlightConfig
from spotlight.engine import Engine
from spotlight.hashing import EncoderSpec, Encoders
from spotlight.model import RMSNorm, Transformer, build_model
from spotlight.onerow import use_onerow_linear
from spotlight.quantized import (QuantEmbedding, QuantLinear, build_quantized_model, quantize_to_q8_0, unpermute_rows,
                                 use_fused_decode, use_quantized_linear)
from conftest import TEST_HOME, TEST_MODEL
from spotlight.testing import tiny_args

RELATIVE_TOLERANCE = 1e-4  # || quantized - fp32 || / || fp32 || of one decode step's logits
Q = gguf.GGMLQuantizationType
# llama.cpp tensor -> (our parameter, ggml type) of the tiny model's layer N; the types cover
# every format the default model and the C kernels use
LAYER_TENSORS = {"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0,
                 "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """The rope permutation llama.cpp's converter applies to attn_q / attn_k rows (inverse of
    spotlight.quantized.unpermute_rows)."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_weights(model: Transformer, layer: int) -> dict[str, np.ndarray]:
    """The tiny model's per-layer matrices under llama.cpp's names, fp32, HF row order."""
    args, block = model.args, model.layers[layer]
    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    qkv = block.attention.wqkv.weight.numpy()
    gate_up = block.feed_forward.w_gate_up.weight.numpy()
    return {"attn_q": qkv[:q_rows], "attn_k": qkv[q_rows:q_rows + kv_rows], "attn_v": qkv[q_rows + kv_rows:],
            "attn_output": block.attention.wo.weight.numpy(), "ffn_gate": gate_up[:args.intermediate_size],
            "ffn_up": gate_up[args.intermediate_size:], "ffn_down": block.feed_forward.w_down.weight.numpy()}


def write_tiny_gguf(path, model: Transformer, types: dict = LAYER_TENSORS, output_type=Q.Q8_0,
                    tied_type=None) -> None:
    """Write `model` as a llama GGUF, then load gguf's dequantisation of each matrix back into
    `model` (so `model` is the fp32 twin of the file). Norms are written as F32. tied_type: the
    embedding is written in that type and no output tensor (llama.cpp's tied layout); `model`
    must then tie its output to its embedding."""
    args = model.args
    writer = gguf.GGUFWriter(path, "llama")
    if tied_type is None:
        writer.add_tensor("token_embd.weight", model.tok_embeddings.weight.numpy())
    else:
        embedding = quantize(model.tok_embeddings.weight.numpy(), tied_type)
        writer.add_tensor("token_embd.weight", embedding, raw_shape=embedding.shape, raw_dtype=tied_type)
        with torch.no_grad():
            model.tok_embeddings.weight.copy_(torch.from_numpy(dequantize(embedding, tied_type)))
    writer.add_tensor("output_norm.weight", model.norm.weight.numpy())
    for i, block in enumerate(model.layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", block.attention_norm.weight.numpy())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", block.ffn_norm.weight.numpy())
    dequantised = {}
    for i in range(args.n_layers):
        for name, weight in hf_weights(model, i).items():
            heads = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads}.get(name)
            stored = llama_cpp_permute(weight, heads) if heads else weight
            qtype = types[name]
            if qtype == Q.F16:
                writer.add_tensor(f"blk.{i}.{name}.weight", stored.astype(np.float16))
                back = stored.astype(np.float16).astype(np.float32)
            else:
                blocks = quantize(stored, qtype)
                writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
                back = dequantize(blocks, qtype)
            dequantised[(i, name)] = back[unpermute_rows(back.shape[0], heads)] if heads else back
    if tied_type is None:
        output = quantize(model.output.weight.numpy(), output_type)
        writer.add_tensor("output.weight", output, raw_shape=output.shape, raw_dtype=output_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        for i, block in enumerate(model.layers):
            d = {name: torch.from_numpy(dequantised[(i, name)]) for name in LAYER_TENSORS}
            block.attention.wqkv.weight.copy_(torch.cat([d["attn_q"], d["attn_k"], d["attn_v"]]))
            block.attention.wo.weight.copy_(d["attn_output"])
            block.feed_forward.w_gate_up.weight.copy_(torch.cat([d["ffn_gate"], d["ffn_up"]]))
            block.feed_forward.w_down.weight.copy_(d["ffn_down"])
        if tied_type is None:
            model.output.weight.copy_(torch.from_numpy(dequantize(output, output_type)))


@pytest.fixture
def tiny_pair(tmp_path):
    """(fp32 twin, quantized model, swap report, GGUF path) of a tiny random llama GGUF."""
    torch.manual_seed(0)
    fp32 = use_onerow_linear(Transformer(tiny_args(64)).eval().requires_grad_(False))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, fp32)
    quantized = copy.deepcopy(fp32)
    swap = use_quantized_linear(quantized, path, fp32.args)
    return fp32, quantized, swap, path


def run(model: Transformer, prompt: torch.Tensor, steps: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(all prefill logits (T, V), the logits (V,) of each one-token decode step)."""
    cache = KVCache(model.args, len(prompt) + len(steps))
    with torch.inference_mode():
        prefill = model(prompt, cache, DenseDecode(), all_logits=True)  # (T, V)
        decoded = [model(torch.tensor([token]), cache, DenseDecode()) for token in steps]  # (V,) each
    return prefill, decoded


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_unpermute_rows_inverts_llama_cpp_permutation():
    rows = np.arange(24, dtype=np.float32)[:, None]  # (24, 1): 3 heads of 8 rows
    assert unpermute_rows(24, 3).tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                              16, 18, 20, 22, 17, 19, 21, 23]
    assert np.array_equal(llama_cpp_permute(rows, 3)[unpermute_rows(24, 3)], rows)


def against_fp32(quantized: Transformer, fp32: Transformer) -> tuple[bool, list[float]]:
    """(prefill logits equal to the fp32 twin's bit for bit, each decode step's relative error)."""
    prompt = torch.arange(3, 40)  # (T,)
    want_prefill, want_steps = run(fp32, prompt, [5, 77, 200])
    got_prefill, got_steps = run(quantized, prompt, [5, 77, 200])
    return torch.equal(got_prefill, want_prefill), [relative(g, w) for g, w in zip(got_steps, want_steps)]


def test_tiny_gguf_swaps_every_linear_and_decodes_as_fp32(tiny_pair):
    fp32, quantized, swap, _ = tiny_pair
    args = fp32.args
    assert swap.swapped == tuple(f"layers.{i}.{m}" for i in range(args.n_layers) for m in
                                 ("attention.wqkv", "attention.wo", "feed_forward.w_gate_up",
                                  "feed_forward.w_down")) + ("output",)
    assert swap.kept_fp32 == ()
    assert [m.qtypes for m in quantized.modules() if isinstance(m, QuantLinear)][:4] == [
        ("Q4_1", "Q8_0", "Q4_1"), ("Q5_0",), ("Q4_1", "Q4_1"), ("Q8_0",)]
    # prefill dequantises into the shared buffer: gguf's exact weights, so torch's exact result
    prefill_equal, errors = against_fp32(quantized, fp32)
    assert prefill_equal
    assert max(errors) <= RELATIVE_TOLERANCE, errors


@pytest.mark.skipif(not quant.C_SIMD, reason="the int16 kernels run where kernels/_quant.so has AVX2")
def test_tiny_gguf_decodes_with_int16_activations_close_to_fp32(tiny_pair):
    """activations="int16": every part's one-row product rounds x to int16 first; the decode
    steps' logits stay within the same tolerance of the fp32 model, and prefill is untouched."""
    fp32, _, _, path = tiny_pair
    quantized = copy.deepcopy(fp32)
    use_quantized_linear(quantized, path, fp32.args, activations="int16")
    modules = [m for m in quantized.modules() if isinstance(m, QuantLinear)]
    assert {a for m in modules for a in m.activations} == {"int16"}
    prefill_equal, errors = against_fp32(quantized, fp32)
    assert prefill_equal
    assert max(errors) <= RELATIVE_TOLERANCE, errors


def fused_against_modules(model: Transformer, prompt: torch.Tensor, steps: list[int]) -> list[float]:
    """use_fused_decode on `model`, then each decode step's logits fused (block by block) vs
    through the modules."""
    assert use_fused_decode(model) == model.args.n_layers
    model.use_fused_step(None)
    _, fused = run(model, prompt, steps)
    for block in model.layers:
        block.use_fused_decode(None)
    _, modules = run(model, prompt, steps)
    return [relative(f, m) for f, m in zip(fused, modules)]


class CountingDense(DenseDecode):
    """DenseDecode that counts its per-layer decode calls; `whole` is what dense_step answers."""

    def __init__(self, whole: bool):
        super().__init__()
        self.whole, self.calls = whole, 0

    def dense_step(self, n_tokens: int) -> bool:
        return self.whole

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        self.calls += 1
        return super().decode(layer, q, cache)


class QueryLog:
    """A StepObserver keeping a copy of each layer's query and what it says was read."""

    def __init__(self):
        self.seen: list[tuple[int, torch.Tensor, int, object]] = []

    def on_layer(self, layer: int, q: torch.Tensor, cache, selected) -> None:
        self.seen.append((layer, q.clone(), cache.length, selected))

    def on_step(self, n_tokens: int) -> None:
        pass


def decode_steps(model: Transformer, policy, prompt: torch.Tensor, steps: list[int], dtype):
    """(each step's logits, the cache's rows after them, QueryLog of the steps) under `policy`."""
    cache = KVCache(model.args, len(prompt) + len(steps), dtype=dtype)
    log = QueryLog()
    with torch.inference_mode():
        model(prompt, cache, DenseDecode())
        logits = [model(torch.tensor([token]), cache, policy, observers=[log]) for token in steps]
    n = cache.length
    return logits, (cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()), log


@pytest.mark.skipif(not quant.C_STEP, reason="needs kernels/_quant.so with AVX2 (attend.c)")
@pytest.mark.parametrize("activations", ["fp32", "int16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_step_equals_the_fused_blocks(tiny_pair, activations, dtype):
    """Every block of a dense decode step in one compiled call (FusedStep) computes the per-block
    calls' logits and cache rows bit for bit, and tells the observers the same queries; a policy
    whose dense_step says no runs block by block."""
    fp32, _, _, path = tiny_pair
    model = random_norms(copy.deepcopy(fp32), 7)
    use_quantized_linear(model, path, fp32.args, activations=activations)
    assert use_fused_decode(model) == model.args.n_layers
    prompt, steps = torch.arange(3, 40), [5, 77, 200, 9]
    whole, by_blocks = CountingDense(True), CountingDense(False)
    got, got_rows, got_log = decode_steps(model, whole, prompt, steps, dtype)
    want, want_rows, want_log = decode_steps(model, by_blocks, prompt, steps, dtype)
    assert (whole.calls, by_blocks.calls) == (0, len(steps) * model.args.n_layers)
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True] * len(steps)
    assert torch.equal(got_rows[0], want_rows[0]) and torch.equal(got_rows[1], want_rows[1])
    assert [(layer, n, selected) for layer, _, n, selected in got_log.seen] == \
        [(layer, n, selected) for layer, _, n, selected in want_log.seen]
    assert all(torch.equal(g[1], w[1]) for g, w in zip(got_log.seen, want_log.seen))


class CountingCodes(CodeSelector):
    """CodeSelector that counts the decode steps' per-layer key codings (on_new_tokens of one token)."""

    def __init__(self, encoders: Encoders):
        super().__init__(encoders)
        self.step_codings = 0

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        self.step_codings += k.shape[1] == 1
        super().on_new_tokens(layer, q, k, cache)


@pytest.mark.skipif(not quant.C_CODED_STEP, reason="needs kernels/_quant.so with AVX2 (attend.c, encode.c)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_spotlight_step_below_dense_below_runs_fused_and_codes_its_keys(tiny_pair, dtype):
    """Below dense_below a Spotlight step reads every row and keeps each new key's codes: in one
    compiled call (FusedStep with the policy's key coders) it computes the block-by-block steps'
    logits, cache rows and key codes bit for bit; from dense_below on it runs block by block."""
    fp32, _, _, path = tiny_pair
    model = random_norms(copy.deepcopy(fp32), 7)
    use_quantized_linear(model, path, fp32.args, activations="int16")
    assert use_fused_decode(model) == model.args.n_layers
    step = model.fused_step
    encoders = Encoders(EncoderSpec.for_model(model.args, 64), seed=3, model_fingerprint="tiny")
    prompt, steps = torch.arange(3, 40), [5, 77, 200, 9]
    config = SpotlightConfig(bits=64, dense_below=len(prompt) + len(steps) + 1)

    def decode(fused: bool):
        model.use_fused_step(step if fused else None)
        selector = CountingCodes(encoders)
        policy = SpotlightDecode(config, selector)
        cache = KVCache(model.args, len(prompt) + len(steps), dtype=dtype, code_words=policy.code_words)
        with torch.inference_mode():
            model(prompt, cache, policy)
            logits = [model(torch.tensor([token]), cache, policy) for token in steps]
        n = cache.length
        rows = (cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone(), cache.codes[..., :n].copy())
        return logits, rows, selector.step_codings, policy, cache

    got, got_rows, got_codings, policy, cache = decode(fused=True)
    want, want_rows, want_codings, _, _ = decode(fused=False)
    assert (got_codings, want_codings) == (0, len(steps) * model.args.n_layers)
    assert [torch.equal(g, w) for g, w in zip(got, want)] == [True] * len(steps)
    assert torch.equal(got_rows[0], want_rows[0]) and torch.equal(got_rows[1], want_rows[1])
    assert np.array_equal(got_rows[2], want_rows[2])
    assert len(policy.step_key_coders(config.dense_below - 1, cache)) == model.args.n_layers
    assert policy.step_key_coders(config.dense_below, cache) is None


def test_a_selector_without_codes_hands_the_step_no_coders(tiny_pair):
    """Below dense_below a Spotlight step over a selector that keeps no codes (the exact top-k)
    has no keys to code: no coders, so the one-call dense step runs as it does for dense decode."""
    fp32, _, _, _ = tiny_pair
    config = SpotlightConfig(dense_below=64)
    cache = KVCache(fp32.args, 8)
    policy = SpotlightDecode(config, OracleSelector())
    assert (policy.step_key_coders(63, cache), policy.step_key_coders(64, cache)) == ((), None)


@pytest.mark.skipif(not quant.C_CODED_STEP, reason="needs kernels/_quant.so with AVX2 (attend.c, encode.c)")
def test_the_coded_step_refuses_coders_that_do_not_fit_the_cache(tiny_pair):
    """Coders for another code width, or a cache without codes, are refused (the step then runs
    block by block); no coders at all always fit."""
    fp32, _, _, path = tiny_pair
    model = copy.deepcopy(fp32)
    use_quantized_linear(model, path, fp32.args, activations="int16")
    use_fused_decode(model)
    coders = CodeSelector(Encoders(EncoderSpec.for_model(model.args, 64), seed=3)).step_key_coders(model.args.n_layers)
    wide = CodeSelector(Encoders(EncoderSpec.for_model(model.args, 128), seed=3)).step_key_coders(model.args.n_layers)
    coded, uncoded = KVCache(model.args, 8, code_words=1), KVCache(model.args, 8)
    step = model.fused_step
    assert [step.codes(coders, coded), step.codes(wide, coded), step.codes(coders, uncoded), step.codes((), uncoded),
            step.codes(coders[:1], coded)] == [True, False, False, True, False]


@pytest.mark.skipif(not quant.C_FUSED or not quant.C_SIMD, reason="needs kernels/_quant.so with AVX2")
@pytest.mark.parametrize("activations, tolerance", [("fp32", 1e-5), ("int16", 1e-4)])
def test_fused_decode_equals_the_modules(tiny_pair, activations, tolerance):
    """A block's decode step in quant.c's two calls (norm, q/k/v, rope; output, residual, norm,
    MLP, residual) computes what its modules compute, up to the order of fp32 sums (and, with
    int16 activations, which side of a rounding a value lands on)."""
    fp32, _, _, path = tiny_pair
    model = random_norms(copy.deepcopy(fp32), 4)
    use_quantized_linear(model, path, fp32.args, activations=activations)
    errors = fused_against_modules(model, torch.arange(3, 40), [5, 77, 200, 9])
    assert max(errors) <= tolerance, errors


@pytest.mark.skipif(not quant.C_FUSED or not quant.C_SIMD, reason="needs kernels/_quant.so with AVX2")
def test_fused_decode_silu_holds_far_in_both_tails(tiny_pair):
    """The fused tail's silu (quant.c silu_mul: eight values at a time through simd.h's exp2_8,
    capped at 2^126) against torch's, with the MLP norms scaled until the gate values reach the
    hundreds of both signs, where e^-g overflows or vanishes."""
    fp32, _, _, path = tiny_pair
    model = random_norms(copy.deepcopy(fp32), 6)
    with torch.no_grad():
        for block in model.layers:
            block.ffn_norm.weight.mul_(400.0)
    use_quantized_linear(model, path, fp32.args, activations="fp32")
    gates = []
    width = model.args.intermediate_size
    hook = model.layers[0].feed_forward.w_gate_up.register_forward_hook(
        lambda module, args, out: gates.append(out[..., :width].abs().max().item()))
    errors = fused_against_modules(model, torch.arange(3, 40), [5, 77, 200, 9])
    hook.remove()
    assert min(gates) >= 100.0, gates  # the module runs' gate values: far in the tails
    assert max(errors) <= 1e-5, errors


@pytest.mark.skipif(not quant.C_FUSED or not quant.C_SIMD, reason="needs kernels/_quant.so with AVX2")
def test_fused_decode_adds_the_biases():
    """Qwen2's q/k/v biases (and any other linear's) enter the fused products."""
    torch.manual_seed(5)
    args = type(tiny_args(64))(**{**tiny_args(64).__dict__, "qkv_bias": True, "o_bias": True, "mlp_bias": True})
    model = random_norms(use_onerow_linear(Transformer(args).eval().requires_grad_(False)), 5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    quantize_to_q8_0(model, activations="int16")
    errors = fused_against_modules(model, torch.arange(3, 30), [4, 8, 15])
    assert max(errors) <= 1e-4, errors


def test_block_with_a_part_without_c_kernel_is_not_fused(tmp_path):
    torch.manual_seed(6)
    fp32 = use_onerow_linear(Transformer(tiny_args(64)).eval().requires_grad_(False))
    path = tmp_path / "q5_1.gguf"
    write_tiny_gguf(path, fp32, {**LAYER_TENSORS, "ffn_down": Q.Q5_1})  # Q5_1: numba only
    model = copy.deepcopy(fp32)
    use_quantized_linear(model, path, fp32.args, activations="int16")
    assert use_fused_decode(model) == 0
    assert [block.fused_decode for block in model.layers] == [None] * fp32.args.n_layers
    assert model.fused_step is None


def random_norms(model: Transformer, seed: int) -> Transformer:
    """`model` with random norm weights (ones would hide a norm not read from the file)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.5 * torch.rand(module.weight.shape, generator=generator))
    return model


@pytest.fixture
def tied_gguf(tmp_path):
    """(fp32 twin, GGUF path) of a tiny tied llama: Q8_0 embedding = output, as SmolLM2's GGUF."""
    torch.manual_seed(3)
    args = type(tiny_args(64))(**{**tiny_args(64).__dict__, "tie_embeddings": True})
    fp32 = random_norms(use_onerow_linear(Transformer(args).eval().requires_grad_(False)), 3)
    assert fp32.output.weight is fp32.tok_embeddings.weight
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, fp32, tied_type=Q.Q8_0)
    return fp32, path


def test_model_built_from_the_gguf_alone_equals_its_fp32_twin(tied_gguf):
    """build_quantized_model: no fp32 linear, no fp32 embedding; prefill matches the twin (the
    output projection runs in row runs of the shared buffer), decode within the tolerance."""
    fp32, path = tied_gguf
    model, swap = build_quantized_model(path, fp32.args)
    args = fp32.args
    assert swap.kept_fp32 == () and swap.swapped[-1] == "output" and len(swap.swapped) == 4 * args.n_layers + 1
    assert isinstance(model.tok_embeddings, QuantEmbedding) and model.tok_embeddings.matrix.qtype == "Q8_0"
    assert model.output.parts[0] is model.tok_embeddings.matrix  # one copy of the tied blocks
    assert model.output.chunked and model.output.scratch.elements < args.vocab_size * args.dim
    dense = [name for name, p in model.named_parameters() if p.dim() == 2]
    assert dense == []  # every matrix stays in blocks
    assert torch.equal(model.norm.weight, fp32.norm.weight)
    prompt = torch.arange(3, 40)  # (T,)
    want_prefill, want_steps = run(fp32, prompt, [5, 77, 200])
    got_prefill, got_steps = run(model, prompt, [5, 77, 200])
    assert relative(got_prefill, want_prefill) <= 1e-6, relative(got_prefill, want_prefill)
    errors = [relative(got, want) for got, want in zip(got_steps, want_steps)]
    assert max(errors) <= RELATIVE_TOLERANCE, errors


def test_quant_embedding_looks_up_gguf_rows_exactly(tied_gguf):
    fp32, path = tied_gguf
    model, _ = build_quantized_model(path, fp32.args)
    tokens = torch.tensor([[7, 0, 7], [fp32.args.vocab_size - 1, 3, 1]])  # (2, 3): any shape, repeats
    got = model.tok_embeddings(tokens)  # (2, 3, E)
    assert got.shape == (2, 3, fp32.args.dim)
    assert torch.equal(got, fp32.tok_embeddings.weight[tokens])
    assert model.tok_embeddings(torch.tensor([], dtype=torch.long)).shape == (0, fp32.args.dim)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        model.tok_embeddings(torch.tensor([fp32.args.vocab_size]))


def test_model_built_from_the_gguf_keeps_kernel_less_tensors_fp32(tmp_path, caplog):
    """An F16 ffn_down and an untied F32 embedding: fp32 modules dequantised by gguf, with a notice."""
    torch.manual_seed(4)
    fp32 = random_norms(use_onerow_linear(Transformer(tiny_args(64)).eval().requires_grad_(False)), 4)
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, fp32, {**LAYER_TENSORS, "ffn_down": Q.F16})
    with caplog.at_level(logging.WARNING, logger="spotlight"):
        model, swap = build_quantized_model(path, fp32.args)
    layers = fp32.args.n_layers
    assert swap.kept_fp32 == tuple(f"layers.{i}.feed_forward.w_down: F16" for i in range(layers)) + (
        "tok_embeddings: F32",)
    assert "'blk.0.ffn_down.weight' is F16, which has no quantized kernel" in caplog.text
    assert torch.equal(model.layers[1].feed_forward.w_down.weight, fp32.layers[1].feed_forward.w_down.weight)
    assert model.output.qtypes == ("Q8_0",) and model.output.chunked
    prompt = torch.arange(3, 20)
    want_prefill, want = run(fp32, prompt, [9])
    got_prefill, got = run(model, prompt, [9])
    assert relative(got_prefill, want_prefill) <= 1e-6
    assert relative(got[0], want[0]) <= RELATIVE_TOLERANCE


def test_model_built_from_a_gguf_without_norms_names_the_tensor(tiny_pair, tmp_path):
    fp32, _, _, _ = tiny_pair
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("token_embd.weight", fp32.tok_embeddings.weight.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CorruptTensor, match=r"'blk\.0\.attn_norm\.weight' is missing"):
        build_quantized_model(path, fp32.args)


def test_kernel_less_type_stays_fp32_with_a_notice(tmp_path, caplog):
    torch.manual_seed(1)
    fp32 = use_onerow_linear(Transformer(tiny_args(64)).eval().requires_grad_(False))
    path = tmp_path / "f16.gguf"
    write_tiny_gguf(path, fp32, {**LAYER_TENSORS, "ffn_down": Q.F16})
    quantized = copy.deepcopy(fp32)
    with caplog.at_level(logging.WARNING, logger="spotlight"):
        swap = use_quantized_linear(quantized, path, fp32.args)
    assert swap.kept_fp32 == tuple(f"layers.{i}.feed_forward.w_down: F16" for i in range(fp32.args.n_layers))
    assert "'blk.0.ffn_down.weight' is F16, which has no quantized kernel" in caplog.text
    assert not isinstance(quantized.layers[0].feed_forward.w_down, QuantLinear)
    prompt = torch.arange(3, 20)
    _, want = run(fp32, prompt, [9])
    _, got = run(quantized, prompt, [9])
    assert relative(got[0], want[0]) <= RELATIVE_TOLERANCE


def test_format_without_c_kernel_runs_numba_in_the_same_module(tmp_path):
    """Q4_0 has a numba kernel but none in quant.c: its QuantLinear takes the numba path."""
    torch.manual_seed(2)
    fp32 = use_onerow_linear(Transformer(tiny_args(64)).eval().requires_grad_(False))
    path = tmp_path / "q4_0.gguf"
    write_tiny_gguf(path, fp32, {**LAYER_TENSORS, "attn_output": Q.Q4_0})
    quantized = copy.deepcopy(fp32)
    use_quantized_linear(quantized, path, fp32.args)
    assert quantized.layers[0].attention.wo.qtypes == ("Q4_0",)
    prompt = torch.arange(3, 20)
    _, want = run(fp32, prompt, [9, 10])
    _, got = run(quantized, prompt, [9, 10])
    assert max(relative(g, w) for g, w in zip(got, want)) <= RELATIVE_TOLERANCE


def test_truncated_gguf_raises_corrupt_tensor(tiny_pair, tmp_path):
    fp32, _, _, path = tiny_pair
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptTensor, match="truncated"):
        use_quantized_linear(copy.deepcopy(fp32), cut, fp32.args)


def test_tensor_of_another_shape_raises_corrupt_tensor_naming_it(tiny_pair):
    fp32, _, _, path = tiny_pair
    other = tiny_args(64)
    wider = type(other)(**{**other.__dict__, "intermediate_size": other.intermediate_size + 32})
    with pytest.raises(CorruptTensor, match=r"'blk\.0\.ffn_gate\.weight' is \(96, 64\) but the model needs \(128, 64\)"):
        use_quantized_linear(copy.deepcopy(fp32), path, wider)


def test_engine_config_validates_activations():
    assert EngineConfig().activations == "int16" and EngineConfig(activations="fp32").activations == "fp32"
    assert set(config.ACTIVATIONS) == set(quant.ACTIVATIONS)  # the engine's names are the kernels'
    with pytest.raises(ValueError, match="activations must be one of int16, fp32; got 'int8'"):
        EngineConfig(activations="int8")


def test_engine_config_validates_weights():
    assert EngineConfig().weights == "quantized" and EngineConfig(weights="fp32").weights == "fp32"
    with pytest.raises(ValueError, match="weights must be one of quantized, fp32; got 'int4'"):
        EngineConfig(weights="int4")



def test_decode_kernels_default_to_two_threads_where_two_cores_are_there():
    import os

    cores = len(os.sched_getaffinity(0))
    assert (EngineConfig().kernel_threads, EngineConfig(kernel_threads=1).kernel_threads) == (min(2, cores), 1)
    with pytest.raises(ValueError, match="kernel_threads must be >= 1, got 0"):
        EngineConfig(kernel_threads=0)

# ------------------------------------------------------------------- the test model (SmolLM2)
GREEDY_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}],
]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def fp32_default(engine):
    """The default model on its fp32 dequantised copy, built as Engine.load builds it with weights="fp32"."""
    source = loading.resolve(engine.source.origin, TEST_HOME)  # the quantized engine made no fp32 copy
    args = loading.load_args(source)
    return use_onerow_linear(build_model(args, loading.load_state_dict(source)))


def greedy(model: Transformer, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and each step's logit margin (top-1 minus top-2)."""
    cache = KVCache(model.args, len(ids) + steps)
    tokens, margins = [], []
    with torch.inference_mode():
        logits = model(torch.tensor(ids), cache, DenseDecode())  # (V,)
        for _ in range(steps):
            top = torch.topk(logits, 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            logits = model(torch.tensor([tokens[-1]]), cache, DenseDecode())
    return tokens, margins


# int16 activations move one decode step's logits by 0.6e-4 to 1.8e-4 relative on the default
# model (measured: fused and module paths alike; perplexity change 2.7e-6, bench.quality), so
# the 1e-4 bound holds for fp32 activations and this one for the default int16.
INT16_RELATIVE_TOLERANCE = 5e-4


@pytest.fixture(scope="module")
def fp32_activations_engine():
    """The default model with its quantized kernels on fp32 activations (--activations fp32)."""
    return Engine.load(EngineConfig(model_path=TEST_MODEL, activations="fp32"), TEST_HOME)


def decode_errors(model: Transformer, fp32: Transformer, ids: list[int]) -> list[float]:
    _, want = run(fp32, torch.tensor(ids), [28, 1000, 5])
    _, got = run(model, torch.tensor(ids), [28, 1000, 5])
    return [relative(g, w) for g, w in zip(got, want)]


@pytest.mark.model
def test_default_engine_decodes_quantized(engine, fp32_default):
    assert engine.config.weights == "quantized"
    quantized = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * engine.args.n_layers + 1
    assert {m.qtypes for m in quantized} == {("Q4_1", "Q4_1", "Q4_1"), ("Q4_1",), ("Q4_1", "Q4_1"), ("Q8_0",)}
    if quant.C_SIMD:  # the default activations and the fused blocks run where the library has AVX2
        assert {a for m in quantized for a in m.activations} == {engine.config.activations} == {"int16"}
        assert [b.fused_decode is not None for b in engine.model.layers] == [True] * engine.args.n_layers
    errors = decode_errors(engine.model, fp32_default, engine.chat_ids(GREEDY_PROMPTS[0]))
    assert max(errors) <= INT16_RELATIVE_TOLERANCE, errors


@pytest.mark.model
def test_fp32_activations_decode_within_1e_4_of_fp32(fp32_activations_engine, fp32_default):
    quantized = [m for m in fp32_activations_engine.model.modules() if isinstance(m, QuantLinear)]
    assert {a for m in quantized for a in m.activations} == {"fp32"}
    errors = decode_errors(fp32_activations_engine.model, fp32_default,
                           fp32_activations_engine.chat_ids(GREEDY_PROMPTS[0]))
    assert max(errors) <= RELATIVE_TOLERANCE, errors


@pytest.mark.model
@pytest.mark.parametrize("messages", GREEDY_PROMPTS)
def test_default_greedy_continuations_equal_fp32(engine, fp32_default, messages):
    ids = engine.chat_ids(messages)
    want, margins = greedy(fp32_default, ids, GREEDY_TOKENS)
    got, _ = greedy(engine.model, ids, GREEDY_TOKENS)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"diverged at step {first}, fp32 logit margin there {margins[first]:.2e}"


def test_read_gguf_tensors_agrees_with_gguf_reader(tiny_pair):
    from spotlight.quantized import read_gguf_tensors

    path = tiny_pair[3]
    ours, meta = read_gguf_tensors(path)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert meta["general.architecture"] == "llama"
    assert list(ours) == list(theirs)
    for name, tensor in theirs.items():
        got = ours[name]
        assert (got.tensor_type, got.shape) == (tensor.tensor_type, tuple(int(n) for n in tensor.shape)), name
        assert np.array_equal(got.data, np.asarray(tensor.data).view(np.uint8).reshape(-1)), name


def test_file_that_is_not_gguf_raises_corrupt_tensor(tiny_pair, tmp_path):
    fp32, _, _, path = tiny_pair
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(CorruptTensor, match="not a GGUF file"):
        use_quantized_linear(copy.deepcopy(fp32), junk, fp32.args)
    header = tmp_path / "header.gguf"
    header.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CorruptTensor, match="ends inside its header"):
        use_quantized_linear(copy.deepcopy(fp32), header, fp32.args)


# ------------------------------------------------------------- --quantize q8_0 (Hugging Face models)
Q8_TOLERANCE = 2e-2  # || q8_0 - fp32 || / || fp32 || of logits: Q8_0 rounds each weight to 1/254 of its block's max


def test_quantize_q8_0_writes_gguf_s_bytes():
    from kernels.quant import quantize_q8_0

    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((37, 96)) * rng.uniform(1e-3, 10, (37, 1))).astype(np.float32)  # (F, E)
    weights[3, 32:64] = 0  # an all-zero block: d = 0
    weights[5, :32] = np.linspace(-127, 127, 32, dtype=np.float32) / 2  # ties at .5: rounded away from zero
    qm = quantize_q8_0(weights, "w", chunk_rows=8)  # 8: several chunks and a short last one
    assert (qm.qtype, qm.rows, qm.cols) == ("Q8_0", 37, 96)
    np.testing.assert_array_equal(qm.blocks, quantize(weights, Q.Q8_0))
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        quantize_q8_0(np.zeros((2, 40), np.float32))


@pytest.mark.parametrize("arch", ("llama", "qwen2"))  # qwen2: q/k/v biases
def test_quantize_to_q8_0_decodes_close_to_fp32(arch):
    from conftest import tiny_pair as hf_pair
    from spotlight.quantized import quantize_to_q8_0

    _, fp32 = hf_pair(arch, seed=5)
    model = copy.deepcopy(fp32)
    swap = quantize_to_q8_0(model)
    layers = fp32.args.n_layers
    assert len(swap.swapped) == 4 * layers + 1 and swap.kept_fp32 == ()
    wqkv = model.layers[0].attention.wqkv
    assert isinstance(wqkv, QuantLinear) and wqkv.qtypes == ("Q8_0",)
    np.testing.assert_array_equal(wqkv.parts[0].blocks,
                                  quantize(fp32.layers[0].attention.wqkv.weight.numpy(), Q.Q8_0))
    assert (wqkv.bias is None) == (arch == "llama")
    prompt = torch.arange(3, 30)
    want_prefill, want = run(fp32, prompt, [7, 8, 9])
    got_prefill, got = run(model, prompt, [7, 8, 9])
    errors = [relative(g, w) for g, w in zip([got_prefill] + got, [want_prefill] + want)]
    assert 0 < max(errors) <= Q8_TOLERANCE, errors  # > 0: the weights really changed


def test_engine_config_validates_quantize():
    assert EngineConfig().quantize is None and EngineConfig(quantize="q8_0").quantize == "q8_0"
    with pytest.raises(ValueError, match="quantize must be one of q8_0 or None; got 'q4_0'"):
        EngineConfig(quantize="q4_0")


def test_a_lowered_product_runs_on_bf16_copies_and_adds_the_bias_in_fp32():
    """QuantLinear inside DequantBuffer.lowered(): the dequantised weight and the input rounded to
    bf16, torch's bf16 product, the bias added in fp32 after; outside it, the exact fp32 product."""
    from conftest import tiny_pair as hf_pair
    from spotlight.quantized import DequantBuffer

    _, fp32 = hf_pair("qwen2", seed=6)
    wqkv = copy.deepcopy(fp32).layers[0].attention.wqkv
    parts = [quant.quantize_q8_0(wqkv.weight.detach(), "wqkv")]
    scratch = DequantBuffer(torch.bfloat16)
    linear = QuantLinear(parts, wqkv.bias, scratch)
    weight = torch.from_numpy(dequantize(parts[0].blocks, Q.Q8_0))  # (F, E) fp32
    x = torch.randn(5, weight.shape[1])  # (T, E)
    with torch.inference_mode():
        exact = linear(x)
        with scratch.lowered():
            lowered = linear(x)
        after = linear(x)
    want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float() + wqkv.bias
    assert lowered.dtype == torch.float32 and torch.equal(lowered, want)
    assert torch.equal(exact, torch.nn.functional.linear(x, weight, wqkv.bias)) and torch.equal(after, exact)
    assert 0 < relative(lowered, exact) <= 1e-2, relative(lowered, exact)


def test_dequant_buffer_runs_are_as_few_and_even_as_fit():
    from spotlight.quantized import DequantBuffer

    scratch = DequantBuffer(run_elements=100)
    scratch.register(7, 10)  # 70 weights: fits whole
    assert (scratch.elements, scratch.runs(7, 10)) == (70, [(0, 7)])
    scratch.register(25, 10)  # 250 weights: the buffer stops at 100, 10 rows a run
    assert scratch.elements == 100
    assert scratch.runs(25, 10) == [(0, 8), (8, 16), (16, 25)]
    assert scratch.runs(3, 200) == [(0, 1), (1, 2), (2, 3)]  # a row longer than the buffer: one row a run


@pytest.mark.parametrize("far", (torch.float32, torch.bfloat16))
def test_a_product_in_row_runs_equals_the_whole_product(far):
    """Two parts (as gate and up) with a bias, through a buffer of 6 rows: the runs cross the
    parts' boundary and give the whole product's values (to fp32 rounding: torch's GEMM blocks a
    5-column product differently from a 20-column one)."""
    from spotlight.quantized import DequantBuffer

    rng = np.random.default_rng(4)
    parts = [quant.quantize_q8_0(torch.from_numpy(rng.standard_normal((rows, 64)).astype(np.float32)), name)
             for rows, name in ((11, "gate"), (9, "up"))]
    weight = torch.from_numpy(np.concatenate([dequantize(p.blocks, gguf.GGMLQuantizationType.Q8_0) for p in parts]))
    bias, x = torch.randn(20), torch.randn(5, 64)  # (F,), (T, E)
    whole, small = DequantBuffer(far), DequantBuffer(far, run_elements=6 * 64)
    one, runs = QuantLinear(parts, bias, whole), QuantLinear(parts, bias, small)
    assert (whole.runs(20, 64), small.runs(20, 64)) == ([(0, 20)], [(0, 5), (5, 10), (10, 15), (15, 20)])
    with torch.inference_mode(), whole.lowered(), small.lowered():
        want, got = one(x), runs(x)
    assert got.shape == (5, 20) and small.buffer.numel() == 6 * 64
    reference = torch.nn.functional.linear(x, weight, bias) if far == torch.float32 else \
        torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float() + bias
    assert relative(got, want) <= 1e-6 and relative(got, reference) <= 1e-6, (relative(got, want),
                                                                              relative(got, reference))


def test_far_products_change_only_chunks_past_the_window():
    """A model quantized with far_products bfloat16: a prompt inside its 64-token window gives the
    float32 model's logits bit for bit; a chunk reaching past the window runs lowered (close, not
    equal); a model with float32 far products has no switch."""
    from conftest import tiny_pair as hf_pair

    _, fp32 = hf_pair("qwen2", seed=7, max_position_embeddings=64)
    exact, lowered = copy.deepcopy(fp32), copy.deepcopy(fp32)
    quantize_to_q8_0(exact, far_products=torch.float32)
    quantize_to_q8_0(lowered, far_products=torch.bfloat16)
    assert exact.far_products is None and lowered.far_products is not None
    engines = [Engine(EngineConfig(), model.args, model, None, None, DenseDecode(), 0.0) for model in (exact, lowered)]
    assert [engine.far_products for engine in engines] == ["float32", "bfloat16"]
    window = fp32.args.max_seq_len
    inside, beyond = torch.arange(3, 3 + window - 8), torch.arange(5, 5 + 24)  # 56 tokens, then 24 across the window
    outputs = {}
    for name, model in (("exact", exact), ("lowered", lowered)):
        cache = KVCache(model.args, window + 32)
        with torch.inference_mode():
            outputs[name] = (model(inside, cache, DenseDecode(), all_logits=True),
                             model(beyond, cache, DenseDecode(), all_logits=True))
    assert torch.equal(outputs["lowered"][0], outputs["exact"][0])
    error = relative(outputs["lowered"][1], outputs["exact"][1])
    assert 0 < error <= 2e-2, error


def test_engine_config_validates_far_products():
    from spotlight.quantized import far_dtype

    assert EngineConfig().far_products == "auto"
    assert far_dtype("float32") == torch.float32 and far_dtype("bfloat16") == torch.bfloat16
    assert far_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="far_products must be one of auto, bfloat16, float32; got 'float16'"):
        EngineConfig(far_products="float16")
