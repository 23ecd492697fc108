"""Layer-wise training of the Spotlight query/key encoders with the Bradley–Terry ranking loss.

    python -m spotlight.train --model smollm2-135m-instruct --out spotlight/checkpoints/smollm2-135m-instruct-128b.safetensors

Shape legend: S recorded sequences, L trained layers, H query heads, Hkv KV heads, G = H / Hkv,
D head dim, C code bits, T sequence length, Pn recorded query positions per sequence, M ranked
keys kept per query, Q queries per step, P top keys per query, R shared other keys per step,
Ph hard other keys per query, Pm mined other keys per query.

The language model is frozen. Recording (once, cached on disk): a dense chunked prefill of each
training sequence through a policy that keeps every trained layer's post-RoPE k, and q at every
`stride`-th position from `min_query` on. For each such query the exact ranking target is
computed there and then: for each KV head, the attention probability of every visible key
summed over the G query heads of its group (what OracleSelector ranks by, so "exact top-k" is
the same in training and in bench/quality.py). The decode path's forced tokens (the first
`sinks`, the last `window`) are excluded: the selector never ranks them. The M best keys are kept.

Each step takes one sequence and a block of Q consecutive recorded queries, and for every
trained layer at once (layers are independent; their parameters are batched on the first axis):
- top set of a query at position n - 1: its best m = max(1, int(top_fraction * n)) keys; P are
  drawn from it, plus Ph "hard" others from the ranks [m, 4m) if asked;
- R other keys drawn once for the step from the middle every query of the block sees (as the
  paper shares one column subset across queries), minus each query's own top set;
- Pm "mined" others per query (`mine_others`): the middle keys its current sign codes rank
  highest outside its best 4m, i.e. the codes' own false positives;
- soft codes s = softsign(gamma * h) of the encoders' activations h. The decode path ranks a
  key by the matching bits summed over its group, whose soft form is (sum_g s(q_g)) . s(k);
- loss: mean over valid pairs (top i, other j) of -log sigmoid(S_i - S_j) per layer, summed
  over layers (each layer gets its own mean-loss gradient); `misordered` is the share of pairs
  with S_i < S_j.

AdamW (1e-3, betas 0.9/0.98, weight decay 0.1), 1 % linear warm-up then cosine to zero,
gradient norm clipped to 1.0 per layer. The training state (parameters, optimizer, scheduler,
sampling RNG, step) is written atomically every `--save-every` steps and on Ctrl-C; `--resume`
continues it to the same result as an uninterrupted run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache
from .config import ModelArgs
from .digests import write_json
from .errors import ContextTooLong, EncoderMismatch, SpotlightError, TooMuchMemory
from .hashing import EncoderSpec, Encoders
from .loading import DEFAULT_MODEL
from .model import apply_rope

_RAM_SHARE = 0.6  # refuse a run whose estimated peak exceeds this share of the available memory
_HARD_SPAN = 4  # hard others come from the ranks [m, 4m) just below a query's top set


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run's result (saved with its state)."""

    bits: int = 128
    depth: int = 1
    width: int = 64
    init: str = "identity"
    top_fraction: float = 0.02
    sinks: int = 4  # forced tokens of the decode path, excluded from the ranking targets
    # The decode path's window, and whole windows of the model's context (third sweep, docs/DECISIONS.md)
    window: int = 256
    seq_len: int = 8192
    sequences: int = 6
    stride: int = 8  # a query is recorded at every stride-th position
    max_position: int = 0  # > seq_len: shift each step's q and k to random positions below this (RoPE)
    min_query: int = 512  # first recorded query position (shorter prefixes have few keys to rank)
    steps: int = 2400  # per layer group
    queries: int = 64  # Q
    tops: int = 8  # P
    others: int = 200  # R
    hard_others: int = 8  # Ph
    # tops drawn with probability proportional to (distance from the query) ** this within the top set.
    # 0 draws them uniformly, so recent keys (most of a long window's top sets) dominate the loss and
    # the codes learn recency: distant facts are lost (fourth sweep, docs/DECISIONS.md)
    top_distance_power: float = 1.5
    # Pm: per query, the keys its current sign codes rank highest outside its top set and near misses (sweep in
    # docs/DECISIONS.md: with them, more steps keep paying where random others had stopped)
    mined_others: int = 32
    gamma: float = 64.0
    gamma_start: float | None = None  # anneal gamma geometrically from this to `gamma` (None: constant)
    # loss scale: -log sigmoid(beta * (S_top - S_other)), S in (soft) matching bits summed over the
    # group. The paper's 1.0 saturates once a pair is ordered by a few bits; 0.05 asks for ~20x wider
    # margins and gave +6 points of recall@2% (sweep in docs/DECISIONS.md)
    beta: float = 0.05
    straight_through: bool = False  # forward the sign codes, backward through softsign (v2-branch style)
    init_scale: float = 1.0  # output projections start scaled by this (codes unchanged, softsign less saturated)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.1
    warmup: float = 0.01
    clip: float = 1.0
    seed: int = 0
    layers: tuple[int, ...] = ()  # empty: every layer of the model
    group: int = 1  # layers trained together (independent either way; small groups are faster on CPU)
    corpus: str = "shakespeare,kjv"

    def __post_init__(self):
        if not 0 < self.top_fraction < 0.5:
            raise ValueError(f"--top-fraction must be in (0, 0.5), got {self.top_fraction}")
        if self.min_query <= self.sinks + self.window + self.others:
            raise ValueError(f"min_query {self.min_query} must exceed sinks + window + others "
                             f"({self.sinks} + {self.window} + {self.others}) so every query has enough other keys")
        if self.seq_len < self.min_query + self.stride * self.queries:
            raise ValueError(f"--seq-len {self.seq_len} is too short for {self.queries} queries every {self.stride} "
                             f"tokens after position {self.min_query}; raise --seq-len or lower --queries")
        if min(self.steps, self.sequences, self.queries, self.tops, self.others, self.stride) < 1:
            raise ValueError("steps, sequences, queries, tops, others and stride must be >= 1")
        if self.group < 0 or self.hard_others < 0 or self.mined_others < 0 or self.top_distance_power < 0:
            raise ValueError("group, hard_others, mined_others and top_distance_power must be >= 0")
        first = self.min_query + 1  # tokens the first recorded query sees
        minable = first - self.window - self.sinks - _HARD_SPAN * int(self.top_count(torch.tensor(first)))
        if self.mined_others > minable:
            raise ValueError(f"--mined-others {self.mined_others} exceeds the {minable} keys the first query at "
                             f"position {self.min_query} has outside its top set and near misses; lower it")

    @property
    def ranked(self) -> int:
        """M: keys kept per recorded query: the top set of the last position and the ranks below it
        that hard others come from (kept whatever hard_others is, so one recording serves both)."""
        return _HARD_SPAN * max(1, int(self.top_fraction * self.seq_len))

    def top_count(self, n: torch.Tensor) -> torch.Tensor:
        """m: top-set size for queries that see n tokens (their own included)."""
        return (self.top_fraction * n).long().clamp(min=1)


