"""Query and key encoders (small MLPs -> binary codes) and their checkpoint format.

Shape legend: L layers, H query heads, Hkv KV heads, D head dim, C code bits,
T tokens, W = ceil(C / 64) packed words.

Each layer has a query encoder with one MLP per query head and a key encoder with one
MLP per KV head (one code per KV head, shared by its GQA group). An MLP is

    y = x + silu(x @ W1 + b1) @ W2     (residual block(s), D -> width -> D, non-linear)
    h = y @ W_out                      (D -> C; identity-like or random at init)

and the code is sign(h). Training uses softsign(gamma * h) instead of the sign.
`depth` counts the residual blocks (0 gives a linear hash: HATA-style when trained, SimHash
when W_out is random and untrained). W2 starts at zero, so an untrained MLP is exactly its
output projection: sign(x) on the first D bits (identity init) or random hyperplanes.

Checkpoint: one safetensors file with tensors `{query,key}.{name}` stacked over layers,
and metadata: format, model fingerprint, bits, head dim, heads, depth, init, training
provenance (JSON). Its own fingerprint is the sha256 of the file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .errors import CorruptCheckpoint, EncoderMismatch

FORMAT = "spotlight-encoders/1"


@dataclass(frozen=True)
class EncoderSpec:
    """Architecture of the encoders of one model."""

    bits: int
    head_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    depth: int = 1  # residual MLP blocks before the output projection (0 = linear hash)
    width: int = 64  # hidden width of each residual block
    init: str = "identity"  # identity | random

    def __post_init__(self):
        if self.init not in ("identity", "random"):
            raise ValueError(f"init must be 'identity' or 'random', got {self.init!r}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")

    @classmethod
    def for_model(cls, args: ModelArgs, bits: int, **kw) -> "EncoderSpec":
        return cls(bits, args.head_dim, args.n_layers, args.n_heads, args.n_kv_heads, **kw)


class HeadMLP(nn.Module):
    """One MLP per head, batched over L layers and `heads`: parameters (L, heads, ...)."""

    def __init__(self, spec: EncoderSpec, heads: int, generator: torch.Generator):
        super().__init__()
        L, D, C, Wd, depth = spec.n_layers, spec.head_dim, spec.bits, spec.width, max(spec.depth, 1)
        self.depth = spec.depth
        self.w1 = nn.Parameter(torch.randn(L, heads, depth, D, Wd, generator=generator) / D**0.5)
        self.b1 = nn.Parameter(torch.zeros(L, heads, depth, 1, Wd))
        self.w2 = nn.Parameter(torch.zeros(L, heads, depth, Wd, D))  # zero: an untrained block is the identity
        self.w_out = nn.Parameter(_output_projection(spec, L * heads, generator).view(L, heads, D, C))

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x (heads, T, D) -> pre-sign activations h (heads, T, C)."""
        dtype = x.dtype
        y = x
        for i in range(self.depth):
            z = torch.baddbmm(self.b1[layer, :, i].to(dtype), y, self.w1[layer, :, i].to(dtype))  # (heads, T, width)
            y = y + torch.bmm(F.silu(z), self.w2[layer, :, i].to(dtype))  # (heads, T, D)
        return torch.bmm(y, self.w_out[layer].to(dtype))  # (heads, T, C)


def _output_projection(spec: EncoderSpec, count: int, generator: torch.Generator) -> torch.Tensor:
    """(count, D, C): identity on the first min(D, C) bits and random hyperplanes for the rest."""
    D, C = spec.head_dim, spec.bits
    w = torch.randn(count, D, C, generator=generator) / D**0.5
    if spec.init == "identity":
        w[:, :, : min(D, C)] = torch.eye(D, min(D, C))
    return w


class Encoders(nn.Module):
    """Query and key encoders of every layer, plus where they came from."""

    def __init__(self, spec: EncoderSpec, *, seed: int = 0, model_fingerprint: str = "", provenance: dict | None = None):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.spec = spec
        self.query = HeadMLP(spec, spec.n_heads, generator)
        self.key = HeadMLP(spec, spec.n_kv_heads, generator)
        self.model_fingerprint = model_fingerprint
        self.provenance = provenance or {"trained": False, "init": spec.init, "seed": seed}
        self.fingerprint = _untrained_fingerprint(spec, seed)

    @property
    def trained(self) -> bool:
        return bool(self.provenance.get("trained"))

    def query_bits(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q (H, T, D) post-RoPE -> activations (H, T, C); sign(h) > 0 is the code."""
        return self.query(layer, q)

    def key_bits(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k (Hkv, T, D) post-RoPE -> activations (Hkv, T, C)."""
        return self.key(layer, k)

    def save(self, path: Path, dtype: torch.dtype | None = None) -> str:
        """Write the checkpoint atomically; return its fingerprint (sha256 of the file).

        dtype: store the weights in this dtype (e.g. torch.float16 halves the file); loading
        always gives fp32 parameters.
        """
        from safetensors.torch import save_file

        tensors = {f"{side}.{name}": p.detach().to(dtype or p.dtype).contiguous().cpu()
                   for side in ("query", "key") for name, p in getattr(self, side).named_parameters()}
        meta = {
            "format": FORMAT, "model_fingerprint": self.model_fingerprint,
            "spec": json.dumps(self.spec.__dict__), "provenance": json.dumps(self.provenance),
        }
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        self.fingerprint = file_fingerprint(path)
        return self.fingerprint


def _untrained_fingerprint(spec: EncoderSpec, seed: int) -> str:
    return "untrained-" + hashlib.sha256(json.dumps([spec.__dict__, seed]).encode()).hexdigest()[:16]


def file_fingerprint(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:32]


def checkpoint_matches(path: Path, model_fingerprint: str, bits: int) -> bool:
    """Whether `path` is a readable encoder checkpoint for this model at `bits` (metadata only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        spec = json.loads(meta["spec"])
    except (SafetensorError, OSError, KeyError, ValueError, TypeError):
        return False
    return (meta.get("format") == FORMAT and meta.get("model_fingerprint") == model_fingerprint
            and spec.get("bits") == bits)


def load_encoders(path: Path, *, model_fingerprint: str | None = None, bits: int | None = None) -> Encoders:
    """Read a checkpoint; refuse one made for another model or another bit count."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        spec = EncoderSpec(**json.loads(meta["spec"]))
        provenance = json.loads(meta.get("provenance", "{}"))
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        raise CorruptCheckpoint(
            f"encoder checkpoint {str(path)!r} is unreadable ({exc}); retrain it with `python -m spotlight.train`"
        ) from exc
    if meta.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{str(path)!r} is not a Spotlight encoder checkpoint (format {meta.get('format')!r})")
    if model_fingerprint is not None and meta.get("model_fingerprint") != model_fingerprint:
        raise EncoderMismatch(
            f"encoder checkpoint {path.name} was trained for model {meta.get('model_fingerprint')!r}, not for the "
            f"loaded model {model_fingerprint!r}; train one with `python -m spotlight.train` or pass --no-spotlight"
        )
    if bits is not None and spec.bits != bits:
        raise EncoderMismatch(f"encoder checkpoint {path.name} has {spec.bits}-bit codes but {bits} bits were asked for")
    encoders = Encoders(spec, model_fingerprint=meta.get("model_fingerprint", ""), provenance=provenance)
    state = {k: v for k, v in tensors.items()}
    try:
        encoders.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CorruptCheckpoint(f"encoder checkpoint {str(path)!r} does not match its own spec: {exc}") from exc
    encoders.fingerprint = file_fingerprint(path)
    return encoders.eval().requires_grad_(False)
