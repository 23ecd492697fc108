"""Plain-Python runtime state of the chat service: the engine gate, cancel flags, warm contexts.

Threading rule (Gradio runs handlers on worker threads; FastAPI routes bypass its queue):
  - `EngineGate` is the one lock around every model call. A reply holds it from its
    first prefill to its last decode step, including while its generator is suspended
    at a `yield`, so two conversations never interleave on the engine; other callers wait.
  - `CancelFlags` gives each running conversation its own `threading.Event`; the engine
    checks it at every decode step and between prefill chunks. A second reply in a
    conversation that is already running is refused (`EngineBusy`), not queued.
  - `TabRuns` records which conversations each browser tab has work running in (an
    upload's reading and prefill), so that the work of a tab that has gone (closed or
    reloaded) is stopped through the same cancel flags.
  - `ContextPool` keeps the KV Contexts of the few most recently used conversations in
    RAM (LRU), so switching back is instant. The disk is the truth: a Context that is
    dropped is restored from span files on next use.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator

from memory import SessionId
from spotlight import Context

from .errors import EngineBusy


class EngineGate:
    """Single-flight access to the engine."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    @contextlib.contextmanager
    def hold(self, session_id: str) -> Iterator[None]:
        """Block until the engine is free, then hold it for the block.

        A thread that already holds it (two replies interleaved in one thread) gets
        `EngineBusy` instead of a deadlock."""
        me = threading.get_ident()
        if self._owner == me:
            raise EngineBusy(
                session_id,
                "this thread is already streaming another reply; finish or close that one first "
                "(the engine runs one reply at a time)",
            )
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


class CancelFlags:
    """One cancel flag per running conversation; at most one run per conversation."""

    def __init__(self):
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, session_id: str) -> Iterator[threading.Event]:
        """Mark the conversation running for the block; `EngineBusy` if it already is."""
        with self._lock:
            if session_id in self._flags:
                raise EngineBusy(session_id)
            flag = self._flags[session_id] = threading.Event()
        try:
            yield flag
        finally:
            with self._lock:
                self._flags.pop(session_id, None)

    def is_running(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._flags

    def cancel(self, session_id: str) -> bool:
        """Ask the conversation's run to stop; False when nothing runs."""
        with self._lock:
            flag = self._flags.get(session_id)
        if flag is None:
            return False
        flag.set()
        return True


class TabRuns:
    """The conversations each browser tab (Gradio's session hash) has work running in."""

    def __init__(self):
        self._runs: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, tab: str | None, session_id: str) -> Iterator[None]:
        """Record `session_id`'s work as `tab`'s for the block (no tab: nothing recorded)."""
        if tab is None:
            yield
            return
        with self._lock:
            self._runs.setdefault(tab, []).append(session_id)
        try:
            yield
        finally:
            with self._lock:
                runs = self._runs.get(tab, [])
                if session_id in runs:
                    runs.remove(session_id)
                if not runs:
                    self._runs.pop(tab, None)

    def of(self, tab: str) -> list[str]:
        """The conversations `tab` has work running in now."""
        with self._lock:
            return list(dict.fromkeys(self._runs.get(tab, [])))


class ContextPool:
    """LRU of in-memory KV Contexts, keyed by conversation."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"the number of contexts kept in memory must be >= 0, got {capacity}")
        self.capacity = capacity
        self._contexts: OrderedDict[str, Context] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_id: SessionId) -> Context | None:
        """The conversation's Context (now the most recently used), or None."""
        with self._lock:
            context = self._contexts.get(session_id)
            if context is not None:
                self._contexts.move_to_end(session_id)
            return context

    def put(self, session_id: SessionId, context: Context) -> None:
        """Keep the Context; the least recently used beyond capacity are dropped."""
        with self._lock:
            self._contexts[session_id] = context
            self._contexts.move_to_end(session_id)
            while len(self._contexts) > self.capacity:
                self._contexts.popitem(last=False)

    def drop(self, session_id: SessionId) -> None:
        with self._lock:
            self._contexts.pop(session_id, None)

    def clear(self) -> None:
        with self._lock:
            self._contexts.clear()

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._contexts