# ----------------------------------------------------------------------------- recording


class QKRecorder:
    """A decode policy that keeps the post-RoPE q and k of some layers during dense prefill."""

    code_words = 0

    def __init__(self, layers: tuple[int, ...], q_out: torch.Tensor, k_out: torch.Tensor):
        self.slot = {layer: i for i, layer in enumerate(layers)}
        self.q_out, self.k_out = q_out, k_out  # (L, H, T, D), (L, Hkv, T, D) fp16

    def on_new_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache) -> None:
        i = self.slot.get(layer)
        if i is not None:
            start, end = cache.length, cache.length + q.shape[1]
            self.q_out[i, :, start:end] = q.to(self.q_out.dtype)
            self.k_out[i, :, start:end] = k.to(self.k_out.dtype)

    def decode(self, layer, q, cache):
        raise RuntimeError("QKRecorder records prefill only; it cannot decode")

    def dense_step(self, n_tokens: int) -> bool:
        return False

    def step_key_coders(self, n_tokens: int, cache) -> None:
        return None


@dataclass
class QKData:
    """Recorded training inputs and targets of the trained layers.

    q (S, L, H, Pn, D) fp16 at positions (S, Pn); k (S, L, Hkv, T, D) fp16; ranked
    (S, L, Hkv, Pn, M) int: each query's middle keys, best first.
    """

    q: torch.Tensor
    k: torch.Tensor
    positions: torch.Tensor
    ranked: torch.Tensor
    layers: tuple[int, ...]
    inv_freq: torch.Tensor | None = None  # (D/2,) the model's RoPE frequencies, for position shifts

    def subset(self, layers: tuple[int, ...]) -> "QKData":
        """The same sequences for some of the layers (views when they are consecutive)."""
        if tuple(layers) == self.layers:
            return self
        index = [self.layers.index(layer) for layer in layers]
        if index == list(range(index[0], index[0] + len(index))):
            pick = slice(index[0], index[0] + len(index))
        else:
            pick = torch.tensor(index)
        return QKData(self.q[:, pick], self.k[:, pick], self.positions, self.ranked[:, pick], tuple(layers),
                      self.inv_freq)


def query_positions(config: TrainConfig, sequence: int) -> torch.Tensor:
    """(Pn,) recorded positions of a sequence; the offset differs per sequence to cover all residues."""
    start = config.min_query + sequence % config.stride
    count = (config.seq_len - 1 - config.min_query) // config.stride
    return start + config.stride * torch.arange(count)


@torch.no_grad()
def rank_keys(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, config: TrainConfig, block: int = 128):
    """Exact targets: q (H, Pn, D), k (Hkv, T, D), positions (Pn,) -> ranked (Hkv, Pn, M) int64."""
    H, Pn, D = q.shape
    Hkv, T, _ = k.shape
    keys = torch.arange(T)
    out = []
    for start in range(0, Pn, block):
        pos = positions[start : start + block]  # (B,)
        qb = q[:, start : start + block].float().view(Hkv, H // Hkv, -1, D)  # (Hkv, G, B, D)
        logits = qb @ k.float().unsqueeze(1).transpose(-1, -2) / D**0.5  # (Hkv, G, B, T)
        causal = keys[None, :] <= pos[:, None]  # (B, T)
        prob = logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)  # (Hkv, B, T)
        middle = middle_keys(config, pos, T)  # (B, T)
        out.append(prob.masked_fill(~middle, -1.0).topk(config.ranked, dim=-1).indices)  # (Hkv, B, M)
    return torch.cat(out, dim=1)


@torch.inference_mode()
def record(model, sequences: list[list[int]], config: TrainConfig, layers: tuple[int, ...], progress=None) -> QKData:
    """Dense chunked prefill of every sequence (all of length seq_len), recording inputs and targets."""
    args: ModelArgs = model.args
    S, T, L = len(sequences), config.seq_len, len(layers)
    assert all(len(s) == T for s in sequences), f"every training sequence must have {T} tokens"
    positions = torch.stack([query_positions(config, i) for i in range(S)])  # (S, Pn)
    Pn, M = positions.shape[1], config.ranked
    index_dtype = torch.int16 if T <= 2**15 else torch.int32
    q = torch.empty(S, L, args.n_heads, Pn, args.head_dim, dtype=torch.float16)  # (S, L, H, Pn, D)
    k = torch.empty(S, L, args.n_kv_heads, T, args.head_dim, dtype=torch.float16)  # (S, L, Hkv, T, D)
    ranked = torch.empty(S, L, args.n_kv_heads, Pn, M, dtype=index_dtype)  # (S, L, Hkv, Pn, M)
    q_all = torch.empty(L, args.n_heads, T, args.head_dim, dtype=torch.float16)  # (L, H, T, D) one sequence
    device = model.tok_embeddings.weight.device
    for i, ids in enumerate(sequences):
        cache = KVCache(args, T, dtype=model.tok_embeddings.weight.dtype, device=device)
        recorder = QKRecorder(layers, q_all, k[i])
        for start in range(0, T, 512):
            model(torch.tensor(ids[start : start + 512], dtype=torch.long, device=device), cache, recorder)
        del cache
        q[i] = q_all[:, :, positions[i]]
        for j in range(L):
            ranked[i, j] = rank_keys(q[i, j], k[i, j], positions[i], config).to(index_dtype)
        if progress is not None:
            progress(i + 1, S)
    return QKData(q, k, positions, ranked, tuple(layers), model.inv_freq.float().cpu())


def memory_estimate(args: ModelArgs, config: TrainConfig, n_layers: int) -> dict:
    """Bytes of the recorded data, of recording one sequence, and of one step (fp32), roughly."""
    H, Hkv, D, T, C, L = args.n_heads, args.n_kv_heads, args.head_dim, config.seq_len, config.bits, n_layers
    Pn = (T - 1 - config.min_query) // config.stride
    data = config.sequences * L * (H * Pn * D * 2 + Hkv * T * D * 2 + Hkv * Pn * config.ranked * 4)
    recording = L * H * T * D * 2 + 2 * args.n_layers * Hkv * T * D * 4 + 4 * H * 128 * T * 4
    Q, P, R, Ph, Pm = config.queries, config.tops, config.others, config.hard_others, config.mined_others
    tokens = Q * (P + Ph + Pm) + R  # keys encoded per (layer, KV head) and step
    step = L * 4 * (6 * Hkv * tokens * (C + D + config.width) + 6 * H * Q * (C + D + config.width)
                    + 4 * Hkv * Q * P * (R + Ph + Pm)) + 2 * L * Hkv * Q * config.ranked * 8
    if Pm:  # mining codes every key of the sequence and scores it against every query of the step
        step += L * 4 * Hkv * T * (C + D + config.width) + L * 4 * 2 * Hkv * Q * T
    return {"data": data, "recording": recording, "step": step,
            "total": data + max(recording, step) + 700 * 2**20}  # + the model and the interpreter


