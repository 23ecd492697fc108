"""The selectors bench/quality.py compares, the caches they decode from, and the retrieval probe.

Shape legend: L layers, H query heads, Hkv KV heads, G = H / Hkv, D head dim, N cached tokens
(n valid), K selected tokens per KV head, W packed code words.

Every method is a selector plugged into the same `SpotlightDecode` path (same sinks, window,
dense layers and budget accounting, `kernels.selection_layout`): only the choice of the
retrieved tokens differs. Code methods (Spotlight trained / untrained, SimHash, learned
linear hash) differ only in their encoders; their key codes are computed by the selector's
own `on_new_tokens`, exactly as during a prefill.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import kernels
from spotlight.attention import CodeSelector, OracleSelector, QuestSelector, SinkWindowSelector, sparse_decode
from spotlight.cache import KVCache, code_cache_shape
from spotlight.hashing import EncoderSpec, Encoders, load_encoders
from spotlight.model import dense_decode
from spotlight.train import tie_hyperplanes

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / ".cache" / "quality"  # trained baseline encoders (linear hash, other bit counts)


@dataclass
class Method:
    """A named selector and what it is (family, code bits) for tables and plots."""

    name: str
    selector: object
    family: str  # spotlight | untrained | simhash | linear | quest | window | oracle
    bits: int | None = None

    @property
    def code_words(self) -> int:
        return getattr(self.selector, "code_words", 0)


def code_method(name: str, family: str, encoders: Encoders) -> Method:
    return Method(name, CodeSelector(encoders.eval().requires_grad_(False)), family, encoders.spec.bits)


def build_methods(args, trained: Encoders, *, simhash_bits=(128, 640), extra_bits=(), seed: int = 0) -> dict:
    """All selectors of the comparison, by name. Trained baselines join when their files exist."""
    def untrained(bits, **kw):
        return tie_hyperplanes(Encoders(EncoderSpec.for_model(args, bits, **kw), seed=seed))

    methods = [code_method(f"Spotlight-{trained.spec.bits} trained", "spotlight", trained),
               code_method(f"Spotlight-{trained.spec.bits} untrained", "untrained", untrained(trained.spec.bits))]
    for bits in sorted(set(simhash_bits) | set(extra_bits)):
        methods.append(code_method(f"SimHash-{bits}", "simhash", untrained(bits, depth=0, init="random")))
    for path in sorted(BASELINES.glob("*.safetensors")):
        encoders = load_encoders(path)
        family = "linear" if encoders.spec.depth == 0 else "spotlight"
        if family == "spotlight" and encoders.spec.bits == trained.spec.bits:
            continue  # the shipped checkpoint is the Spotlight row at this bit count
        label = "Linear" if family == "linear" else "Spotlight"
        methods.append(code_method(f"{label}-{encoders.spec.bits} trained", family, encoders))
    methods += [Method("Quest (pages of 16)", QuestSelector(page=16), "quest"),
                Method("sinks + window only", SinkWindowSelector(), "window"),
                Method("exact top-k (oracle)", OracleSelector(), "oracle")]
    return {m.name: m for m in methods}


# ----------------------------------------------------------------------------- caches


def cache_for(method: Method | None, base: KVCache, capacity: int) -> KVCache:
    """A cache holding base's first `base.length` tokens (K, V) plus this method's key codes."""
    args, n = base.args, base.length
    cache = KVCache(args, capacity, dtype=base.dtype, code_words=method.code_words if method else 0)
    codes = None
    if method is not None and method.code_words:
        codes = np.zeros(code_cache_shape(args, method.code_words, n), dtype=np.uint64)  # (L, Hkv, W, n)
        view = _CodesView(None, codes, length=0)
        with torch.inference_mode():
            for layer in range(args.n_layers):
                method.selector.on_new_tokens(layer, None, base.k[layer, :, :n], view)
    cache.load(base.k[:, :, :n], base.v[:, :, :n], codes)
    return cache


class _CodesView:
    """A cache as one selector sees it: the shared K/V and length, its own code buffer."""

    def __init__(self, base, codes, length: int | None = None):
        self.base, self.codes, self._length = base, codes, length

    @property
    def length(self) -> int:
        return self._length if self._length is not None else self.base.length

    @property
    def k(self):
        return self.base.k

    @property
    def v(self):
        return self.base.v

    @property
    def args(self):
        return self.base.args


# ----------------------------------------------------------------------------- retrieval probe


class RetrievalProbe:
    """A dense decode policy that scores every method's selection at every step and layer.

    Prefill feeds every code method's key codes (into its own buffer); each decode step
    returns dense attention (so the text follows the dense model) after comparing, per
    layer and budget, each method's selected set with the exact top-k (OracleSelector):
    recall@k and IoU over the retrieved tokens, attention-mass recall over the whole set
    (sinks + window + retrieved) and the relative error of the attention output. Recall is also
    counted apart for the exact top keys at least `far` tokens before the query (pooled over heads
    and steps): the distant facts a question about the start of a long document needs, which an
    average over all top keys, most of them recent, hides.
    """

    code_words = 0

    def __init__(self, methods: dict, budgets: tuple[float, ...], sinks: int, window: int, capacity: int, args,
                 far: int = 2048):
        self.methods, self.budgets, self.sinks, self.window, self.far = methods, budgets, sinks, window, far
        self.codes = {name: np.zeros(code_cache_shape(args, m.code_words, capacity), dtype=np.uint64)
                      for name, m in methods.items() if m.code_words}
        self.oracle = OracleSelector()
        # (method, budget, layer) -> [recall, iou, mass, error, count, far hits, far top keys]
        self.sums: dict[tuple, np.ndarray] = {}
        self.steps = 0

    def view(self, name: str, cache):
        return _CodesView(cache, self.codes[name]) if name in self.codes else cache

    def on_new_tokens(self, layer, q, k, cache) -> None:
        for name, method in self.methods.items():
            method.selector.on_new_tokens(layer, q, k, self.view(name, cache))

    def dense_step(self, n_tokens: int) -> bool:
        return False  # each layer's decode scores the methods' selections

    def step_key_coders(self, n_tokens: int, cache) -> None:
        return None

    def decode(self, layer: int, q: torch.Tensor, cache) -> torch.Tensor:
        n = cache.length + 1
        H, _, D = q.shape
        k_all, v_all = cache.k[layer, :, :n], cache.v[layer, :, :n]  # (Hkv, n, D)
        Hkv = k_all.shape[0]
        dense = dense_decode(q, k_all, v_all)  # (H, 1, D)
        prob = (q.view(Hkv, H // Hkv, D) @ k_all.transpose(1, 2) / D**0.5).softmax(-1)  # (Hkv, G, n)
        if layer == 0:
            self.steps += 1
        for budget in self.budgets:
            retrieved = max(1, int(budget * n))
            layout = kernels.selection_layout(n, retrieved, self.sinks, self.window)
            middle = slice(layout.sinks_end, layout.sinks_end + layout.retrieved)
            exact = torch.as_tensor(self.oracle.select(layer, q, cache, n, retrieved, self.sinks, self.window))
            in_exact = torch.zeros(Hkv, n, dtype=torch.bool).scatter_(1, exact[:, middle].long(), True)  # (Hkv, n)
            far = in_exact.clone()
            far[:, max(n - self.far, 0):] = False  # (Hkv, n) exact top keys >= self.far tokens back
            far_total = float(far.sum())
            for name, method in self.methods.items():
                idx = exact if method.family == "oracle" else torch.as_tensor(
                    method.selector.select(layer, q, self.view(name, cache), n, retrieved, self.sinks, self.window))
                idx = idx.long()  # (Hkv, K)
                hits = in_exact.gather(1, idx[:, middle]).sum(1).float()  # (Hkv,)
                far_hits = far.gather(1, idx[:, middle]).sum()
                size = max(layout.retrieved, 1)
                mass = prob.gather(2, idx[:, None, :].expand(-1, H // Hkv, -1)).sum(-1)  # (Hkv, G)
                out = sparse_decode(q, cache.k[layer], cache.v[layer], idx)  # (H, 1, D)
                error = (out - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-12)  # (H, 1)
                row = np.array([float((hits / size).mean()), float((hits / (2 * size - hits)).mean()),
                                float(mass.mean()), float(error.mean()), 1.0, float(far_hits), far_total])
                key = (name, budget, layer)
                self.sums[key] = self.sums.get(key, 0) + row
        return dense

    def summary(self) -> dict:
        """(method, budget, layer) -> {recall, iou, mass, error} averaged over steps, and far: the
        recall of the distant top keys (nan where no step had any)."""
        out = {}
        for key, (recall, iou, mass, error, count, far_hits, far_total) in self.sums.items():
            out[key] = {"recall": recall / count, "iou": iou / count, "mass": mass / count, "error": error / count,
                        "far": far_hits / far_total if far_total else float("nan")}
        return out
