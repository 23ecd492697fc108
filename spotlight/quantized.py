"""GGUF weights kept quantized for decode (issue #20): `QuantLinear` and the load-time swap.

Shape legend: T rows of x (tokens), E input features, F output features.

Decode reads every weight once per token, so it is bound by the bytes read: SmolLM2-135M reads
538 MB of fp32 per token, its GGUF ~90 MB of blocks. `use_quantized_linear(model, gguf_path)`
replaces the model's linears (and the tied output projection) with `QuantLinear`s whose one-row
products run kernels.quant.QuantMatVec on the file's blocks, memory-mapped (read_gguf_tensors),
as gpt-fast's quantize.py swaps whole modules. A prefill chunk (T > 1) dequantises the blocks
into one fp32 buffer shared by every QuantLinear (layers run one after another) and calls
F.linear: its values equal gguf's dequantisation bit for bit, so prefill matches the fp32 model.
Past the model's native window a chunk may run these products in bf16 instead (DequantBuffer's
far_dtype, EngineConfig.far_products; the model enters `lowered()` for such chunks).

The names are llama.cpp's (GGUF_PARTS); a fused module of ours (wqkv, w_gate_up) is several GGUF
tensors, kept as separate QuantMatrix row blocks written into one output in one call. NOTE: the
GGUF of a *llama* model stores attn_q / attn_k with rows permuted for llama.cpp's rope layout;
transformers undoes it on load (modeling_gguf_pytorch_utils.LlamaTensorProcessor), and so do we,
moving whole rows (the blocks run along the columns, so a row permutation keeps them intact).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import quant
from kernels.attend_cpu import C_ATTEND_F16, attend_splits, c_attend_fits, new_attend_scratch
from kernels.quant import CorruptTensor, QuantMatrix, QuantMatVec, UnsupportedQuantType

from .config import ModelArgs
from .heap import release_freed_memory
from .model import RMSNorm

log = logging.getLogger("spotlight")

# our module (inside layers.N) -> the GGUF tensors (blk.N.<name>.weight) stacked row-wise, in order
GGUF_PARTS = {
    "attention.wqkv": ("attn_q", "attn_k", "attn_v"),
    "attention.wo": ("attn_output",),
    "feed_forward.w_gate_up": ("ffn_gate", "ffn_up"),
    "feed_forward.w_down": ("ffn_down",),
}
OUTPUT_TENSOR, EMBEDDING_TENSOR = "output.weight", "token_embd.weight"  # a tied model has no output
PERMUTED_ARCHITECTURES = ("llama",)  # general.architecture values whose attn_q / attn_k are permuted


# The most fp32 weights the shared DequantBuffer holds (8 MiB): a larger matrix's prefill product
# runs in row runs of at most this many (Qwen2.5-0.5B's gate/up, 8.7M weights, in 5 runs; its
# down projection in 3), instead of a 35 MB buffer kept for the largest one.
RUN_ELEMENTS = 1 << 21


class DequantBuffer:
    """One fp32 buffer that a prefill chunk's QuantLinear dequantises its weight into, run by run
    (`runs`), sized for the largest registered matrix up to `run_elements` and allocated at the
    first prefill (decode never does).

    `far_dtype` bfloat16 (EngineConfig.far_products): within `lowered()` (the model's forward of a
    chunk past its native window, Transformer.use_far_products) each such product runs on bf16
    copies of the weight (a second reused buffer) and of the input, torch's bf16 GEMM summing in
    fp32, the bias added in fp32 after."""

    def __init__(self, far_dtype: torch.dtype = torch.float32, run_elements: int = RUN_ELEMENTS):
        self.elements = 0  # weights the buffer holds: min(F * E of the largest registered matrix, the bound)
        self.run_elements = run_elements
        self.buffer: torch.Tensor | None = None
        self.far_dtype = far_dtype
        self.low: torch.Tensor | None = None  # the bf16 weight buffer, made at the first lowered product
        self.lowering = False  # inside lowered()

    def register(self, rows: int, cols: int) -> None:
        """Make room for a (rows, cols) matrix, or for its row runs where it exceeds run_elements."""
        self.elements = max(self.elements, min(rows * cols, max(self.run_elements, cols)))

    def runs(self, rows: int, cols: int) -> list[tuple[int, int]]:
        """[start, end) runs covering the rows of a (rows, cols) matrix, each fitting the buffer,
        as few and as even as possible (one run where the whole matrix fits)."""
        n = -(-rows // max(1, self.elements // cols))
        return [(rows * i // n, rows * (i + 1) // n) for i in range(n)]

    def view(self, rows: int, cols: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(max(self.elements, cols), dtype=torch.float32)
        return self.buffer[: rows * cols].view(rows, cols)  # (F, E)

    def low_view(self, rows: int, cols: int) -> torch.Tensor:
        if self.low is None:
            self.low = torch.empty(max(self.elements, cols), dtype=self.far_dtype)
        return self.low[: rows * cols].view(rows, cols)  # (F, E)

    def far_switch(self):
        """What Transformer.use_far_products takes: `lowered`, or None where far_dtype is float32."""
        return None if self.far_dtype == torch.float32 else self.lowered

    @contextlib.contextmanager
    def lowered(self):
        """Products in far_dtype while inside (a no-op for float32)."""
        self.lowering = self.far_dtype != torch.float32
        try:
            yield
        finally:
            self.lowering = False


def far_dtype(far_products: str) -> torch.dtype:
    """The dtype EngineConfig.far_products resolves to on this machine: "auto" is bfloat16 where the
    CPU multiplies bf16 natively (AVX512-BF16 or AMX, as torch reports), else float32."""
    if far_products == "auto":
        checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
        return torch.bfloat16 if any(check is not None and check() for check in checks) else torch.float32
    return getattr(torch, far_products)


class QuantLinear(nn.Module):
    """y (T, F) = x (T, E) @ W.T + bias with W the row-wise stack of GGUF QuantMatrix parts.

    One-row fp32 CPU calls (a decode step, the last prefill position) run the quantized kernel of
    each part into its rows of one output. Other calls use `dense` (an fp32 weight the model keeps
    anyway, e.g. the tied embedding) or the parts dequantised into the shared DequantBuffer, in
    the row runs it fits (DequantBuffer.runs)."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None, scratch: DequantBuffer,
                 dense: torch.Tensor | None = None, chunked: bool = False, activations: str = "fp32"):
        super().__init__()
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        assert all(p.cols == self.in_features for p in parts), [(p.name, p.cols) for p in parts]
        self.parts = parts
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)
        bias_np = None if bias is None else self.bias.numpy()
        offsets = np.cumsum([0] + [p.rows for p in parts])
        self._offsets = [int(o) for o in offsets[:-1]]  # the first row of each part in W
        # each part's product writes rows [start, end) of the output; bias sliced the same way
        self._calls = [(QuantMatVec(p, None if bias_np is None else bias_np[s:e], activations=activations),
                        int(s), int(e)) for p, s, e in zip(parts, offsets[:-1], offsets[1:])]
        self._c_only = all(bound.backend == "c" for bound, _, _ in self._calls)
        self.dense = dense
        self.scratch = scratch
        # chunked: a many-row call runs in row runs that fit the buffer others sized, without
        # registering its own size (the output projection, 113 MB of fp32 for SmolLM2, is needed
        # for T > 1 only by all_logits calls)
        self.chunked = chunked and dense is None
        assert not self.chunked or len(parts) == 1, "a chunked QuantLinear has one part"
        if dense is None and not self.chunked:
            scratch.register(self.out_features, self.in_features)

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(p.qtype for p in self.parts)

    @property
    def activations(self) -> tuple[str, ...]:
        """What each part's one-row product runs with: "int16" or "fp32" (kernels.quant.ACTIVATIONS)."""
        return tuple(bound.activations for bound, _, _ in self._calls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu" \
                and not torch.is_grad_enabled():
            return self._one_row(x.contiguous())
        if self.dense is not None and not self.scratch.lowering:
            return F.linear(x, self.dense, self.bias)
        return self._in_row_runs(x)

    def _in_row_runs(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, E) @ W.T + bias over the scratch's row runs of W (one run, written straight to the
        result, where W fits the buffer). Inside `lowered()`, x and each run of W are rounded to
        the scratch's far_dtype, torch's GEMM sums in fp32, and the bias is added in fp32 after."""
        runs = self.scratch.runs(self.out_features, self.in_features)
        xs = x.to(self.scratch.far_dtype) if self.scratch.lowering else x
        if len(runs) == 1:
            return self._run_product(xs, 0, self.out_features)
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)  # (T, F)
        for start, end in runs:
            out[..., start:end] = self._run_product(xs, start, end)
        return out

    def _run_product(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """x (T, E) @ W[start:end].T + bias[start:end] -> (T, end - start) fp32; x already in far_dtype when lowering."""
        weight, bias = self._weight_rows(start, end), None if self.bias is None else self.bias[start:end]
        if not self.scratch.lowering:
            return F.linear(x, weight, bias)
        low = self.scratch.low_view(end - start, self.in_features)  # (F', E)
        low.copy_(weight)
        out = F.linear(x, low).float()  # (T, F')
        return out if bias is None else out.add_(bias)

    def _weight_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of W (F, E) in fp32: a view of `dense`, or dequantised from the parts
        they fall in into the shared buffer (valid until its next use), on torch's threads, which
        run the product that follows (the kernel threads may be fewer)."""
        if self.dense is not None:
            return self.dense[start:end]
        weight = self.scratch.view(end - start, self.in_features)  # (F', E)
        workers = torch.get_num_threads()
        for part, offset in zip(self.parts, self._offsets):
            first, last = max(start, offset), min(end, offset + part.rows)
            if first < last:
                quant.dequantize_into(part, weight[first - start:last - start], first - offset, last - offset,
                                      workers=workers)
        return weight

    def _one_row(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1, self.out_features)  # (1, F)
        if self._c_only:  # raw addresses: the shapes were checked when the parts were bound
            x_ptr, out_ptr = x.data_ptr(), out.data_ptr()
            for bound, start, _ in self._calls:
                bound.call(x_ptr, out_ptr + 4 * start)  # 4: bytes per float32
            return out
        xs, dest = x.numpy().reshape(-1), out.numpy().reshape(-1)  # (E,), (F,)
        for bound, start, end in self._calls:
            bound(xs, dest[start:end])
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={self.qtypes}"


