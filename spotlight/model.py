"""Compact Llama-family decoder (Llama, Qwen2, Mistral) that loads Hugging Face weights.

Shape legend: T new tokens, N cached tokens (including the T being written), E hidden
size, F MLP width, H query heads, Hkv KV heads, G = H / Hkv, D head dim, V vocabulary.
Batch size is 1 throughout: one conversation per forward.

Prefill chunks (T > 1) within the model's native window (`max_seq_len`) use dense causal
attention over the cache; a chunk reaching past it, and every decode step (T = 1), hand
attention to the `DecodePolicy` (dense or Spotlight, see attention.py and beyond.py), which
also sees every key as it enters the cache (to compute its code once). RoPE angles of
positions past the window are formed in float64 (positions.rope_angles), the table's fp32
ones inside it.

Plain torch: the CPU decode fast path for the weight products (spotlight/onerow.py) is swapped
in at load time.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs, RopeScaling
from .positions import rope_angles


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32 and cast back before the weight, exactly as transformers does.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (D/2,) on the CPU, including the config's rope scaling. Made on the CPU
    even inside a meta-device block (the quantized model's skeleton), where torch's meta arange
    would import sympy (~20 MiB resident)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling: RopeScaling = args.rope_scaling
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(inv_freq: torch.Tensor, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (n_positions, D) in fp32."""
    positions = torch.arange(n_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (heads, T, D); cos, sin: (T, D). Rotate-half convention of Hugging Face Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (heads, T, D)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Post-RoPE q (H, T, D), k (Hkv, T, D) and v (Hkv, T, D) of the new tokens x (T, E)."""
        T = x.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.wqkv(x).split(((H + Hkv) * D, Hkv * D), dim=-1)  # (T, (H+Hkv)*D), (T, Hkv*D)
        # q and k rotate in one pass (the same elementwise ops, half the calls of a decode step)
        qk = apply_rope(qk.view(T, H + Hkv, D).transpose(0, 1), cos, sin)  # (H + Hkv, T, D)
        return qk[:H], qk[H:], v.view(T, Hkv, D).transpose(0, 1)  # (H, T, D), (Hkv, T, D) x2

    def forward(self, x, cos, sin, cache, policy, mask=None, last_only: bool = False, observers=()) -> torch.Tensor:
        """(T, E), or with `last_only` (1, E): the last position's output only (every key and
        value still enters the cache). A decode step tells `observers` what it read."""
        q, k, v = self.project(x, cos, sin)
        out = self.attend(q, k, v, cache, policy, mask, last_only, observers)  # (H, T or 1, D)
        return self.wo(out.transpose(0, 1).reshape(out.shape[1], -1))  # (T or 1, E)

    def attend(self, q, k, v, cache, policy, mask=None, last_only: bool = False, observers=()) -> torch.Tensor:
        """The new tokens' post-RoPE q (H, T, D), k, v (Hkv, T, D) into the cache, and their
        attention output (H, T, D), or (H, 1, D) for the last position with `last_only`."""
        T = q.shape[1]
        cache.write(self.layer, k, v)
        policy.on_new_tokens(self.layer, q, k, cache)
        if T == 1:
            out = policy.decode(self.layer, q, cache)  # (H, 1, D)
            for observer in observers:
                observer.on_layer(self.layer, q, cache, policy.selection(self.layer))
        elif cache.length + T > cache.args.max_seq_len:  # past the native window: the policy's (beyond.py)
            out = policy.prefill(self.layer, q, cache)  # (H, T, D)
            out = out[:, -1:] if last_only else out
        elif last_only:  # the last query sees every cached key: no mask
            out = dense_decode(q[:, -1:], cache.keys(self.layer, T), cache.values(self.layer, T))  # (H, 1, D)
        else:
            out = causal_attention(q, cache.keys(self.layer, T), cache.values(self.layer, T), mask)  # (H, T, D)
        return out


def as_compute(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Cached rows in q's dtype: themselves, or a widened copy when the cache stores another
    precision (an fp16 cache under fp32 compute, EngineConfig.kv_dtype)."""
    return rows if rows.dtype == q.dtype else rows.to(q.dtype)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q (H, T, D) for the last T of N positions; k, v (Hkv, N, D). Returns (H, T, D).

    mask: `chunk_mask(q, T, N - T)`, built once per forward and shared by the layers (made
    here when not given); not needed when the T tokens are the whole sequence, nor by the
    split path (`_split_attention`) that fp32 chunks on the CPU take. An fp16 cache's k, v
    (EngineConfig.kv_dtype) are widened to q's dtype (the split path widens its past in blocks)."""
    T, N = q.shape[1], k.shape[1]
    past = N - T
    if past > 0 and splits_chunks(q):
        return _split_attention(q, k, v, past)
    k, v = as_compute(k, q), as_compute(v, q)
    if past == 0:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
    else:
        mask = chunk_mask(q, T, past) if mask is None else mask
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True)
    return out[0]  # (H, T, D)


