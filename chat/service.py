"""The chat service: the only place that combines the engine with conversations.

The engine is a shared, single-flight resource: one lock serialises every model call
(Gradio events and any other caller), and each conversation has its own cancel flag,
checked at every decode step and between prefill chunks.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

from spotlight.config import AppConfig
from spotlight.errors import SpotlightError

from .errors import ModelUnavailable


@dataclass
class Turn:
    """What one reply reports besides its text."""

    text: str = ""
    finish: str | None = None
    cached_tokens: int = 0
    prefill_tokens: int = 0
    prefill_tps: float = 0.0
    decode_tokens: int = 0
    decode_tps: float = 0.0


@dataclass
class ChatService:
    config: AppConfig
    _engine: object = None
    _contexts: dict = field(default_factory=dict)  # conversation id -> engine Context
    _cancel: dict = field(default_factory=dict)  # conversation id -> threading.Event
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def engine(self):
        """The engine, loaded on first use (the conversion of the default model runs once)."""
        if self._engine is None:
            from spotlight.engine import Engine

            try:
                self._engine = Engine.load(self.config.engine, self.config.home)
            except SpotlightError as exc:
                raise ModelUnavailable(f"the model could not be loaded: {exc}") from exc
        return self._engine

    def messages(self, history: list[dict], user_text: str) -> list[dict]:
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return system + list(history) + [{"role": "user", "content": user_text}]

    def stop(self, conversation: str) -> None:
        """Ask the running reply of a conversation to stop; it does within one decode step."""
        if conversation in self._cancel:
            self._cancel[conversation].set()

    def reply(self, conversation: str, history: list[dict], user_text: str) -> Iterator[Turn]:
        """Stream a reply: yields the growing Turn after each generated piece of text."""
        engine = self.engine
        cancel = self._cancel[conversation] = threading.Event()
        ids = engine.chat_ids(self.messages(history, user_text))
        turn = Turn()
        with self._lock:
            context = self._contexts.setdefault(conversation, engine.new_context())
            for step in engine.stream(context, ids, self.config.sampling, cancel=cancel):
                turn.text += step.text
                if step.finish:
                    turn.finish = step.finish
                    s = step.stats
                    turn.cached_tokens, turn.prefill_tokens, turn.prefill_tps = (
                        s.cached_tokens, s.prefill_tokens, s.prefill_tps)
                    turn.decode_tokens, turn.decode_tps = s.decode_tokens, s.decode_tps
                yield turn
