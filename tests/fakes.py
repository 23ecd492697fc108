"""A deterministic fake engine for fast UI tests: a real `Engine` that echoes instead of sampling.

`echo_engine(delay=...)` wraps `spotlight.testing.tiny_engine()` (a random 2-layer model with a
byte-level tokenizer, so a token is a byte): prefill, the KV cache, persistence and cancel
are the real code paths of the chat service; only decoding is replaced by a script:

    "Echo: <your last message>"            one word per step, then "eos"
    "/long ..." messages                   "word1 word2 ..." until max_new_tokens ("length")

Each step sleeps `delay` seconds first and checks the cancel flag like the real decode
loop, so Stop can be tested mid-answer. The KV cache is not extended while "decoding"
(the chat service settles it on the stored reply afterwards, exactly as for a real reply).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from spotlight.testing import SPECIAL_TOKENS, tiny_engine
from spotlight.config import SamplingConfig
from spotlight.engine import Engine
from spotlight.generate import Stats, Step, prefill, sync_prompt

LONG_PREFIX = "/long"
_USER_HEADER = [SPECIAL_TOKENS["<|im_start|>"], *b"user\n"]


@dataclass
class EchoEngine(Engine):
    """`Engine` whose decode steps emit a scripted reply (see the module docstring)."""

    delay: float = 0.0
    requests: list = field(default_factory=list)  # (prompt ids, sampling) of every stream call, in order
    prefill_delay: float = 0.0  # seconds slept after each prefill chunk (a slow upload)

    def prefill(self, context, ids: list[int], *, progress=None, cancel: threading.Event | None = None) -> bool:
        """The real chunked prefill (cancel checked between chunks), `prefill_delay` slower a chunk."""
        def slowed(done: int, total: int) -> None:
            time.sleep(self.prefill_delay)
            if progress is not None:
                progress(done, total)
        return super().prefill(context, ids, progress=slowed if self.prefill_delay else progress, cancel=cancel)

    def stream(self, context, prompt_ids: list[int], sampling: SamplingConfig, *,
               cancel: threading.Event | None = None, progress=None, observers=()) -> Iterator[Step]:
        self.requests.append((list(prompt_ids), sampling))
        stats = Stats()
        new_ids = sync_prompt(context, prompt_ids)
        stats.cached_tokens = len(prompt_ids) - len(new_ids)
        started = time.perf_counter()
        logits = prefill(self.model, context, new_ids, self.policy, chunk=self.config.prefill_chunk,
                         cancel=cancel, progress=progress)
        stats.prefill_tokens, stats.prefill_seconds = len(new_ids), time.perf_counter() - started
        if logits is None:
            yield Step(None, "", "cancelled", stats)
            return
        words = scripted_reply(last_user_text(prompt_ids), sampling.max_new_tokens)
        finish, started = "eos", time.perf_counter()
        for index, word in enumerate(words):
            time.sleep(self.delay)
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            stats.decode_tokens += 1
            stats.decode_seconds = time.perf_counter() - started
            yield Step(index, word if index == 0 else " " + word)
        else:
            finish = "length" if len(words) >= sampling.max_new_tokens else "eos"
        stats.decode_seconds = time.perf_counter() - started
        yield Step(None, "", finish, stats)


def last_user_text(prompt_ids: list[int]) -> str:
    """The content of the last user message in a ByteTokenizer chat rendering."""
    for start in range(len(prompt_ids) - len(_USER_HEADER), -1, -1):
        if prompt_ids[start:start + len(_USER_HEADER)] == _USER_HEADER:
            body = prompt_ids[start + len(_USER_HEADER):]
            end = body.index(SPECIAL_TOKENS["<|im_end|>"]) if SPECIAL_TOKENS["<|im_end|>"] in body else len(body)
            return bytes(i for i in body[:end] if i < 256).decode("utf-8", errors="replace")
    return ""


def scripted_reply(user_text: str, max_words: int) -> list[str]:
    """The words the fake answers with (one per decode step, at most `max_words`)."""
    if user_text.startswith(LONG_PREFIX):
        return [f"word{i}" for i in range(1, max_words + 1)]
    return ["Echo:", *user_text.split()][:max_words]


def echo_engine(delay: float = 0.0, *, seed: int = 0, max_seq_len: int = 8192,
                prefill_delay: float = 0.0) -> EchoEngine:
    """A fresh EchoEngine over the tiny random model of `spotlight.testing`."""
    base = tiny_engine(seed=seed, max_seq_len=max_seq_len)
    return EchoEngine(base.config, base.args, base.model, base.tokenizer, base.source, base.policy, delay=delay,
                      prefill_delay=prefill_delay)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a test server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SelectionRecorder:
    """A StepObserver (spotlight/observers.py) that keeps what each decode step selected:
    `steps[i]` maps each sparse layer to a host copy of its (Hkv, K) selection."""

    def __init__(self):
        self.steps: list[dict] = []
        self._current: dict = {}

    def on_layer(self, layer, q, cache, selected) -> None:
        if selected is not None:
            self._current[layer] = (selected.cpu().numpy() if hasattr(selected, "cpu") else selected).copy()

    def on_step(self, n_tokens: int) -> None:
        self.steps.append(self._current)
        self._current = {}
