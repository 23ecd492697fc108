"""What the chat service hands to its callers: plain dataclasses, no engine or store objects.

The UI renders these; it never needs torch, sqlite or the memory package.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memory import DocumentId, MessageId, SessionId

__all__ = ["ChatMessage", "DocumentInfo", "MessageId", "ResumeReport", "SessionId", "SessionInfo", "Source", "Turn"]


@dataclass(slots=True, frozen=True)
class SessionInfo:
    """A conversation in the list."""

    id: SessionId
    title: str
    created: float
    updated: float
    system_prompt: str


@dataclass(slots=True, frozen=True)
class ChatMessage:
    """One message of the visible conversation.

    `branch` / `branches`: this message is alternative number `branch` (0-based) of
    `branches` at its place (edits and regenerations add alternatives).
    `stats`: for assistant messages, the numbers of the turn that produced it.
    """

    id: MessageId
    role: str
    content: str
    parent_id: MessageId | None
    branch: int = 0
    branches: int = 1
    stats: dict = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class DocumentInfo:
    """An attached document (its text stays in the store; the UI shows chips)."""

    id: DocumentId
    name: str
    n_chars: int
    n_tokens: int | None
    pages: int | None = None


@dataclass(slots=True, frozen=True)
class Source:
    """A document passage that received much of an answer's attention (chat/sources.py).

    `weight`: its share of the attention mass the answer put on all attached documents."""

    document: str
    page: int | None
    heading: str | None
    quote: str
    weight: float

    def as_dict(self) -> dict:
        """The shape stored with the assistant message and read by the UI (chat/ui_model.py)."""
        return {"document": self.document, "page": self.page, "heading": self.heading,
                "quote": self.quote, "text": self.quote, "weight": round(self.weight, 4)}


@dataclass(slots=True)
class Turn:
    """A reply in progress (yielded after each generated token) or finished (`finish` set).

    Token counts cover the prompt of this turn: `cached_tokens` were reused (from memory
    or from disk), `prefill_tokens` were computed now (including any span recomputed
    because it was evicted, missing, corrupt or stale); `restored_tokens` of the cached
    ones were loaded from disk this turn. `read_share`: the measured share of the context
    each decode step read, averaged over the turn's steps (None without a decode step).
    `notices` are things the user should be told (a recompute and its reason, a cache that
    could not be saved).
    """

    session_id: SessionId
    text: str = ""
    finish: str | None = None  # None while streaming; "eos" | "stop" | "length" | "cancelled"
    cached_tokens: int = 0
    prefill_tokens: int = 0
    restored_tokens: int = 0
    prefill_tps: float = 0.0
    decode_tokens: int = 0
    decode_tps: float = 0.0
    notices: list[str] = field(default_factory=list)
    user_message_id: MessageId | None = None
    message_id: MessageId | None = None  # the assistant message, once stored
    sources: list[Source] | None = None  # set on the final Turn when the prompt holds documents
    read_share: float | None = None  # mean share of the context a decode step read (spotlight ReadMeter)
    spotlight: bool = False  # decoded with Spotlight attention (else densely)
    regenerated_at: float | None = None  # a regeneration's sampling temperature (chat/config.py)
    seed: int | None = None  # the sampling seed of a regeneration
    # While the documents are read before a reply (an upload stopped or killed part way): (tokens
    # read, tokens to read) and the measured tokens/s; None once the reply runs.
    reading: tuple[int, int] | None = None
    reading_tps: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish is not None

    def stats(self) -> dict:
        """The numbers worth keeping with the assistant message."""
        stats = {
            "finish": self.finish,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens": self.prefill_tokens,
            "restored_tokens": self.restored_tokens,
            "prefill_tps": round(self.prefill_tps, 1),
            "decode_tokens": self.decode_tokens,
            "decode_tps": round(self.decode_tps, 1),
        }
        if self.read_share is not None:
            stats["read_share"] = round(self.read_share, 4)
            stats["spotlight"] = self.spotlight
        if self.regenerated_at is not None:
            stats["regenerated_at"], stats["seed"] = self.regenerated_at, self.seed
        if self.sources:
            stats["sources"] = [source.as_dict() for source in self.sources]
        return stats


@dataclass(slots=True)
class ResumeReport:
    """What `ChatService.resume` did to make a conversation's KV cache ready."""

    session_id: SessionId
    n_tokens: int = 0  # tokens of the conversation now cached
    from_memory: bool = False  # the context was still in RAM: nothing read or computed
    restored_tokens: int = 0  # loaded from span files
    computed_tokens: int = 0  # prefilled now (never stored, evicted, damaged or stale)
    seconds: float = 0.0
    notices: list[str] = field(default_factory=list)
