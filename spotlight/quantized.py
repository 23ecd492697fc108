"""GGUF weights kept quantized for decode (issue #20): `QuantLinear` and the load-time swap.

Shape legend: T rows of x (tokens), E input features, F output features.

Decode reads every weight once per token, so it is bound by the bytes read: SmolLM2-135M reads
538 MB of fp32 per token, its GGUF ~90 MB of blocks. `use_quantized_linear(model, gguf_path)`
replaces the model's linears (and the tied output projection) with `QuantLinear`s whose one-row
products run kernels.quant.QuantMatVec on the file's blocks, memory-mapped by gguf.GGUFReader,
as gpt-fast's quantize.py swaps whole modules. A prefill chunk (T > 1) dequantises the blocks
into one fp32 buffer shared by every QuantLinear (layers run one after another) and calls
F.linear: its values equal gguf's dequantisation bit for bit, so prefill matches the fp32 model.

The names are llama.cpp's (GGUF_PARTS); a fused module of ours (wqkv, w_gate_up) is several GGUF
tensors, kept as separate QuantMatrix row blocks written into one output in one call. NOTE: the
GGUF of a *llama* model stores attn_q / attn_k with rows permuted for llama.cpp's rope layout;
transformers undoes it on load (modeling_gguf_pytorch_utils.LlamaTensorProcessor), and so do we,
moving whole rows (the blocks run along the columns, so a row permutation keeps them intact).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels import quant
from kernels.quant import CorruptTensor, QuantMatrix, QuantMatVec, UnsupportedQuantType

from .config import ModelArgs

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


class DequantBuffer:
    """One fp32 buffer that a prefill chunk's QuantLinear dequantises its weight into, sized for
    the largest matrix that needs it and allocated at the first prefill (decode never does)."""

    def __init__(self):
        self.elements = 0  # F * E of the largest registered matrix
        self.buffer: torch.Tensor | None = None

    def register(self, rows: int, cols: int) -> None:
        self.elements = max(self.elements, rows * cols)

    def view(self, rows: int, cols: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.elements, dtype=torch.float32)
        return self.buffer[: rows * cols].view(rows, cols)  # (F, E)


class QuantLinear(nn.Module):
    """y (T, F) = x (T, E) @ W.T + bias with W the row-wise stack of GGUF QuantMatrix parts.

    One-row fp32 CPU calls (a decode step, the last prefill position) run the quantized kernel of
    each part into its rows of one output. Other calls use `dense` (an fp32 weight the model keeps
    anyway, e.g. the tied embedding) or the parts dequantised into the shared DequantBuffer."""

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None, scratch: DequantBuffer,
                 dense: torch.Tensor | None = None):
        super().__init__()
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        assert all(p.cols == self.in_features for p in parts), [(p.name, p.cols) for p in parts]
        self.parts = parts
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)
        bias_np = None if bias is None else self.bias.numpy()
        offsets = np.cumsum([0] + [p.rows for p in parts])
        # each part's product writes rows [start, end) of the output; bias sliced the same way
        self._calls = [(QuantMatVec(p, None if bias_np is None else bias_np[s:e]), int(s), int(e))
                       for p, s, e in zip(parts, offsets[:-1], offsets[1:])]
        self._c_only = all(bound.backend == "c" for bound, _, _ in self._calls)
        self.dense = dense
        self.scratch = scratch
        if dense is None:
            scratch.register(self.out_features, self.in_features)

    @property
    def qtypes(self) -> tuple[str, ...]:
        return tuple(p.qtype for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.float32 and x.device.type == "cpu" \
                and not torch.is_grad_enabled():
            return self._one_row(x.contiguous())
        return F.linear(x, self._dense_weight(), self.bias)

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

    def _dense_weight(self) -> torch.Tensor:
        if self.dense is not None:
            return self.dense
        weight = self.scratch.view(self.out_features, self.in_features)  # (F, E)
        start = 0
        for part in self.parts:
            quant.dequantize_into(part, weight[start:start + part.rows])
            start += part.rows
        return weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={self.qtypes}"


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


def open_gguf(path: Path):
    """gguf.GGUFReader on `path` (memory-mapped), with a damaged file reported as CorruptTensor."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as error:
        raise CorruptTensor(f"cannot read GGUF {str(path)!r} ({error}); the file is truncated or damaged, "
                            "re-download it") from error


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return "" if field is None else bytes(field.parts[field.data[0]]).decode()


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


def use_quantized_linear(model: nn.Module, gguf_path: Path, args: ModelArgs) -> QuantizedSwap:
    """Swap the linears of `model` (built from this GGUF's fp32 dequantisation) for QuantLinears
    reading the GGUF's blocks, in place. A module whose tensors have a type without a kernel stays
    fp32, with a logged notice naming the type. Raises CorruptTensor for a missing, truncated or
    mis-shaped tensor."""
    reader = open_gguf(Path(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    permuted = _architecture(reader) in PERMUTED_ARCHITECTURES
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
        setattr(parent, attr, QuantLinear(parts, old.bias, scratch, dense))
        swapped.append(path)
        nbytes += sum(p.nbytes for p in parts)
    return QuantizedSwap(tuple(swapped), tuple(kept), nbytes)