class FusedDecode:
    """A Block's one-token decode step around its attention in two compiled calls
    (kernels.quant.decode_head: norm, q/k/v products, rope; decode_tail: output product,
    residual, norm, MLP, residual), instead of ~40 framework operations and 7 product calls per
    layer. The arithmetic is the modules' (spotlight/model.py Block), with sums in quant.c's order.
    Every buffer is allocated here, once per block; a step's outputs are views of them, valid until
    the block's next step. `eligible(block)` says whether a block can run so: its four linears are
    QuantLinears on the C kernels and its norms fp32."""

    def __init__(self, block):
        attention, mlp = block.attention, block.feed_forward
        self.heads, self.kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        self.dim, self.width = attention.wqkv.in_features, mlp.width
        self.attn_dim = attention.wo.in_features
        linears = (attention.wqkv, attention.wo, mlp.w_gate_up, mlp.w_down)
        self._linears = linears  # their blocks and biases stay alive while the parts point at them
        self._parts = [self._part_array(m) for m in linears]
        self._norms = (block.attention_norm, block.ffn_norm)
        self.qkv = torch.empty(attention.wqkv.out_features)  # ((H + 2 Hkv) * D,) q, k, v of the step
        self.h = torch.empty(self.dim)  # (E,) the normed input, then each product's output
        self.ff = torch.empty(2 * self.width)  # (2 F,) gate, up
        self.act = torch.empty(self.width)  # (F,) silu(gate) * up
        self.out = torch.empty(1, self.dim)  # (1, E) the block's output
        self.scratch = np.empty(quant.scratch_bytes(max(self.dim, self.width, self.attn_dim)), np.uint8)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self._q = self.qkv[:q].view(self.heads, 1, self.head_dim)  # (H, 1, D)
        self._k = self.qkv[q:q + kv].view(self.kv_heads, 1, self.head_dim)  # (Hkv, 1, D)
        self._v = self.qkv[q + kv:].view(self.kv_heads, 1, self.head_dim)  # (Hkv, 1, D)

    @staticmethod
    def eligible(block) -> bool:
        attention, mlp = block.attention, block.feed_forward
        linears = (attention.wqkv, attention.wo, mlp.w_gate_up, mlp.w_down)
        return quant.C_FUSED and all(
            isinstance(m, QuantLinear) and m._c_only and not any(b._scalar for b, _, _ in m._calls) for m in linears
        ) and all(isinstance(n, RMSNorm) and n.weight.dtype == torch.float32 and n.weight.device.type == "cpu"
                  for n in (block.attention_norm, block.ffn_norm)) and \
            attention.wqkv.out_features == (attention.n_heads + 2 * attention.n_kv_heads) * attention.head_dim

    @staticmethod
    def _part_array(linear: "QuantLinear"):
        parts = [bound.part() for bound, _, _ in linear._calls]
        return (quant.QuantPart * len(parts))(*parts), len(parts)

    def block(self) -> "quant.QuantBlock":
        """This block as quant.c's quant_block (FusedStep): its norms, parts and buffers."""
        (qkv, n_qkv), (wo, n_wo), (gate_up, n_gate_up), (down, n_down) = self._parts
        attention_norm, ffn_norm = self._norms
        return quant.QuantBlock(attention_norm.weight.data_ptr(), ffn_norm.weight.data_ptr(), qkv, wo, gate_up, down,
                                self.h.data_ptr(), self.qkv.data_ptr(), self.ff.data_ptr(), self.act.data_ptr(),
                                self.out.data_ptr(), self.scratch.ctypes.data, attention_norm.eps, ffn_norm.eps,
                                n_qkv, n_wo, n_gate_up, n_down)

    def accepts(self, x: torch.Tensor) -> bool:
        """One token, fp32, on the CPU, no autograd: what the compiled calls compute."""
        return x.shape == self.out.shape and x.dtype == torch.float32 and x.device.type == "cpu" \
            and x.is_contiguous() and not torch.is_grad_enabled()

    def head(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x (1, E), cos, sin (1, D) -> post-RoPE q (H, 1, D), k, v (Hkv, 1, D)."""
        cos, sin = cos.contiguous(), sin.contiguous()
        (qkv, n), norm = self._parts[0], self._norms[0]
        quant.decode_head(x.data_ptr(), self.dim, norm.weight.data_ptr(), norm.eps, qkv, n,
                          self.heads + self.kv_heads, self.head_dim, cos.data_ptr(), sin.data_ptr(),
                          self.h.data_ptr(), self.scratch.ctypes.data, self.qkv.data_ptr())
        return self._q, self._k, self._v

    def tail(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x (1, E) the block's input, attn (H, 1, D) its attention output -> the block's output (1, E)."""
        attn = attn.contiguous()
        _, (wo, n_wo), (gate_up, n_gate_up), (down, n_down) = self._parts  # wqkv, wo, gate_up, down
        norm = self._norms[1]
        quant.decode_tail(x.data_ptr(), self.dim, attn.data_ptr(), self.attn_dim, wo, n_wo, norm.weight.data_ptr(),
                          norm.eps, gate_up, n_gate_up, self.width, down, n_down, self.h.data_ptr(),
                          self.ff.data_ptr(), self.act.data_ptr(), self.scratch.ctypes.data, self.out.data_ptr())
        return self.out


def use_fused_decode(model: nn.Module) -> int:
    """Give every eligible block of `model` a FusedDecode (FusedDecode.eligible) and, when all of
    them have one, the model a FusedStep (FusedStep.eligible); returns how many blocks."""
    fused = 0
    for block in model.layers:
        if FusedDecode.eligible(block):
            block.use_fused_decode(FusedDecode(block))
            fused += 1
    model.use_fused_step(FusedStep(model) if FusedStep.eligible(model) else None)
    return fused


class FusedStep:
    """Every block of a one-token step in one compiled call (kernels.quant.decode_step), for a
    step that attends to all cached rows in every layer (DecodePolicy.dense_step): per layer,
    its FusedDecode's head, the new key and value written into the cache, attend.c's attention
    over rows [0, n), its FusedDecode's tail. The arithmetic is the per-layer calls' bit for bit
    (tests/test_quantized.py); what goes is the Python between the layers (the cache write, the
    policy, the attention call's checks), about 1.5 ms of a Qwen2.5-0.5B step (docs/DECISIONS.md).
    Each layer's q stays in its FusedDecode's buffer until the block's next step (`query`)."""

    def __init__(self, model: nn.Module):
        self.decoders = [block.fused_decode for block in model.layers]
        first = self.decoders[0]
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.dim, self.width = first.dim, first.width
        self._blocks = (quant.QuantBlock * len(self.decoders))(*(d.block() for d in self.decoders))
        self.attn = torch.empty(self.heads, self.head_dim)  # (H, D) a layer's attention output
        self.scratch = new_attend_scratch(self.heads, self.kv_heads, self.head_dim)
        self.out = self.decoders[-1].out  # (1, E) the last block's output
        self._coded = None  # (the key coders' ids, the coders, their specs' array, (Hkv, W) words) of _key_codes

    @staticmethod
    def eligible(model: nn.Module) -> bool:
        """Every block has a FusedDecode of one geometry, and the library has the whole step with
        attend.c taking the head geometry."""
        decoders = [block.fused_decode for block in model.layers]
        if not quant.C_STEP or not decoders or any(d is None for d in decoders):
            return False
        shapes = {(d.heads, d.kv_heads, d.head_dim, d.dim, d.width, d.attn_dim) for d in decoders}
        heads, kv_heads, head_dim, _, _, attn_dim = next(iter(shapes))
        return len(shapes) == 1 and attn_dim == heads * head_dim and c_attend_fits(heads, kv_heads, head_dim)

    def accepts(self, x: torch.Tensor, cache) -> bool:
        """One fp32 token (FusedDecode.accepts) and a CPU cache of all the layers, fp32 or fp16
        (F16C built in), each row head_dim contiguous values."""
        k, v = cache.k, cache.v
        return self.decoders[0].accepts(x) and k.device.type == "cpu" and k.shape == v.shape \
            and k.shape[0] == len(self.decoders) and k.shape[1:2] + k.shape[3:] == (self.kv_heads, self.head_dim) \
            and (k.dtype == torch.float32 or (k.dtype == torch.float16 and C_ATTEND_F16)) and v.dtype == k.dtype \
            and k.is_contiguous() and v.is_contiguous()

    def codes(self, coders, cache) -> bool:
        """Whether this step can also write the keys' codes with `coders` (DecodePolicy.step_key_coders:
        one C-built kernels.MlpCoder per layer, or none) into `cache`'s host codes."""
        if not coders:
            return True
        codes = cache.codes
        return quant.C_CODED_STEP and len(coders) == len(self.decoders) and isinstance(codes, np.ndarray) \
            and codes.dtype == np.uint64 and codes.flags.c_contiguous \
            and all(c.native and c.x_shape == (self.kv_heads, self.head_dim) and c.shape[1] == codes.shape[2]
                    for c in coders)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, coders=()) -> torch.Tensor:
        """x (1, E) the token at position n - 1 = cache.length, cos, sin (1, D) -> the last block's
        output (1, E); every layer's key and value are written at row n - 1 of the cache, and with
        `coders` (one per layer, `codes` checked) the key's codes too, as on_new_tokens writes them."""
        cos, sin = cos.contiguous(), sin.contiguous()
        row = cache.length
        _, splits = attend_splits(row + 1, self.scratch)
        k, v, buf = cache.k, cache.v, self.scratch
        quant.decode_step(self._blocks, len(self.decoders), x.data_ptr(), self.dim, self.heads, self.kv_heads,
                          self.head_dim, self.width, cos.data_ptr(), sin.data_ptr(), k.data_ptr(), v.data_ptr(),
                          k.stride(0), k.stride(1), row, k.dtype == torch.float16, splits, buf.scaled_q.ctypes.data,
                          buf.stats.ctypes.data, buf.acc.ctypes.data, self.attn.data_ptr(),
                          self._key_codes(coders, cache.codes) if coders else None)
        return self.out

    def _key_codes(self, coders, codes: np.ndarray) -> tuple:
        """decode_step's key_codes for `coders` writing into `codes` (L, Hkv, W, Ncap); the specs'
        array and the words' buffer are made once per set of coders."""
        if self._coded is None or self._coded[0] != tuple(map(id, coders)):
            specs = (ctypes.c_int64 * len(coders))(*(c.spec_address for c in coders))
            words = np.empty(coders[0].shape, np.uint64)  # (Hkv, W) a layer's new key codes
            self._coded = (tuple(map(id, coders)), coders, specs, words)  # the coders kept alive with their specs
        _, _, specs, words = self._coded
        return (ctypes.addressof(specs), codes.ctypes.data, codes.shape[2], codes.shape[3], words.ctypes.data)

    def query(self, layer: int) -> torch.Tensor:
        """The post-RoPE q (H, 1, D) of `layer` in the last step."""
        return self.decoders[layer]._q


