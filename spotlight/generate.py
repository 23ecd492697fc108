"""Chunked prefill, the decode loop, sampling, streaming and cooperative cancel.

Shape legend: T new tokens, V vocabulary.

`Context` pairs a KV cache with the token ids it holds, so a new prompt only prefills
what differs from the cache (multi-turn chat, regenerate, edit); its row API (`rows`,
`append_rows`) is how stored spans leave and enter it. `stream()` yields one
`Step` per generated token with the text it adds; the last step carries the finish
reason and timings.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .cache import KVCache, KVRows
from .config import SamplingConfig
from .errors import ContextTooLong
from .heap import release_freed_memory
from .observers import StepObserver


@dataclass
class Context:
    """A KV cache and the exact token ids whose keys and values it holds."""

    cache: KVCache
    tokens: list[int] = field(default_factory=list)

    def common_prefix(self, ids: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        return n

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on (edit, regenerate)."""
        self.cache.truncate(length)
        del self.tokens[length:]

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` in total (one allocation ahead of appending many rows)."""
        self.cache.reserve(n_tokens)

    def rows(self, start: int, end: int) -> KVRows:
        """Copies of rows [start, end): K/V, token ids, and the key codes when the cache has codes."""
        k, v, codes = self.cache.rows(start, end)  # (L, Hkv, T, D) x2, (L, Hkv, W, T) or None
        return KVRows(k=k, v=v, token_ids=list(self.tokens[start:end]), key_codes=codes)

    def append_rows(self, rows: KVRows, n: int | None = None) -> None:
        """Append the first `n` rows (default all) of `rows`, token ids included. Codes are
        numpy uint64 (or a tensor of the same words) for either device; a cache without codes
        ignores them."""
        n = len(rows) if n is None else n
        if not 0 <= n <= len(rows) or len(rows.token_ids) != len(rows):
            raise ValueError(f"cannot append {n} of {len(rows)} rows holding {len(rows.token_ids)} token ids")
        codes = None if rows.key_codes is None else rows.key_codes[..., :n]  # (L, Hkv, W, n)
        self.cache.load(rows.k[:, :, :n], rows.v[:, :, :n], codes)  # k, v: (L, Hkv, n, D)
        self.tokens.extend(int(token) for token in rows.token_ids[:n])


@dataclass
class Stats:
    """Timings of one `stream` call (on its last Step)."""

    cached_tokens: int = 0  # prompt tokens reused from the cache
    prefill_tokens: int = 0  # prompt tokens computed now
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class Step:
    """One generated token and the text it adds; the last step has `finish` and `stats`."""

    token: int | None
    text: str
    finish: str | None = None  # None while running; "eos" | "stop" | "length" | "cancelled"
    stats: Stats | None = None


ProgressFn = Callable[[int, int], None]  # (tokens done, tokens total)


@torch.inference_mode()
def prefill(
    model, context: Context, ids: list[int], policy, *, chunk: int, alone: int = 1,
    cancel: threading.Event | None = None, progress: ProgressFn | None = None,
) -> torch.Tensor | None:
    """Append `ids` to the context in chunks; logits (V,) of the last token, None if cancelled
    (or `ids` is empty).

    Between chunks the cache is consistent, so a cancelled prefill keeps what it computed. Past
    the model's native window the last `alone` tokens (those of them past the window) run one at
    a time, as decode steps: each selects for its own query instead of sharing its chunk's one
    selection, and the logits that start a reply come from the last one (spotlight/beyond.py,
    SpotlightConfig.far_alone). Inside the window nothing runs alone.
    """
    logits = None
    done = 0
    past_window = len(context.tokens) + len(ids) - context.cache.args.max_seq_len  # ids past the window
    for piece in _pieces(ids, chunk, max(0, min(alone, past_window, len(ids)))):
        if cancel is not None and cancel.is_set():
            return None
        logits = model(torch.tensor(piece, dtype=torch.long), context.cache, policy)  # (V,)
        context.tokens.extend(piece)
        done += len(piece)
        if progress is not None:
            progress(done, len(ids))
    if len(ids) > 1:  # the chunks' freed activations go back to the system before decode
        release_freed_memory()
    return logits


def reply_alone(policy) -> int:
    """How many of the last prompt tokens before a reply run alone past the window (`prefill`'s `alone`)."""
    return policy.spotlight.far_alone if policy.spotlight is not None else 1


def _pieces(ids: list[int], chunk: int, alone: int = 0) -> Iterator[list[int]]:
    """`ids` in chunks of `chunk`, the last `alone` of them each a piece of its own."""
    body = len(ids) - alone
    for start in range(0, body, chunk):
        yield ids[start : min(start + chunk, body)]
    for at in range(body, len(ids)):
        yield ids[at : at + 1]


def sync_prompt(context: Context, ids: list[int]) -> list[int]:
    """Truncate the cache to its common prefix with `ids`; return the ids still to prefill.

    At least the last prompt token is always recomputed, because its logits start decoding.
    """
    keep = min(context.common_prefix(ids), len(ids) - 1)
    context.truncate(keep)
    return ids[keep:]


class Sampler:
    """Repetition penalty, temperature, top-k, top-p; greedy when temperature is 0."""

    def __init__(self, config: SamplingConfig, vocab_size: int, prompt_ids: list[int]):
        self.config = config
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # (V,) tokens seen so far
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.generator = torch.Generator()
        self.generator.manual_seed(config.seed if config.seed is not None else int(time.time_ns() % 2**63))

    def __call__(self, logits: torch.Tensor) -> int:
        c = self.config
        logits = logits.float().cpu()  # (V,) sampling runs on the host (a no-op for fp32 CPU logits)
        if c.repetition_penalty != 1.0:
            penalised = torch.where(logits < 0, logits * c.repetition_penalty, logits / c.repetition_penalty)
            logits = torch.where(self.seen, penalised, logits)  # (V,)
        if c.greedy:
            token = int(logits.argmax())
        else:
            token = self._sample(logits / c.temperature)
        self.seen[token] = True
        return token

    def _sample(self, logits: torch.Tensor) -> int:
        c = self.config
        if c.top_k and c.top_k < logits.shape[0]:
            kth = torch.topk(logits, c.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if c.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)  # (V,)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= c.top_p  # keep the token that crosses top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextStream:
    """Incremental detokenisation that holds back partial characters and partial stop strings."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""

    def add(self, token: int) -> tuple[str, bool]:
        """Add a token; return (new text safe to show, whether a stop string was hit)."""
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop_strings:
            at = self.text.find(stop)
            if at != -1:
                self.text = self.text[:at]
                return self._flush(len(self.text)), True
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            safe = min(safe, len(self.text) - 1)
        return self._flush(safe), False

    def finish(self) -> str:
        return self._flush(len(self.text))

    def _flush(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        piece = self.text[self.emitted : upto]
        self.emitted = upto
        return piece


def stream(
    model, tokenizer, context: Context, prompt_ids: list[int], policy, sampling: SamplingConfig,
    *, eos_ids: set[int], max_context: int, chunk: int = 512,
    cancel: threading.Event | None = None, progress: ProgressFn | None = None,
    observers: Sequence[StepObserver] = (),
) -> Iterator[Step]:
    """Prefill what the cache lacks of `prompt_ids`, then decode token by token; every decode
    step reports to `observers` (spotlight/observers.py)."""
    if len(prompt_ids) >= max_context:
        raise ContextTooLong(
            f"the prompt has {len(prompt_ids):,} tokens but at most {max_context:,} fit this conversation; "
            f"shorten the document or the conversation"
        )
    stats = Stats()
    new_ids = sync_prompt(context, prompt_ids)
    stats.cached_tokens = len(prompt_ids) - len(new_ids)
    started = time.perf_counter()
    logits = prefill(model, context, new_ids, policy, chunk=chunk, alone=reply_alone(policy), cancel=cancel,
                     progress=progress)
    stats.prefill_tokens, stats.prefill_seconds = len(new_ids), time.perf_counter() - started
    if logits is None:
        yield Step(None, "", "cancelled", stats)
        return
    yield from _decode(model, tokenizer, context, logits, policy, sampling, eos_ids, max_context, cancel, stats,
                       tuple(observers))


@torch.inference_mode()
def _decode(model, tokenizer, context, logits, policy, sampling, eos_ids, max_context, cancel, stats, observers):
    sampler = Sampler(sampling, logits.shape[-1], context.tokens)
    text = TextStream(tokenizer, sampling.stop_strings)
    token_buf = torch.zeros(1, dtype=torch.long)  # (1,) reused every step
    started = time.perf_counter()
    finish = "length"
    for _ in range(sampling.max_new_tokens):
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        token = sampler(logits)
        stats.decode_tokens += 1
        if token in eos_ids:
            finish = "eos"
            break
        piece, stopped = text.add(token)
        if stopped:
            yield Step(token, piece)
            finish = "stop"
            break
        if len(context.tokens) + 1 >= max_context:
            yield Step(token, piece)
            finish = "length"
            break
        # NOTE: the token is shown before the model runs on it: the first token of a reply
        # appears right after the prefill, without waiting for a decode step.
        stats.decode_seconds = time.perf_counter() - started
        yield Step(token, piece)
        token_buf[0] = token
        logits = model(token_buf, context.cache, policy, observers=observers)  # (V,)
        context.tokens.append(token)
        for observer in observers:
            observer.on_step(len(context.tokens))
    stats.decode_seconds = time.perf_counter() - started
    yield Step(None, text.finish(), finish, stats)
