"""Ids, keys and the records the store's rows become (plain data: no database, no tensors).

Every record is built from a row by its `from_row` classmethod; JSON columns are
decoded there. `SpanKey` is what a span is stored and found under.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NewType

SessionId = NewType("SessionId", str)
MessageId = NewType("MessageId", str)
DocumentId = NewType("DocumentId", str)
SegmentId = NewType("SegmentId", int)
SpanId = NewType("SpanId", str)
PrefixHash = NewType("PrefixHash", str)

PREFIX_DIGEST_HEX = 16  # length of SpanKey.prefix_digest: sha256 hex of the prefix token ids, cut


@dataclass(slots=True, frozen=True)
class SpanKey:
    """What a span's K/V depend on; a span is only ever reused under an equal key.

    model_fp: the model's fingerprint. encoder_fp: the Spotlight encoders' fingerprint,
    "" for dense decode. prefix_digest: the first 16 hex digits of `tokens_sha256` of
    the prefix token ids the span's K/V were computed after ("" when none).
    """

    model_fp: str
    encoder_fp: str
    prefix_digest: str

    def __post_init__(self):
        if not self.model_fp:
            raise ValueError("SpanKey.model_fp must name the model (its fingerprint), got ''")
        if self.prefix_digest and (
            len(self.prefix_digest) != PREFIX_DIGEST_HEX
            or self.prefix_digest.strip("0123456789abcdef")
        ):
            raise ValueError(
                f"SpanKey.prefix_digest must be {PREFIX_DIGEST_HEX} lowercase hex digits "
                f"(tokens_sha256(prefix_ids)[:{PREFIX_DIGEST_HEX}]) or '', got {self.prefix_digest!r}"
            )


LEGACY_PREFIX_MARK = "+prefix:"


def split_legacy_encoder_fp(value: str) -> tuple[str, str]:
    """(encoder_fp, prefix_digest) of an encoder fingerprint as stored before migration m003.

    Until then chat packed the prefix dependency into the encoder fingerprint as
    "<encoder_fp or 'dense'>+prefix:<digest>"; any other value is a plain encoder
    fingerprint with no prefix digest.
    """
    encoder_fp, mark, digest = value.rpartition(LEGACY_PREFIX_MARK)
    if not mark or len(digest) != PREFIX_DIGEST_HEX or digest.strip("0123456789abcdef"):
        return value, ""
    return ("" if encoder_fp == "dense" else encoder_fp), digest


def _load(row: dict, *json_columns: str) -> dict:
    return {**row, **{column: json.loads(row[column]) for column in json_columns}}


@dataclass(slots=True)
class SessionRecord:
    id: SessionId
    title: str
    created: float
    updated: float
    system_prompt: str
    settings: dict
    active_leaf_id: MessageId | None

    @classmethod
    def from_row(cls, row: dict) -> "SessionRecord":
        return cls(**_load(row, "settings"))


@dataclass(slots=True)
class MessageRecord:
    id: MessageId
    session_id: SessionId
    parent_id: MessageId | None
    role: str
    content: str
    created: float
    n_tokens: int | None
    metadata: dict

    @classmethod
    def from_row(cls, row: dict) -> "MessageRecord":
        return cls(**_load(row, "metadata"))


@dataclass(slots=True)
class DocumentRecord:
    """A document snapshot (its text: `Transcript.document_text`)."""

    id: DocumentId
    name: str
    sha256: str
    n_chars: int
    pages: int | None
    n_tokens: int | None
    metadata: dict
    created: float

    @classmethod
    def from_row(cls, row: dict) -> "DocumentRecord":
        return cls(**_load({key: value for key, value in row.items() if key != "text"}, "metadata"))


@dataclass(slots=True)
class SegmentSpec:
    """A segment to store: characters [char_start, char_end) of its document's text."""

    char_start: int
    char_end: int
    page: int | None = None
    heading: str | None = None
    n_tokens: int | None = None


@dataclass(slots=True)
class SegmentRecord:
    id: SegmentId
    document_id: DocumentId
    ordinal: int
    char_start: int
    char_end: int
    page: int | None
    heading: str | None
    n_tokens: int | None


@dataclass(slots=True)
class SpanRecord:
    """One span's row. state 'ready' means its file exists; 'evicted' means recompute it."""

    id: SpanId
    state: str
    file: str | None
    owner: str  # 'prefix' | 'message'
    prefix_hash: PrefixHash | None
    message_id: MessageId | None
    session_id: SessionId | None
    ordinal: int
    segment_id: SegmentId | None
    model_fp: str
    encoder_fp: str  # "" for dense
    prefix_digest: str  # "" when the K/V depend on no prefix
    dtype: str
    n_tokens: int
    start_pos: int
    tokens_sha256: str
    bytes: int
    checksum: str | None
    created: float
    last_used: float

    @property
    def end_pos(self) -> int:
        """One past the last token position this span covers."""
        return self.start_pos + self.n_tokens

    @property
    def key(self) -> SpanKey:
        return SpanKey(self.model_fp, self.encoder_fp, self.prefix_digest)


@dataclass(slots=True)
class PrefixRecord:
    hash: PrefixHash
    model_fp: str
    encoder_fp: str
    prefix_digest: str
    n_tokens: int | None
    complete: bool
    created: float
    spans: list[SpanRecord]

    @classmethod
    def from_row(cls, row: dict, spans: list[SpanRecord]) -> "PrefixRecord":
        return cls(**{**row, "complete": bool(row["complete"])}, spans=spans)

    @property
    def key(self) -> SpanKey:
        return SpanKey(self.model_fp, self.encoder_fp, self.prefix_digest)


@dataclass(slots=True)
class CacheSize:
    """Disk used by one session's spans: its own, and prefixes it shares with other sessions."""

    session_bytes: int
    shared_bytes: int
    ready_spans: int
    evicted_spans: int