@dataclass(frozen=True)
class QuantizedSwap:
    """What use_quantized_linear did: modules swapped, modules kept fp32 (with why), bytes read."""

    swapped: tuple[str, ...]
    kept_fp32: tuple[str, ...]  # "<module>: <reason>"
    quantized_bytes: int


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's rope permutation of a (rows, E) attn_q / attn_k: new row r is
    stored row order[r] (transformers' _reverse_permute_weights applied to row indices)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(2, 1).reshape(rows)  # (rows,)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, shaped like gguf.ReaderTensor for QuantMatrix.from_gguf_tensor."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ne0 (cols) first, as GGUF lists it
    data: np.ndarray  # uint8, the tensor's bytes inside the file's memory map


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one scalar; 8 string, 9 array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # GGUF's tensor-data alignment unless general.alignment says otherwise


class _Cursor:
    """Little-endian reads from a bytes-like header, raising CorruptTensor past its end."""

    def __init__(self, data, path: Path):
        self.data, self.at, self.path = data, 0, path

    def read(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.data):
            raise CorruptTensor(f"GGUF {str(self.path)!r} ends inside its header; the file is truncated, re-download it")
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.read("Q")
        self.at += n
        return bytes(self.data[self.at - n:self.at]).decode("utf-8", "replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.read("I"), self.read("Q")
            if item in _SCALAR:  # skipped whole: only scalar and string metadata is read here
                self.at += count * struct.calcsize(_SCALAR[item])
                return None
            for _ in range(count):  # e.g. the vocabulary's strings
                self.value(item)
            return None
        return self.read(_SCALAR[kind])


def read_gguf_tensors(path: Path) -> tuple[dict[str, GGUFTensor], dict]:
    """(tensors by name, scalar metadata) of a GGUF file, the tensors as views of one memory map.

    Why not gguf.GGUFReader: it makes numpy views of every metadata item, ~7-12 s for SmolLM2's
    49K-token vocabulary on this machine; this reads the same header in well under a second.
    Raises CorruptTensor for a file that is not GGUF, truncated, or whose tensors overrun it."""
    import gguf

    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:
        raise CorruptTensor(f"cannot read GGUF {str(path)!r} ({error}); re-download it") from error
    cursor = _Cursor(data, path)
    if bytes(data[:4]) != b"GGUF":
        raise CorruptTensor(f"{str(path)!r} is not a GGUF file (no GGUF magic); the file is damaged or truncated")
    cursor.at = 4
    _version, n_tensors, n_kv = cursor.read("IQQ")
    meta = {}
    for _ in range(n_kv):
        key = cursor.string()
        meta[key] = cursor.value(cursor.read("I"))
    infos = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = tuple(cursor.read("Q") for _ in range(cursor.read("I")))
        infos.append((name, dims, cursor.read("I"), cursor.read("Q")))
    alignment = int(meta.get("general.alignment") or DEFAULT_ALIGNMENT)
    start = -(-cursor.at // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            qtype = type_id  # named by QuantMatrix as "id N (not a ggml type)"
        values, block_bytes = gguf.GGML_QUANT_SIZES.get(qtype, (1, 0))
        nbytes = int(np.prod(dims)) // values * block_bytes
        begin = start + offset
        if begin + nbytes > len(data):
            raise CorruptTensor(f"GGUF tensor {name!r} runs past the end of {str(path)!r}; the file is truncated, "
                                "re-download it")
        tensors[name] = GGUFTensor(name, qtype, dims, data[begin:begin + nbytes])
    return tensors, meta


def _matrix(tensors: dict, name: str, rows: int, cols: int, order: np.ndarray | None = None) -> QuantMatrix:
    if name not in tensors:
        raise CorruptTensor(f"GGUF tensor {name!r} is missing; the file does not belong to this model")
    qm = QuantMatrix.from_gguf_tensor(tensors[name])  # UnsupportedQuantType / CorruptTensor name it
    if (qm.rows, qm.cols) != (rows, cols):
        raise CorruptTensor(f"GGUF tensor {name!r} is ({qm.rows}, {qm.cols}) but the model needs ({rows}, {cols}); "
                            "the file does not belong to this model's config")
    if order is not None:  # a copy with rows reordered (attn_q / attn_k: small)
        qm = QuantMatrix(qm.name, qm.qtype, qm.rows, qm.cols, np.ascontiguousarray(qm.blocks[order]))
    return qm


def _layer_parts(tensors: dict, args: ModelArgs, layer: int, module: str, permuted: bool) -> list[QuantMatrix]:
    D, E = args.head_dim, args.dim
    rows = {"attn_q": args.n_heads * D, "attn_k": args.n_kv_heads * D, "attn_v": args.n_kv_heads * D,
            "attn_output": E, "ffn_gate": args.intermediate_size, "ffn_up": args.intermediate_size,
            "ffn_down": E}
    cols = {"attn_output": args.n_heads * D, "ffn_down": args.intermediate_size}
    heads = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads}
    parts = []
    for short in GGUF_PARTS[module]:
        order = unpermute_rows(rows[short], heads[short]) if permuted and short in heads else None
        parts.append(_matrix(tensors, f"blk.{layer}.{short}.weight", rows[short], cols.get(short, E), order))
    return parts


def use_quantized_linear(model: nn.Module, gguf_path: Path, args: ModelArgs,
                         activations: str = "fp32") -> QuantizedSwap:
    """Swap the linears of `model` (built from this GGUF's fp32 dequantisation) for QuantLinears
    reading the GGUF's blocks, in place. A module whose tensors have a type without a kernel stays
    fp32, with a logged notice naming the type. Raises CorruptTensor for a missing, truncated or
    mis-shaped tensor."""
    tensors, meta = read_gguf_tensors(Path(gguf_path))
    permuted = meta.get("general.architecture") in PERMUTED_ARCHITECTURES
    scratch = DequantBuffer()
    swapped, kept, nbytes = [], [], 0
    targets = [(f"layers.{i}.{m}", lambda i=i, m=m: _layer_parts(tensors, args, i, m, permuted), None)
               for i in range(args.n_layers) for m in GGUF_PARTS]
    tied = OUTPUT_TENSOR not in tensors  # llama.cpp writes no output tensor when it is the embedding
    dense_output = model.tok_embeddings.weight if tied else None  # kept anyway for the lookup
    output_name = EMBEDDING_TENSOR if tied else OUTPUT_TENSOR
    targets.append(("output", lambda: [_matrix(tensors, output_name, args.vocab_size, args.dim)], dense_output))
    for path, parts_of, dense in targets:
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        try:
            parts = parts_of()
        except UnsupportedQuantType as error:
            kept.append(f"{path}: {error.qtype}")
            log.warning("%s stays fp32: GGUF tensor %r is %s, which has no quantized kernel", path, error.tensor,
                        error.qtype)
            continue
        setattr(parent, attr, QuantLinear(parts, old.bias, scratch, dense, activations=activations))
        swapped.append(path)
        nbytes += sum(p.nbytes for p in parts)
    release_freed_memory()
    return QuantizedSwap(tuple(swapped), tuple(kept), nbytes)


class QuantEmbedding(nn.Module):
    """nn.Embedding over GGUF blocks: a lookup dequantises only the looked-up rows (their blocks
    gathered, then kernels.quant.dequantize_into: gguf's values bit for bit).

    `weight` is an empty (0,) fp32 tensor: it carries the dtype and device that callers read off
    `model.tok_embeddings.weight` (KVCache dtype, rope tables); the values live in `matrix`."""

    def __init__(self, matrix: QuantMatrix):
        super().__init__()
        self.matrix = matrix
        self.num_embeddings, self.embedding_dim = matrix.rows, matrix.cols
        self.register_buffer("weight", torch.empty(0), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1).cpu().numpy()  # (T,)
        qm = self.matrix
        out = torch.empty(ids.size, qm.cols)  # (T, E)
        if ids.size:
            if ids.min() < 0 or ids.max() >= self.num_embeddings:
                raise IndexError(f"token id outside the vocabulary [0, {self.num_embeddings})")
            quant.dequantize_into(QuantMatrix(qm.name, qm.qtype, ids.size, qm.cols, qm.blocks[ids]), out)
        return out.reshape(*tokens.shape, qm.cols)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.matrix.qtype}"


def _fp32_tensor(tensors: dict, name: str, order: np.ndarray | None = None) -> torch.Tensor:
    """A GGUF tensor of any type gguf can dequantise (F32, F16, BF16, every block type), as an
    fp32 torch tensor in our (rows, cols) layout; rows reordered by `order`."""
    import gguf

    if name not in tensors:
        raise CorruptTensor(f"GGUF tensor {name!r} is missing; the file does not belong to this model")
    tensor = tensors[name]
    shape = tuple(reversed(tensor.shape))  # GGUF lists ne0 (cols) first
    try:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = tensor.data.reshape(-1, shape[-1] // values * block_bytes)  # (rows, bytes per row)
        weights = gguf.quants.dequantize(rows, qtype).reshape(shape).astype(np.float32, copy=False)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise CorruptTensor(f"GGUF tensor {name!r} ({tensor.tensor_type}) cannot be read ({error}); "
                            "the file is damaged or of a type this version cannot read") from error
    if order is not None:
        weights = weights[order]
    return torch.from_numpy(np.array(weights, np.float32))  # a copy: the map is read-only


def _layer_dense(tensors: dict, args: ModelArgs, layer: int, module: str, permuted: bool,
                 suffix: str = "weight") -> torch.Tensor | None:
    """The fp32 stack of a module's GGUF tensors (`suffix` "weight" or "bias"); None when the
    file has no such bias."""
    rows = {"attn_q": args.n_heads * args.head_dim, "attn_k": args.n_kv_heads * args.head_dim}
    heads = {"attn_q": args.n_heads, "attn_k": args.n_kv_heads}
    names = [f"blk.{layer}.{short}.{suffix}" for short in GGUF_PARTS[module]]
    if suffix == "bias" and not all(name in tensors for name in names):
        return None
    parts = [_fp32_tensor(tensors, name, unpermute_rows(rows[short], heads[short])
                          if permuted and short in heads else None)
             for short, name in zip(GGUF_PARTS[module], names)]
    return torch.cat(parts)


def build_quantized_model(gguf_path: Path, args: ModelArgs, activations: str = "fp32",
                          far_products: torch.dtype = torch.float32) -> tuple[nn.Module, QuantizedSwap]:
    """The model straight from the GGUF, no fp32 copy of its weights: linears are QuantLinears on
    the file's memory-mapped blocks, the token embedding a QuantEmbedding (the tied output
    projection reads the same blocks), norms and biases fp32 from the file. A tensor whose type
    has no kernel is dequantised by gguf into an fp32 module, with a logged notice naming the type.

    Prefill (T > 1) dequantises each layer's matrices into one reused buffer (the largest layer
    matrix: 7 MB for SmolLM2); the output projection, needed for T > 1 only by all_logits calls,
    runs in row runs of that buffer. Raises CorruptTensor for a missing, truncated or mis-shaped
    tensor. `far_products` bfloat16: the layers' products of a chunk past the model's window run in
    bf16 (DequantBuffer, Transformer.use_far_products)."""
    from .model import Transformer, rope_inv_freq
    from .onerow import OneRowLinear

    tensors, meta = read_gguf_tensors(Path(gguf_path))
    permuted = meta.get("general.architecture") in PERMUTED_ARCHITECTURES
    with torch.device("meta"):
        model = Transformer(args)
    scratch = DequantBuffer(far_products)
    swapped, kept, nbytes = [], [], 0

    def fp32_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
        with torch.device("meta"):
            linear = OneRowLinear(weight.shape[1], weight.shape[0], bias=bias is not None)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        return linear

    def notice(path: str, error: UnsupportedQuantType) -> None:
        kept.append(f"{path}: {error.qtype}")
        log.warning("%s stays fp32: GGUF tensor %r is %s, which has no quantized kernel", path, error.tensor,
                    error.qtype)

    for i, block in enumerate(model.layers):
        block.attention_norm.weight = nn.Parameter(_fp32_tensor(tensors, f"blk.{i}.attn_norm.weight"), False)
        block.ffn_norm.weight = nn.Parameter(_fp32_tensor(tensors, f"blk.{i}.ffn_norm.weight"), False)
        for module in GGUF_PARTS:
            parent_name, _, attr = module.rpartition(".")
            parent = block.get_submodule(parent_name)
            bias = _layer_dense(tensors, args, i, module, permuted, "bias")
            try:
                parts = _layer_parts(tensors, args, i, module, permuted)
            except UnsupportedQuantType as error:
                notice(f"layers.{i}.{module}", error)
                setattr(parent, attr, fp32_linear(_layer_dense(tensors, args, i, module, permuted), bias))
                continue
            setattr(parent, attr, QuantLinear(parts, bias, scratch, activations=activations))
            swapped.append(f"layers.{i}.{module}")
            nbytes += sum(p.nbytes for p in parts)
    model.norm.weight = nn.Parameter(_fp32_tensor(tensors, "output_norm.weight"), False)
    try:
        embedding = _matrix(tensors, EMBEDDING_TENSOR, args.vocab_size, args.dim)
        model.tok_embeddings = QuantEmbedding(embedding)
    except UnsupportedQuantType as error:
        notice("tok_embeddings", error)
        embedding = None
        model.tok_embeddings = nn.Embedding.from_pretrained(_fp32_tensor(tensors, EMBEDDING_TENSOR), freeze=True)
    tied = OUTPUT_TENSOR not in tensors  # llama.cpp writes no output tensor when it is the embedding
    try:
        output = embedding if tied and embedding is not None else _matrix(
            tensors, EMBEDDING_TENSOR if tied else OUTPUT_TENSOR, args.vocab_size, args.dim)
        model.output = QuantLinear([output], None, scratch, chunked=True, activations=activations)
        swapped.append("output")
        nbytes += output.nbytes
    except UnsupportedQuantType as error:
        notice("output", error)
        weight = model.tok_embeddings.weight if tied else _fp32_tensor(tensors, OUTPUT_TENSOR)
        model.output = fp32_linear(weight, None)
    model.inv_freq = rope_inv_freq(args)
    model.use_far_products(scratch.far_switch())
    left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"GGUF model built with tensors left unloaded: {left[:5]}"
    return model.eval().requires_grad_(False), QuantizedSwap(tuple(swapped), tuple(kept), nbytes)


QUANTIZE_MODULES = ("attention.wqkv", "attention.wo", "feed_forward.w_gate_up", "feed_forward.w_down")


def quantize_to_q8_0(model: nn.Module, activations: str = "fp32",
                     far_products: torch.dtype = torch.float32) -> QuantizedSwap:
    """`--quantize q8_0` for a Hugging Face model: every layer linear and the output projection
    quantized at load into Q8_0 blocks (kernels.quant.quantize_q8_0, gguf's own bytes), in place.
    Decode reads the blocks with the same kernels as a GGUF's (~27 % of the fp32 bytes); prefill
    dequantises into one shared buffer. A tied output keeps using the fp32 embedding (kept anyway
    for the lookup) in prefill. A matrix whose width is not a multiple of 32 stays fp32.
    `far_products`: as build_quantized_model's."""
    scratch = DequantBuffer(far_products)
    swapped, kept, nbytes = [], [], 0
    targets = [f"layers.{i}.{m}" for i in range(len(model.layers)) for m in QUANTIZE_MODULES] + ["output"]
    tied = model.output.weight is model.tok_embeddings.weight
    for path in targets:
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        try:
            matrix = quant.quantize_q8_0(old.weight.detach(), path)
        except ValueError as error:
            kept.append(f"{path}: {error}")
            log.warning("%s stays fp32: %s", path, error)
            continue
        dense = old.weight.detach() if path == "output" and tied else None
        setattr(parent, attr, QuantLinear([matrix], old.bias, scratch, dense, activations=activations))
        swapped.append(path)
        nbytes += matrix.nbytes
    model.use_far_products(scratch.far_switch())
    release_freed_memory()
    return QuantizedSwap(tuple(swapped), tuple(kept), nbytes)