def check_memory(estimate: dict, available: int | None = None) -> None:
    """Refuse before any long work when the estimate does not fit in the free memory."""
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    if estimate["total"] > _RAM_SHARE * available:
        gib = 2**30
        raise TooMuchMemory(
            f"training would need about {estimate['total'] / gib:.1f} GiB (recorded q/k {estimate['data'] / gib:.1f} "
            f"GiB + one step {estimate['step'] / gib:.1f} GiB) but only {available / gib:.1f} GiB is free; lower "
            f"--sequences or --seq-len (the recording), --queries or --others (the step), or train fewer --layers"
        )


# ----------------------------------------------------------------------------- trainable slices


class LayerMLP(nn.Module):
    """Trainable copy of one HeadMLP's parameters for the trained layers: (L, heads, ...)."""

    def __init__(self, source, layers: tuple[int, ...]):
        super().__init__()
        index = torch.tensor(layers)
        self.depth = source.depth
        names = ("w1", "b1", "w2", "w_out") if self.depth else ("w_out",)  # depth 0: only the projection
        for name in names:
            self.register_parameter(name, nn.Parameter(getattr(source, name).detach()[index].clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (L, heads, T, D) -> activations h (L, heads, T, C): the math of HeadMLP.forward."""
        y = x
        for i in range(self.depth):
            z = y @ self.w1[:, :, i] + self.b1[:, :, i]  # (L, heads, T, width)
            y = y + F.silu(z) @ self.w2[:, :, i]  # (L, heads, T, D)
        return y @ self.w_out  # (L, heads, T, C)

    @torch.no_grad()
    def write_back(self, target, layers: tuple[int, ...]) -> None:
        index = torch.tensor(layers)
        for name, p in self.named_parameters():
            getattr(target, name)[index] = p.detach().to(getattr(target, name).device)


@torch.no_grad()
def tie_hyperplanes(encoders: Encoders) -> Encoders:
    """Give every query head the output projection of its KV head (in place); returns `encoders`.

    NOTE: `Encoders.__init__` draws the query and key output projections independently, so their
    random hyperplanes (every bit of init="random", bits D.. of init="identity") differ between
    a query and the keys it is compared with, and those bits carry no similarity at all. SimHash
    needs the same hyperplanes on both sides; query head h * G + g is scored against KV head h.
    Idempotent; a no-op once hashing.py draws them tied. Only for untrained encoders.
    """
    spec = encoders.spec
    G = spec.n_heads // spec.n_kv_heads
    encoders.query.w_out.copy_(encoders.key.w_out.repeat_interleave(G, dim=1))  # (L, H, D, C)
    if not encoders.fingerprint.endswith("-tied"):
        encoders.fingerprint += "-tied"
    return encoders


def soft_code(h: torch.Tensor, gamma: float, straight_through: bool = False) -> torch.Tensor:
    """softsign(gamma * h): the differentiable stand-in for sign(h); with `straight_through`
    the forward value is sign(h) itself and only the gradient is softsign's."""
    soft = F.softsign(gamma * h)
    return soft + (torch.sign(h) - soft).detach() if straight_through else soft


# ----------------------------------------------------------------------------- one step


@dataclass
class Batch:
    """Indices of one step: queries, their top and other keys. Built without gradients."""

    seq: int
    query: torch.Tensor  # (Q,) indices into the recorded positions
    top: torch.Tensor  # (L, Hkv, Q, P) key indices
    shared: torch.Tensor  # (R,) key indices shared by every query, layer and head
    valid: torch.Tensor  # (L, Hkv, Q, R) bool: the shared key is not in the query's top set
    hard: torch.Tensor  # (L, Hkv, Q, Ph) key indices ranked just below the top set (+ Pm mined, see train_step)
    shift: int = 0  # positions added to every q and k of the step (a RoPE rotation, see rope_shift)


def sample_batch(data: QKData, config: TrainConfig, generator: torch.Generator) -> Batch:
    S, L, Hkv, Pn, M = data.ranked.shape
    Q, P, R, Ph = min(config.queries, Pn), config.tops, config.others, config.hard_others
    seq = int(torch.randint(S, (1,), generator=generator))
    first = int(torch.randint(Pn - Q + 1, (1,), generator=generator))
    query = torch.arange(first, first + Q)  # (Q,)
    n = data.positions[seq, query] + 1  # (Q,) tokens each query sees
    m = config.top_count(n).view(1, 1, Q, 1)
    ranked = data.ranked[seq][:, :, query].long()  # (L, Hkv, Q, M)
    top_set = torch.arange(M).view(1, 1, 1, M) < m  # (1, 1, Q, M): the ranks of each query's top set
    if config.top_distance_power:
        distance = ((n - 1).view(1, 1, Q, 1) - ranked).clamp(min=1).float()  # (L, Hkv, Q, M)
        weight = distance.pow(config.top_distance_power) * top_set  # the top set only
        pick = torch.multinomial(weight.view(-1, M), P, replacement=True, generator=generator)
        top = ranked.gather(-1, pick.view(L, Hkv, Q, P))  # (L, Hkv, Q, P)
    else:
        top = ranked.gather(-1, (torch.rand(L, Hkv, Q, P, generator=generator) * m).long())  # (L, Hkv, Q, P)
    middle_end = int(n[0]) - config.window  # the middle every query of the block sees: [sinks, middle_end)
    shared = config.sinks + torch.randperm(middle_end - config.sinks, generator=generator)[:R]  # (R,)
    slot = torch.full((data.k.shape[3],), R, dtype=torch.long)  # key -> its place in `shared`, R for none
    slot[shared] = torch.arange(R)
    in_top = torch.where(top_set, slot[ranked], R)  # (L, Hkv, Q, M)
    valid = torch.ones(L, Hkv, Q, R + 1, dtype=torch.bool).scatter_(-1, in_top, False)[..., :R]
    middle = (n - config.window - config.sinks).view(1, 1, Q, 1)
    hard_hi = torch.minimum(torch.minimum(_HARD_SPAN * m, middle), torch.tensor(M))
    hard_rank = m + (torch.rand(L, Hkv, Q, Ph, generator=generator) * (hard_hi - m).clamp(min=0)).long()
    hard = ranked.gather(-1, hard_rank.clamp(max=M - 1))  # (L, Hkv, Q, Ph)
    return Batch(seq, query, top, shared, valid, hard, _shift(data, config, int(n[0]) - 1, generator))


def _shift(data: QKData, config: TrainConfig, first: int, generator: torch.Generator) -> int:
    """Positions to add to the step: its first query lands at a position drawn uniformly from
    [min_query, max_position) when that lies later than where it was recorded (0 otherwise), so
    absolute positions are covered about evenly across the model's window."""
    room = config.max_position - data.k.shape[3]
    if room <= 0:
        return 0
    target = config.min_query + int(torch.randint(config.max_position - config.min_query, (1,), generator=generator))
    return min(max(target - first, 0), room)


def rope_shift(x: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE vectors x (..., D) as they would be `shift` positions later.

    RoPE rotates each frequency pair by position * inv_freq, so rotating q and k once more
    by shift * inv_freq yields the vectors of positions p + shift and j + shift with every
    q . k (hence every training target) unchanged: recordings of short sequences then teach
    the encoders every absolute position of the model's window.
    """
    angles = shift * inv_freq.float()  # (D/2,)
    both = torch.cat([angles, angles])  # (D,)
    return apply_rope(x, both.cos(), both.sin())  # the model's own rotate-half convention


def middle_keys(config: TrainConfig, last: torch.Tensor, T: int) -> torch.Tensor:
    """(Q, T) bool: the keys that queries at positions `last` (Q,) rank, the decode path's middle:
    after the sinks, before each query's window."""
    keys = torch.arange(T)
    return (keys[None, :] >= config.sinks) & (keys[None, :] <= (last - config.window)[:, None])


def sign_scores(query_mlp, key_mlp, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Matching-bit scores (L, Hkv, Q, T) of the sign codes, summed over each KV head's query group
    (how the decode path ranks keys): q (L, H, Q, D), k (L, Hkv, T, D)."""
    L, H, Q, _ = q.shape
    sq = torch.sign(query_mlp(q)).view(L, k.shape[1], H // k.shape[1], Q, -1).sum(2)  # (L, Hkv, Q, C)
    return sq @ torch.sign(key_mlp(k)).transpose(-1, -2)


@torch.no_grad()
def mine_others(query_mlp, key_mlp, data: QKData, batch: Batch, config: TrainConfig, device) -> torch.Tensor:
    """(L, Hkv, Q, Pm) for each query of the batch: the middle keys its current sign codes rank
    highest (group-summed matching bits, as the decode path ranks them) among those outside its
    best 4m (its top set and the near misses just below it, which carry attention too), i.e. the
    false positives of the codes as they stand.

    Random others are mostly keys the codes already rank low; recall@k is lost to the few
    that outrank a top key, and these are they.
    """
    q = data.q[batch.seq][:, :, batch.query].float().to(device)  # (L, H, Q, D)
    k = data.k[batch.seq].float().to(device)  # (L, Hkv, T, D)
    if batch.shift:
        q, k = rope_shift(q, batch.shift, data.inv_freq), rope_shift(k, batch.shift, data.inv_freq)
    last = data.positions[batch.seq, batch.query]  # (Q,) each query's own position n - 1
    middle = middle_keys(config, last, k.shape[2]).to(device)  # (Q, T)
    scores = sign_scores(query_mlp, key_mlp, q, k).masked_fill(~middle, float("-inf"))  # (L, Hkv, Q, T)
    ranked = data.ranked[batch.seq][:, :, batch.query].long()  # (L, Hkv, Q, M) best first
    near = torch.arange(ranked.shape[-1]) < _HARD_SPAN * config.top_count(last + 1).view(-1, 1)  # (Q, M)
    excluded = torch.where(near, ranked, ranked[..., :1])  # the far ranks repeat rank 0, excluded anyway
    scores.scatter_(-1, excluded.to(device), float("-inf"))
    return scores.topk(config.mined_others, dim=-1).indices.cpu()


def gather_keys(k: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """k (L, Hkv, T, D), index (L, Hkv, ...) -> (L, Hkv, ..., D) fp32."""
    L, Hkv, T, D = k.shape
    flat = index.reshape(L, Hkv, -1, 1).expand(-1, -1, -1, D)  # (L, Hkv, X, D)
    return k.gather(2, flat).float().view(*index.shape, D)


def batch_loss(query_mlp, key_mlp, data: QKData, batch: Batch, gamma: float, device, beta: float = 1.0,
               straight_through: bool = False):
    """Bradley–Terry loss (L,) and misordered-pair rate (L,) of one batch."""
    q = data.q[batch.seq][:, :, batch.query].float().to(device)  # (L, H, Q, D)
    k = data.k[batch.seq]  # (L, Hkv, T, D) fp16
    L, H, Q, D = q.shape
    Hkv, P, Ph, R = k.shape[1], batch.top.shape[-1], batch.hard.shape[-1], batch.shared.shape[0]
    own = torch.cat([batch.top, batch.hard], dim=-1)  # (L, Hkv, Q, P + Ph)
    x = torch.cat([gather_keys(k, own).view(L, Hkv, Q * (P + Ph), D), k[:, :, batch.shared].float()],
                  dim=2).to(device)  # (L, Hkv, Q*(P + Ph) + R, D)
    if batch.shift:
        q, x = rope_shift(q, batch.shift, data.inv_freq), rope_shift(x, batch.shift, data.inv_freq)
    sk = soft_code(key_mlp(x), gamma, straight_through)  # (L, Hkv, X, C)
    sq = soft_code(query_mlp(q), gamma, straight_through)  # (L, H, Q, C)
    C = sq.shape[-1]
    sq = sq.view(L, Hkv, H // Hkv, Q, C).sum(2)  # (L, Hkv, Q, C): the group's summed soft codes
    own = sk[:, :, : Q * (P + Ph)].view(L, Hkv, Q, P + Ph, C)  # each query's own top and hard keys
    s_own = (own @ sq.unsqueeze(-1)).squeeze(-1)  # (L, Hkv, Q, P + Ph)
    s_shared = sq @ sk[:, :, Q * (P + Ph) :].transpose(-1, -2)  # (L, Hkv, Q, R)
    s_top = s_own[..., :P]  # (L, Hkv, Q, P)
    s_other = torch.cat([s_own[..., P:], s_shared], dim=-1)  # (L, Hkv, Q, Ph + R)
    valid = torch.cat([torch.ones(L, Hkv, Q, Ph, dtype=torch.bool), batch.valid], dim=-1).to(device)
    z = s_top.unsqueeze(-1) - s_other.unsqueeze(-2)  # (L, Hkv, Q, P, Ph + R)
    weight = valid.unsqueeze(-2).expand_as(z).float()
    count = weight.sum((1, 2, 3, 4)).clamp(min=1)  # (L,)
    loss = (F.softplus(-beta * z) * weight).sum((1, 2, 3, 4)) / count  # (L,) = BCE-with-logits(beta z, 1)
    misordered = ((z < 0).float() * weight).sum((1, 2, 3, 4)) / count  # (L,)
    return loss, misordered.detach()


# ----------------------------------------------------------------------------- the trainer


def _lr_lambda(steps: int, warmup_share: float):
    warmup = max(1, int(warmup_share * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class Trainer:
    """Trains one group of layers: owns its trainable slices, optimizer, schedule and sampling RNG."""

    def __init__(self, encoders: Encoders, data: QKData, config: TrainConfig, device: str = "cpu",
                 seed: int | None = None):
        self.encoders, self.data, self.config, self.device = encoders, data, config, torch.device(device)
        self.layers = data.layers
        self.query = LayerMLP(encoders.query, self.layers).to(self.device)
        self.key = LayerMLP(encoders.key, self.layers).to(self.device)
        with torch.no_grad():  # a positive scale leaves every sign, hence every code, as it was
            self.query.w_out.mul_(config.init_scale)
            self.key.w_out.mul_(config.init_scale)
        params = list(self.query.parameters()) + list(self.key.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(config.steps, config.warmup))
        self.generator = torch.Generator().manual_seed(config.seed if seed is None else seed)
        self.step = 0

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns per-layer loss and misordered rate (L,)."""
        c = self.config
        batch = sample_batch(self.data, c, self.generator)
        if c.mined_others:
            mined = mine_others(self.query, self.key, self.data, batch, c, self.device)  # (L, Hkv, Q, Pm)
            batch = replace(batch, hard=torch.cat([batch.hard, mined], dim=-1))
        loss, misordered = batch_loss(self.query, self.key, self.data, batch, self.gamma(), self.device,
                                      c.beta, c.straight_through)
        self.optimizer.zero_grad(set_to_none=True)
        loss.sum().backward()
        self._clip_per_layer()
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return loss.detach().cpu(), misordered.cpu()

    def gamma(self) -> float:
        """The softsign sharpness at this step: constant, or annealed geometrically to config.gamma."""
        c = self.config
        if c.gamma_start is None:
            return c.gamma
        return c.gamma_start * (c.gamma / c.gamma_start) ** min(1.0, self.step / max(1, c.steps - 1))

    def _clip_per_layer(self) -> None:
        """Clip each layer's gradient norm to config.clip on its own (layers share no norm)."""
        grads = [p.grad for p in self.optimizer.param_groups[0]["params"] if p.grad is not None]
        sq = sum(g.pow(2).flatten(1).sum(1) for g in grads)  # (L,)
        scale = (self.config.clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # (L,)
        for g in grads:
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))

    @torch.no_grad()
    def recall(self, data: QKData | None = None, queries: int = 32, seed: int = 1234) -> torch.Tensor:
        """recall@k (L,) of the current sign codes (default on the training data; pass held-out
        recordings of the same layers for a fair number). See `code_recall`."""
        return code_recall(self.query, self.key, data or self.data, self.config, queries, seed, self.device)

    def write_back(self) -> None:
        """Copy the trained layers into the encoders given at construction."""
        self.query.write_back(self.encoders.query, self.layers)
        self.key.write_back(self.encoders.key, self.layers)

    def state_dict(self) -> dict:
        return {"step": self.step, "config": asdict(self.config), "layers": list(self.layers),
                "query": self.query.state_dict(), "key": self.key.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        _check_same(state, self.config, self.layers)
        self.query.load_state_dict(state["query"])
        self.key.load_state_dict(state["key"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])
        self.step = state["step"]


def _check_same(state: dict, config: TrainConfig, layers: tuple[int, ...]) -> None:
    saved = dict(state["config"], betas=tuple(state["config"]["betas"]), layers=tuple(state["config"]["layers"]))
    mine = asdict(config)
    diff = {k: (v, mine.get(k)) for k, v in saved.items() if mine.get(k) != v}
    if diff or tuple(state["layers"]) != tuple(layers):
        raise EncoderMismatch(f"the saved training state was made with other settings (saved, now): {diff}; "
                              f"resume with the same arguments, or start afresh without --resume")


@dataclass
class History:
    loss: list[float] = field(default_factory=list)  # mean over the group's layers, per step
    misordered: list[float] = field(default_factory=list)
    layer_loss: dict[int, float] = field(default_factory=dict)  # layer -> loss over its group's last 50 steps


class LayerwiseTraining:
    """Trains the layers of `data` in groups of `config.group`, one group after another.

    Layers are independent, and small groups keep each step's tensors in cache (on a busy
    2-core CPU, one layer at a time was ~4x cheaper per layer than all 30 batched). Each group
    runs `config.steps` steps with its own schedule and an RNG seeded by (seed, group).
    """

    def __init__(self, encoders: Encoders, data: QKData, config: TrainConfig, device: str = "cpu"):
        self.encoders, self.data, self.config, self.device = encoders, data, config, device
        size = config.group or len(data.layers)
        self.groups = [data.layers[i : i + size] for i in range(0, len(data.layers), size)]
        self.group = 0  # the group being trained
        self.trainer: Trainer | None = None
        self.history = History()
        self.seconds = 0.0  # training time, summed over resumed runs

    @property
    def total(self) -> int:
        return len(self.groups) * self.config.steps

    @property
    def step(self) -> int:
        return self.group * self.config.steps + (self.trainer.step if self.trainer else 0)

    def _current(self) -> Trainer:
        if self.trainer is None:
            layers = self.groups[self.group]
            self.trainer = Trainer(self.encoders, self.data.subset(layers), self.config, self.device,
                                   seed=self.config.seed + 7919 * self.group)
        return self.trainer

    def run(self, stop_at: int | None = None, *, state_path: Path | None = None, save_every: int = 0,
            progress: bool = False, report=None) -> History:
        """Train until global step `stop_at` (default: every group), saving the state every
        `save_every` steps and whenever a group ends; Ctrl-C saves it too. `report(step, saved)`,
        when given, is called after every step and after a save on Ctrl-C (`saved`: the state
        at `step` was just written)."""
        stop_at = self.total if stop_at is None else min(stop_at, self.total)
        bar = _progress_bar(self.step, self.total, "train") if progress else None
        started = time.perf_counter()
        try:
            while self.step < stop_at:
                trainer = self._current()
                loss, misordered = trainer.train_step()
                self.history.loss.append(float(loss.mean()))
                self.history.misordered.append(float(misordered.mean()))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(layers=",".join(map(str, trainer.layers)), loss=f"{_smooth(self.history.loss):.4f}",
                                    misordered=f"{_smooth(self.history.misordered):.2%}")
                if trainer.step == self.config.steps:  # the group is done: keep its layers, move on
                    for layer in trainer.layers:
                        self.history.layer_loss[layer] = _smooth(self.history.loss)
                    trainer.write_back()
                    self.group, self.trainer = self.group + 1, None
                saved = state_path is not None and ((save_every and self.step % save_every == 0) or self.trainer is None)
                if saved:
                    self.seconds += time.perf_counter() - started
                    started = time.perf_counter()
                    self.save_state(state_path)
                if report is not None:
                    report(self.step, saved)
        except KeyboardInterrupt:
            if state_path is not None:
                self.seconds += time.perf_counter() - started
                started = time.perf_counter()
                self.save_state(state_path)
                if report is not None:
                    report(self.step, True)
                print(f"\ninterrupted at step {self.step}; state saved to {state_path}; continue with --resume",
                      file=sys.stderr)
            raise
        finally:
            if bar is not None:
                bar.close()
        self.seconds += time.perf_counter() - started
        return self.history

    def finished_encoders(self) -> Encoders:
        """The encoders with every trained layer written back (finished groups already are)."""
        if self.trainer is not None:
            self.trainer.write_back()
        return self.encoders

    def state_dict(self) -> dict:
        return {"config": asdict(self.config), "layers": list(self.data.layers), "group": self.group,
                "encoders": self.encoders.state_dict(), "trainer": self.trainer.state_dict() if self.trainer else None,
                "history": asdict(self.history), "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        _check_same(state, self.config, self.data.layers)
        self.encoders.load_state_dict(state["encoders"])
        self.group, self.trainer = state["group"], None
        if state["trainer"] is not None:
            self._current().load_state_dict(state["trainer"])
        history = state["history"]
        self.history = History(history["loss"], history["misordered"],
                               {int(k): v for k, v in history["layer_loss"].items()})
        self.seconds = state.get("seconds", 0.0)

    def save_state(self, path: Path) -> None:
        """Atomically: write a temporary file, fsync it, rename it over the old state."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def load_state(self, path: Path) -> None:
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))


@torch.no_grad()
def code_recall(query_mlp, key_mlp, data: QKData, config: TrainConfig, queries: int = 32, seed: int = 1234,
                device="cpu") -> torch.Tensor:
    """Mean recall@k (L,) of sign-code retrieval against the exact top set.

    For `queries` recorded positions per sequence (position n - 1): the exact set is the top
    m = max(1, int(top_fraction * n)) middle keys; the code set is the m middle keys with the
    most matching bits summed over the group, ties to the lower index (the kernels' rule).
    """
    S, L, Hkv, Pn, M = data.ranked.shape
    T = data.k.shape[3]
    generator = torch.Generator().manual_seed(seed)
    total, count = torch.zeros(L), 0
    for seq in range(S):
        query = torch.randperm(Pn, generator=generator)[:queries].sort().values  # (Q,)
        n = data.positions[seq, query] + 1  # (Q,)
        m = config.top_count(n)  # (Q,)
        q = data.q[seq][:, :, query].float().to(device)  # (L, H, Q, D)
        Q = q.shape[2]
        scores = sign_scores(query_mlp, key_mlp, q, data.k[seq].float().to(device)).cpu()  # (L, Hkv, Q, T)
        scores = scores.masked_fill(~middle_keys(config, n - 1, T), float("-inf"))
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : int(m.max())]
        in_set = lambda idx: torch.zeros(L, Hkv, Q, T).scatter_(  # noqa: E731
            -1, idx, (torch.arange(idx.shape[-1]).view(1, 1, 1, -1) < m.view(1, 1, Q, 1)).float().expand_as(idx))
        exact = data.ranked[seq][:, :, query, : int(m.max())].long()  # (L, Hkv, Q, m_max)
        hits = (in_set(exact) * in_set(picked)).sum(-1) / m.view(1, 1, Q)  # (L, Hkv, Q)
        total += hits.mean((1, 2))
        count += 1
    return total / max(count, 1)


def _smooth(values: list[float], n: int = 50) -> float:
    tail = values[-n:]
    return sum(tail) / max(1, len(tail))


def _progress_bar(initial: int, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


class ProgressFile:
    """Machine-readable progress for whoever started the run (`--progress FILE`, read by
    spotlight/training.py): one JSON object, rewritten atomically at most every `every` seconds
    and at once when the phase changes or a state is saved. Its fields:

    phase: "loading", "recording" (done of `of` sequences), "training", "writing", then "done",
    "interrupted" (Ctrl-C or SIGINT; the state at `saved_step` continues it) or "failed"
    (`message` says why); step / total: optimizer steps over every layer group; start_step:
    where this run began (the saved state's step when resumed); saved_step: the step of the last
    saved state (null before one); elapsed: seconds since this run started; left: the estimated
    seconds to the end from this run's pace (null until a step has run); out: the checkpoint.
    """

    def __init__(self, path: Path | None, out: Path, every: float = 0.5):
        self.path, self.every = (Path(path) if path else None), every
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.fields = {"phase": "loading", "step": 0, "total": 0, "start_step": 0, "saved_step": None,
                       "done": 0, "of": 0, "elapsed": 0.0, "left": None, "out": str(out), "message": ""}
        self._written = float("-inf")
        self._pace: tuple[float, int] | None = None  # (when, step) the training phase began
        self.update(force=True)

    def update(self, force: bool = False, **fields) -> None:
        force = force or fields.get("phase", self.fields["phase"]) != self.fields["phase"]
        self.fields.update(fields)
        now = time.perf_counter()
        self.fields["elapsed"] = round(now - self.started, 2)
        if self.path is None or not (force or now - self._written >= self.every):
            return
        self._written = now
        write_json(self.path, self.fields)

    def training(self, step: int, total: int, resumed: bool) -> None:
        """The training phase begins at `step` (a resumed run: its saved state's step)."""
        self._pace = (time.perf_counter(), step)
        self.update(phase="training", step=step, total=total, start_step=step,
                    saved_step=step if resumed else None)

    def step(self, step: int, saved: bool) -> None:
        """`step` steps are done (over every group); `saved`: the state at `step` was just written."""
        when, first = self._pace
        done, total = step - first, self.fields["total"]
        left = (time.perf_counter() - when) / done * (total - step) if done > 0 else None
        changes = {"step": step, "left": None if left is None else round(left, 1)}
        if saved:
            changes["saved_step"] = step
        self.update(force=saved, **changes)


# ----------------------------------------------------------------------------- data on disk


def data_key(fingerprint: str, sequences: list[list[int]], config: TrainConfig) -> str:
    targets = [config.seq_len, config.stride, config.min_query, config.sinks, config.window, config.ranked,
               config.top_fraction]
    return hashlib.sha256(json.dumps([fingerprint, targets, sequences]).encode()).hexdigest()[:20]


def load_or_record(model, fingerprint: str, sequences, config: TrainConfig, cache_dir: Path | None,
                   on_sequence=None) -> QKData:
    """Recorded data of config.layers (default all), from the on-disk cache when the same model,
    text and targets were recorded before. Every layer is recorded, so one recording serves any --layers.
    `on_sequence(done, total)` is called after each recorded sequence."""
    from safetensors.torch import load_file, save_file

    every = tuple(range(model.args.n_layers))
    layers = config.layers or every
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"qk-{data_key(fingerprint, sequences, config)}.safetensors"
        if path.exists():
            t = load_file(str(path))
            print(f"recorded q/k of {len(sequences)} sequences loaded from {path}", file=sys.stderr)
            return QKData(t["q"], t["k"], t["positions"], t["ranked"], every, model.inv_freq.float().cpu()).subset(layers)
    bar = _progress_bar(0, len(sequences), "record q/k (dense prefill)")
    def recorded(done: int, total: int) -> None:
        bar.update(1)
        if on_sequence is not None:
            on_sequence(done, total)

    data = record(model, sequences, config, every if path is not None else layers, progress=recorded)
    bar.close()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"q": data.q, "k": data.k, "positions": data.positions, "ranked": data.ranked}, str(tmp))
        tmp.replace(path)
    return data.subset(layers)


# ----------------------------------------------------------------------------- command line

EPILOG = """examples:
  python -m spotlight.train --out spotlight/checkpoints/qwen2.5-coder-0.5b-instruct-128b.safetensors  # the default model
  python -m spotlight.train --model smollm2-135m-instruct --out spotlight/checkpoints/smollm2-135m-instruct-128b.safetensors
  python -m spotlight.train --steps 200 --sequences 8 --out /tmp/try.safetensors   # a quick look
  python -m spotlight.train --linear --out .cache/quality/linear-128.safetensors  # the linear baseline
  python -m spotlight.train --out X.safetensors --resume    # continue an interrupted run

The training state (every --save-every steps, after each layer group and on Ctrl-C) goes to
$SPOTLIGHT_HOME/train-state/X.state.pt; recorded q/k are cached under $SPOTLIGHT_HOME/train-cache,
so a resumed run skips the prefill. On a busy 2-core machine --threads 1 is the faster choice.
--progress FILE also writes machine-readable progress (JSON: phase, step, total, seconds left),
which training from the app's Settings tab reads (spotlight/training.py)."""


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m spotlight.train", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train Spotlight's query/key hash encoders for a model (which stays frozen), layer by layer, "
                    "with the Bradley–Terry ranking loss on the model's own post-RoPE q and k.")
    p.add_argument("--out", type=Path, required=True, help="checkpoint to write (.safetensors)")
    p.add_argument("--model", help="a packaged model's name, a GGUF file or a Hugging Face directory (default: the "
                   "app's default model, " + DEFAULT_MODEL + ")")
    a = p.add_argument_group("encoders")
    a.add_argument("--bits", type=int, default=d.bits, help="code bits C (default %(default)s)")
    a.add_argument("--depth", type=int, default=d.depth, help="residual MLP blocks (default %(default)s)")
    a.add_argument("--width", type=int, default=d.width, help="hidden width of each block (default %(default)s)")
    a.add_argument("--linear", action="store_true", help="depth 0: the learned linear-hash baseline, same loss")
    a.add_argument("--init", choices=("identity", "random"), default=d.init,
                   help="initial output projection: sign of the first D coordinates plus random hyperplanes, or "
                        "random hyperplanes only (default %(default)s)")
    t = p.add_argument_group("data and targets")
    t.add_argument("--corpus", default=d.corpus,
                   help="comma-separated: shakespeare, kjv, text files, directories (default %(default)s)")
    t.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence (default %(default)s)")
    t.add_argument("--sequences", type=int, default=d.sequences, help="sequences recorded once (default %(default)s)")
    t.add_argument("--top-fraction", type=float, default=d.top_fraction,
                   help="share of a query's visible tokens that form its top set (default %(default)s)")
    t.add_argument("--sinks", type=int, default=d.sinks, help="forced first tokens, never ranked (default %(default)s)")
    t.add_argument("--window", type=int, default=d.window, help="forced last tokens, never ranked (default %(default)s)")
    t.add_argument("--layers", default="", help="layers to train, e.g. '2-29' or '2,5,7' (default: all)")
    t.add_argument("--max-position", type=int, default=None,
                   help="shift each step's q and k by a random RoPE rotation to positions below this, so short "
                        "sequences teach the whole window (default: the model's context window; 0 = off)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per layer group (default %(default)s)")
    o.add_argument("--queries", type=int, default=d.queries, help="queries per step (default %(default)s)")
    o.add_argument("--tops", type=int, default=d.tops, help="top keys per query and step (default %(default)s)")
    o.add_argument("--top-distance-power", type=float, default=d.top_distance_power,
                   help="draw top keys with probability ~ distance from the query ** this, so distant top keys "
                        "weigh as much as recent ones (default %(default)s; 0 draws them uniformly)")
    o.add_argument("--others", type=int, default=d.others, help="other keys per step, shared (default %(default)s)")
    o.add_argument("--hard-others", type=int, default=d.hard_others,
                   help="other keys per query from the ranks just below its top set (default %(default)s)")
    o.add_argument("--mined-others", type=int, default=d.mined_others,
                   help="other keys per query that its current codes rank highest outside its top set and the "
                        "near misses below it (default %(default)s)")
    o.add_argument("--group", type=int, default=d.group,
                   help="layers trained together; groups run one after another (default %(default)s; 0 = all)")
    o.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    o.add_argument("--beta", type=float, default=d.beta,
                   help="loss scale: -log sigmoid(beta * score difference in matching bits) (default %(default)s)")
    o.add_argument("--straight-through", action="store_true",
                   help="score with the sign codes themselves, gradients through softsign (default: soft codes)")
    o.add_argument("--gamma-start", type=float, default=None,
                   help="anneal the softsign sharpness from this value to 64 over the run (default: 64 throughout)")
    o.add_argument("--init-scale", type=float, default=d.init_scale,
                   help="scale of the initial output projections: same codes, less saturated softsign(gamma*h) "
                        "(default %(default)s)")
    o.add_argument("--seed", type=int, default=d.seed, help="seed of data, init and sampling (default %(default)s)")
    r = p.add_argument_group("running")
    r.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                   help="weights' dtype in the written checkpoint (default %(default)s)")
    r.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when present)")
    r.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    r.add_argument("--save-every", type=int, default=100, help="write the training state every N steps (default 100)")
    r.add_argument("--resume", action="store_true", help="continue from the training state (--state)")
    r.add_argument("--state", type=Path, default=None,
                   help="training-state file (default $SPOTLIGHT_HOME/train-state/<out name>.state.pt)")
    r.add_argument("--cache-dir", default=None,
                   help="where recorded q/k are cached (default $SPOTLIGHT_HOME/train-cache; 'none' disables)")
    r.add_argument("--progress", type=Path, default=None,
                   help="also write machine-readable progress to this JSON file (phase, step, total, "
                        "estimated seconds left; see ProgressFile), as training from Settings reads it")
    return p


def parse_layers(text: str, n_layers: int) -> tuple[int, ...]:
    if not text:
        return tuple(range(n_layers))
    layers: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--layers {text!r}: write layers like '2-29' or '2,5,7'") from None
    bad = sorted(i for i in layers if not 0 <= i < n_layers)
    if bad or not layers:
        raise ValueError(f"--layers {text!r} names layers {bad} but the model has layers 0-{n_layers - 1}")
    return tuple(sorted(layers))


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C and the app's Cancel (spotlight/training.py) interrupt with SIGINT. A process
        # started with SIGINT ignored (a background job of a non-interactive shell, and so the
        # app's training child) would otherwise run to the end: take it back, before the progress
        # file exists (Cancel waits for that file before it interrupts).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    progress = ProgressFile(args.progress, args.out)
    try:
        return _main(args, sys.argv[1:] if argv is None else argv, progress)
    except ValueError as exc:  # SpotlightError and bad settings: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        progress.update(phase="failed", message=str(exc))
        return 2
    except KeyboardInterrupt:
        progress.update(phase="interrupted")
        return 130
    except BaseException as exc:
        progress.update(phase="failed", message=f"{type(exc).__name__}: {exc}")
        raise


def _main(args, argv: list[str], progress: ProgressFile) -> int:
    from . import loading
    from .config import EngineConfig, default_home
    from .corpus import load_corpus, token_windows
    from .engine import Engine

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    margs = loading.load_args(loading.resolve(args.model, default_home()))  # settings are checked first
    config = TrainConfig(
        bits=args.bits, depth=0 if args.linear else args.depth, width=args.width, top_fraction=args.top_fraction,
        sinks=args.sinks, window=args.window, seq_len=args.seq_len, sequences=args.sequences, steps=args.steps,
        queries=args.queries, tops=args.tops, others=args.others, hard_others=args.hard_others,
        top_distance_power=args.top_distance_power,
        mined_others=args.mined_others, seed=args.seed,
        init=args.init, init_scale=args.init_scale, gamma_start=args.gamma_start, group=args.group,
        beta=args.beta, straight_through=args.straight_through,
        max_position=margs.max_seq_len if args.max_position is None else args.max_position,
        lr=args.lr, layers=parse_layers(args.layers, margs.n_layers), corpus=args.corpus,
    )
    if config.seq_len > margs.max_seq_len:
        raise ContextTooLong(f"--seq-len {config.seq_len} exceeds the model's context window of "
                             f"{margs.max_seq_len} tokens; lower --seq-len")
    check_memory(memory_estimate(margs, config, margs.n_layers))  # every layer is recorded
    parts = {name: load_corpus(name) for name in (p.strip() for p in config.corpus.split(",")) if name}
    state_path = Path(args.state or default_home() / "train-state" / f"{args.out.stem}.state.pt")
    if args.resume and not state_path.exists():
        raise SpotlightError(f"--resume: no training state at {state_path}; run without --resume to start afresh")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    state_path.parent.mkdir(parents=True, exist_ok=True)
    engine = Engine.load(EngineConfig(model_path=args.model, device=device), default_home())
    sequences, sources = token_windows(parts, engine.encode, config.sequences, config.seq_len, config.seed)
    if len(sequences) < config.sequences:
        raise SpotlightError(f"the corpus gives only {len(sequences)} windows of {config.seq_len} tokens; "
                             f"lower --sequences to {len(sequences)} or add text")
    no_cache = args.cache_dir is not None and args.cache_dir.lower() == "none"
    cache_dir = None if no_cache else Path(args.cache_dir or default_home() / "train-cache")
    record_started = time.perf_counter()
    progress.update(phase="recording", of=len(sequences))
    data = load_or_record(engine.model, engine.fingerprint, sequences, config, cache_dir,
                          on_sequence=lambda done, total: progress.update(done=done, of=total))
    record_seconds = time.perf_counter() - record_started
    spec = EncoderSpec.for_model(margs, config.bits, depth=config.depth, width=config.width, init=config.init)
    encoders = tie_hyperplanes(Encoders(spec, seed=config.seed, model_fingerprint=engine.fingerprint))
    training = LayerwiseTraining(encoders, data, config, device)
    if args.resume:
        training.load_state(state_path)
        print(f"resumed at step {training.step} of {training.total}", file=sys.stderr)
    progress.training(training.step, training.total, resumed=args.resume)
    training.run(state_path=state_path, save_every=args.save_every, progress=True, report=progress.step)
    training.save_state(state_path)
    progress.update(phase="writing")
    encoders = training.finished_encoders()
    recall = code_recall(LayerMLP(encoders.query, data.layers), LayerMLP(encoders.key, data.layers), data, config)
    encoders.provenance = provenance(config, training, sources, record_seconds, recall, argv, engine, started)
    fingerprint = encoders.save(args.out, dtype=getattr(torch, args.dtype))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, fingerprint {fingerprint}): recall@"
          f"{config.top_fraction:.0%} on the training text {float(recall.mean()):.3f} (mean over layers "
          f"{data.layers[0]}-{data.layers[-1]}); last group's loss {_smooth(training.history.loss):.4f}")
    progress.update(phase="done", left=0.0)
    return 0


def provenance(config, training, sources, record_seconds, recall, argv, engine, started) -> dict:
    layer_loss = training.history.layer_loss
    return {
        "trained": True, "method": "Bradley-Terry ranking loss, spotlight/train.py",
        "config": asdict(config), "model": str(engine.source.origin), "model_fingerprint": engine.fingerprint,
        "corpus": config.corpus, "documents": sorted({d for s in sources for d in s["documents"]}),
        "sequences": sources, "tokens": sum(s["tokens"] for s in sources), "steps": training.step,
        "layers": list(training.data.layers), "command": "python -m spotlight.train " + " ".join(argv),
        "git_commit": git_commit(), "record_seconds": round(record_seconds, 1),
        "train_seconds": round(training.seconds, 1), "total_seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "layer_loss": {str(k): round(v, 5) for k, v in sorted(layer_loss.items())},
        "train_recall": {str(layer): round(float(x), 4) for layer, x in zip(training.data.layers, recall)},
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


if __name__ == "__main__":
    sys.exit(main())