# NOTE: torch's CPU flash-attention op, which also returns the log-sum-exp that merging two
# partial attentions needs (public SDPA does not); when a torch build lacks it, chunks after the
# first take the masked SDPA path.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def splits_chunks(x: torch.Tensor) -> bool:
    """Whether prefill chunks after the first take `_split_attention` (fp32 on the CPU)."""
    return _FLASH_CPU is not None and x.device.type == "cpu" and x.dtype == torch.float32


# Past rows a split chunk widens at a time where the cache stores another precision (an fp16
# cache under fp32 compute): each block is one more exact attention merged by its log-sum-exp, so
# the widened copy is a block's (SmolLM2-135M's 8K past: 12.6 MB whole, 3.1 MB a block; Qwen2.5's
# 32K past: 33.6 MB whole), not the whole past's, in the peak RSS of a long prefill.
PAST_BLOCK = 2048


def _split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, block: int = PAST_BLOCK) -> torch.Tensor:
    """A prefill chunk after `past` cached tokens as exact attentions merged by their log-sum-exps:
    the chunk itself causally, and the past with no mask (whole, or in blocks of `block` rows
    where it has to be widened to q's dtype).

    The masked alternative computes the chunk's masked-out upper triangle too and reads a
    (T, N) mask; this costs what one causal pass over the whole sequence does (the sum over
    an 8K prompt in 1024-token chunks: 484 ms a layer, one-shot causal 489 ms, masked 590 ms).
    The past needs no GQA copy: the G query heads of a KV head become G * T rows of it.
    q (H, T, D), k, v (Hkv, past + T, D) of the cache's dtype -> (H, T, D)."""
    H, T, D = q.shape
    Hkv = k.shape[0]
    k_own = as_compute(k[:, past:], q).repeat_interleave(H // Hkv, 0)[None]  # (1, H, T, D): T rows, a cheap copy
    v_own = as_compute(v[:, past:], q).repeat_interleave(H // Hkv, 0)[None]
    out, lse = _FLASH_CPU(q[None], k_own, v_own, is_causal=True)  # (1, H, T, D), (1, H, T)
    out, lse = out[0], lse.reshape(H, T, 1)
    rows = q.reshape(Hkv, (H // Hkv) * T, D)[None]  # (1, Hkv, G*T, D): head h = kv * G + g
    block = past if k.dtype == q.dtype else block
    for start in range(0, past, block):
        end = min(past, start + block)
        k_past, v_past = as_compute(k[None, :, start:end], q), as_compute(v[None, :, start:end], q)  # (1, Hkv, B, D)
        out_past, lse_past = _FLASH_CPU(rows, k_past, v_past)  # (1, Hkv, G*T, D), (1, Hkv, G*T)
        out, lse = _merge(out, lse, out_past.reshape(H, T, D), lse_past.reshape(H, T, 1))
    return out


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Two exact attentions over disjoint keys, (H, T, D) with log-sum-exps (H, T, 1), as one
    (in place in out_a and out_b) and its log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # (H, T, 1)
    total = w_a + w_b
    return out_b.mul_(w_b).add_(out_a.mul_(w_a)).div_(total), top + torch.log(total)


def chunk_mask(x: torch.Tensor, T: int, past: int) -> torch.Tensor | None:
    """The mask `causal_attention` needs for T tokens of x's dtype and device after `past` cached
    ones: None for a single token, a first chunk (`is_causal`) or a split chunk, else prefill_mask."""
    if T == 1 or past == 0 or splits_chunks(x):
        return None
    return prefill_mask(T, past, x.dtype, x.device)


def prefill_mask(T: int, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask (T, past + T) of T new tokens after `past` cached ones: 0 where a
    query sees a key, -inf above the diagonal. A float mask, so SDPA does not convert a boolean
    one in every layer."""
    rows = torch.arange(T, device=device).unsqueeze(1) + past  # (T, 1): absolute position of each query
    hidden = torch.arange(past + T, device=device).unsqueeze(0) > rows  # (T, N)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query step. q (H, 1, D); k, v (Hkv, N, D). Returns (H, 1, D).

    The G query heads of a KV head become G "query rows" of that head, so no key is
    copied G times (no repeat_kv) and no mask is needed (every cached key is visible).
    """
    H, _, D = q.shape
    Hkv = k.shape[0]
    k, v = as_compute(k, q), as_compute(v, q)
    out = F.scaled_dot_product_attention(q.view(1, Hkv, H // Hkv, D), k[None], v[None])  # (1, Hkv, G, D)
    return out.reshape(H, 1, D)  # a view on the CPU; CUDA's SDPA may return other strides


# The largest (T, 2F) MLP intermediate one call makes (inference on the CPU): a prefill chunk whose
# intermediate would be larger runs its MLP in slices of FFN_ROWS tokens, bounding peak memory (a
# 1,024-token Qwen2.5 chunk's is 40 MB, a slice's 10 MB; a quantized model dequantises the MLP's
# weights once per slice, ~3 % of such a chunk). Below it a chunk runs whole: SmolLM2-135M's 12.6 MB
# at 1,024 tokens in four slices made its prefill 7-8 % slower (docs/DECISIONS.md, session 33).
FFN_WHOLE_BYTES = 16 << 20
FFN_ROWS = 256


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.width = args.intermediate_size
        self.w_gate_up = nn.Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.w_down = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        whole = T * 2 * self.width * x.element_size() <= FFN_WHOLE_BYTES  # the (T, 2F) intermediate's bytes
        if torch.is_grad_enabled() or x.device.type != "cpu" or whole:
            return self._rows(x)
        # NOTE: a long CPU prefill chunk in slices of FFN_ROWS tokens (each token's MLP is its own):
        # the (T, 2F) intermediate of a 1,024-token Qwen2.5 chunk is 40 MB of the process's peak, a
        # slice's 10 MB (a GPU keeps whole chunks: its memory is not the process's RSS)
        out = torch.empty(*x.shape[:-1], self.w_down.out_features, dtype=x.dtype, device=x.device)  # (T, E)
        for start in range(0, T, FFN_ROWS):
            out[start:start + FFN_ROWS] = self._rows(x[start:start + FFN_ROWS])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.width, dim=-1)  # (T, F) x2
        if torch.is_grad_enabled():
            return self.w_down(F.silu(gate) * up)  # (T, E)
        # NOTE: in place in the projection's own output where no gradient needs it: the same
        # values without two more (T, F) buffers
        return self.w_down(F.silu(gate, inplace=True).mul_(up))  # (T, E)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        # A decode step's work around the attention in two compiled calls, where the block's
        # linears all allow it (spotlight/quantized.py FusedDecode, set by use_fused_decode).
        self.fused_decode = None

    def use_fused_decode(self, fused) -> None:
        """Run one-token fp32 CPU steps through `fused` (a FusedDecode of this block) or, with
        None, through the modules."""
        self.fused_decode = fused

    def forward(self, x, cos, sin, cache, policy, mask=None, last_only: bool = False, observers=()) -> torch.Tensor:
        """(T, E), or (1, E) for the last position with `last_only` (see Attention.forward)."""
        fused = self.fused_decode
        if fused is not None and fused.accepts(x):  # one token: the same arithmetic, compiled
            q, k, v = fused.head(x, cos, sin)
            return fused.tail(x, self.attention.attend(q, k, v, cache, policy, mask, last_only, observers))
        h = x[-1:] if last_only else x
        h = h + self.attention(self.attention_norm(x), cos, sin, cache, policy, mask, last_only, observers)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. `forward` appends T tokens to `cache` and returns logits."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        # NOTE: nn.Embedding's own init draws normal_ values, which on a meta tensor (the quantized
        # model's skeleton, spotlight/quantized.py) imports torch._dynamo: 70 MiB resident for
        # nothing. The same draw is made here on real tensors only (same values, same RNG order).
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        if not self.tok_embeddings.weight.is_meta:
            nn.init.normal_(self.tok_embeddings.weight)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.inv_freq = rope_inv_freq(args)  # (D/2,) fp32; a plain attribute so .to(dtype) keeps it fp32
        self.rope_cos = self.rope_sin = None
        # Every block of a dense decode step in one compiled call, where all blocks are fused
        # (spotlight/quantized.py FusedStep, set by use_fused_decode).
        self.fused_step = None
        # A context manager factory the blocks of a chunk past the native window run inside
        # (quantized.DequantBuffer.lowered: their weight products in bf16), set by use_far_products.
        self.far_products = None

    def use_fused_step(self, step) -> None:
        """Run one-token steps that attend to every cached row (DecodePolicy.dense_step, or
        step_key_coders for a step that also codes its keys) through `step` (a FusedStep of this
        model) or, with None, block by block."""
        self.fused_step = step

    def use_far_products(self, lowered) -> None:
        """Run the blocks of prefill chunks that reach past the native window inside `lowered()`
        (a context manager factory: quantized.DequantBuffer.lowered), or, with None, as any other."""
        self.far_products = lowered

    def setup_rope(self, n_positions: int) -> None:
        """Precompute cos/sin for positions [0, n_positions) within the native window; called when
        the cache grows (positions past it are formed per forward, `rope`)."""
        n_positions = min(n_positions, self.args.max_seq_len)
        if self.rope_cos is None or self.rope_cos.shape[0] < n_positions:
            cos, sin = rope_table(self.inv_freq.float().cpu(), n_positions)
            dtype, device = self.tok_embeddings.weight.dtype, self.tok_embeddings.weight.device
            self.rope_cos, self.rope_sin = cos.to(device, dtype), sin.to(device, dtype)

    def forward(self, tokens: torch.Tensor, cache, policy, *, all_logits: bool = False, observers=()) -> torch.Tensor:
        """tokens (T,) int64 at positions [cache.length, cache.length + T).

        Returns logits (V,) of the last position, or (T, V) with `all_logits`. A decode step
        (T = 1) calls `observers` (spotlight/observers.py StepObserver) after each layer.
        """
        T = tokens.shape[0]
        tokens = tokens.to(self.tok_embeddings.weight.device)  # no copy when already there
        start = cache.length
        cache.reserve(start + T)
        self.setup_rope(cache.capacity)
        cos, sin = self.rope(start, T)  # (T, D)
        x = self.tok_embeddings(tokens)  # (T, E)
        mask = chunk_mask(x, T, start)  # (T, start + T) or None, built once for every layer
        step, coders = self.fused_step, None
        if T == 1 and step is not None and step.accepts(x, cache):
            # a dense step, or one that only codes its keys (Spotlight below dense_below)
            coders = () if policy.dense_step(start + 1) else policy.step_key_coders(start + 1, cache)
            coders = coders if coders is not None and step.codes(coders, cache) else None
        if coders is not None:
            x = step(x, cos, sin, cache, coders)  # (1, E): every block in one compiled call
            for i in range(len(self.layers)):
                for observer in observers:
                    observer.on_layer(i, step.query(i), cache, None)
        else:
            far = self.far_products is not None and T > 1 and start + T > self.args.max_seq_len
            with self.far_products() if far else contextlib.nullcontext():
                last = len(self.layers) - 1
                for i, block in enumerate(self.layers):
                    # Only the last position's logits are wanted: the last layer's attention output and
                    # MLP run for it alone (its keys and values all enter the cache; ~1/L of a prefill saved).
                    x = block(x, cos, sin, cache, policy, mask, i == last and not all_logits, observers)
        cache.advance(T)
        logits = self.output(self.norm(x))  # (T or 1, V)
        return logits if all_logits else logits[0]

    def rope(self, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, D) of positions [start, start + T): the table's rows within the native
        window, float64-formed angles past it (an fp32 angle of 1M radians is off by 0.06)."""
        inside = max(0, min(start + T, self.rope_cos.shape[0]) - start)
        cos, sin = self.rope_cos[start : start + inside], self.rope_sin[start : start + inside]  # (inside, D)
        if inside == T:
            return cos, sin
        far_cos, far_sin = _far_rope(self.inv_freq, start + inside, start + T, self.rope_cos)  # (T - inside, D)
        return torch.cat([cos, far_cos]), torch.cat([sin, far_sin])


def _far_rope(inv_freq: torch.Tensor, start: int, end: int, like: torch.Tensor):
    """cos, sin (end - start, D) of positions [start, end), angles formed in float64, as `like`."""
    cos, sin = rope_angles(inv_freq.float().cpu(), torch.arange(start, end))
    return cos.to(like.device, like.dtype), sin.to(like.device, like.dtype)


def remap_hf_state(state: dict, args: ModelArgs) -> dict:
    """Rename Hugging Face Llama/Qwen2/Mistral weights to ours, fusing qkv and gate/up."""
    out = {
        "tok_embeddings.weight": state["model.embed_tokens.weight"],
        "norm.weight": state["model.norm.weight"],
    }
    if not args.tie_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    for i in range(args.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn = hf + "self_attn."
        out[ours + "attention_norm.weight"] = state[hf + "input_layernorm.weight"]
        out[ours + "ffn_norm.weight"] = state[hf + "post_attention_layernorm.weight"]
        out[ours + "attention.wqkv.weight"] = torch.cat([state[f"{attn}{p}_proj.weight"] for p in "qkv"])
        if args.qkv_bias:
            out[ours + "attention.wqkv.bias"] = torch.cat([state[f"{attn}{p}_proj.bias"] for p in "qkv"])
        out[ours + "attention.wo.weight"] = state[attn + "o_proj.weight"]
        if args.o_bias:
            out[ours + "attention.wo.bias"] = state[attn + "o_proj.bias"]
        mlp = hf + "mlp."
        out[ours + "feed_forward.w_gate_up.weight"] = torch.cat(
            [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]
        )
        out[ours + "feed_forward.w_down.weight"] = state[mlp + "down_proj.weight"]
        if args.mlp_bias:
            out[ours + "feed_forward.w_gate_up.bias"] = torch.cat(
                [state[mlp + "gate_proj.bias"], state[mlp + "up_proj.bias"]]
            )
            out[ours + "feed_forward.w_down.bias"] = state[mlp + "down_proj.bias"]
    return out


def build_model(args: ModelArgs, hf_state: dict, *, dtype=torch.float32, device="cpu") -> Transformer:
    """Instantiate without random init, load the remapped weights, switch to eval mode."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    state = remap_hf_state(hf_state, args)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (args.tie_embeddings and m == "output.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.inv_freq = rope_inv_freq(args)
    return model.to(dtype=dtype).eval().requires_grad_(False)
