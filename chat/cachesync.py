"""Cache sync: a conversation's KV cache to and from its stored spans (DESIGN.md §5).

Shape legend: L layers, Hkv KV heads, T tokens of a span, D head dim, W code words.

One module plans, restores, verifies and stores a conversation's spans. It reads one
`Rendering` (chat/render.py: ids, prefix length, message ends, document segment ranges)
and talks to the engine only through its front door (`Context.rows`, `Context.append_rows`,
`engine.prefill`, `engine.fingerprints`).

Keys. Every span row has three explicit fingerprints (`memory.SpanKey`): the model's, the
encoders' ("" for dense decode) and `prefix_digest`, the digest of the prefix ids its K/V
depend on (message K/V depend on everything before them, so a conversation whose prefix
changed, a document attached later or the system prompt edited, gets fresh slots). The
prefix itself is content-addressed: `CacheKey.prefix_hash(prefix ids)` is the same in every
conversation with the same system prompt and documents under the same model and encoders.

Layout (`plan`): the prefix is cut where a document segment ends, so each document segment
(cut once at ingest, chat/documents.py) is its own span with its own code table (the key
codes of its tokens) and its segment id. The first span also holds
the template and the system prompt, tags between documents go with the next document's
first segment, the last span runs to the prefix's end. Then one span per message. Anything
longer than SPAN_TOKENS is cut in blocks.

    prefix:  [ template + prompt + <document> + seg 0 | seg 1 | ... | seg S-1 + </document> ... ]
    then:    [ message | message | ... ]

Restore (`restore`): map the session's chain, pin it, and for each span in order check its
fingerprints and checksum (the store does, reading it) and that its token ids equal the
rendering at its positions; append it to a fresh Context. A span that is evicted, missing,
corrupt, or stored in another precision is recomputed in place (prefill of exactly its
tokens) and written back; a span whose tokens differ ends the restore there. Both are
reported in notices; nothing that fails a check is ever loaded.

Store: `snapshot` copies the rows of the parts not stored yet out of the Context (under the
engine gate), `write` stores them (outside it). A slot that is already taken (another run
stored the same span meanwhile) is skipped; a span the store refuses (malformed, or the
disk full) becomes a notice on the turn: the transcript is already committed, spans are a cache.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

import memory
from memory import MessageId, PrefixHash, SessionId, SpanKey, SpanRecord, SpanTensors, Store
from spotlight import Context, KVRows

from .render import Rendering

SPAN_TOKENS = 2048  # tokens per span file at most: a 2048-token SmolLM2 span is ~90 MiB in fp32
_DIGEST_CHARS = 16  # hex characters of the prefix ids' sha256 that key message spans
_REASONS = {
    "evicted": "their cached tensors had been evicted to stay within the disk budget",
    "missing": "their cache file was missing (deleted outside Spotlight Chat?)",
    "corrupt": "their cache file was corrupt (size, checksum or header did not match)",
    "fingerprint": "their cache was computed by another model or encoder",
    "dtype": "their cache was stored in another precision",
}


@dataclass(slots=True, frozen=True)
class CacheKey:
    """The fingerprints a conversation's spans are stored under (see the module docstring)."""

    model_fp: str
    encoder_fp: str  # "" for dense decode
    prefix_digest: str  # of the prefix ids; "" without a prefix

    @classmethod
    def for_engine(cls, engine, prefix_ids: list[int]) -> "CacheKey":
        fingerprints = engine.fingerprints
        digest = memory.tokens_sha256(list(prefix_ids))[:_DIGEST_CHARS] if prefix_ids else ""
        return cls(fingerprints.model, fingerprints.encoders, digest)

    @property
    def span_key(self) -> SpanKey:
        return SpanKey(self.model_fp, self.encoder_fp, self.prefix_digest)

    def prefix_hash(self, prefix_ids: list[int]) -> PrefixHash:
        # NOTE: the hash's inputs are the ones prefixes were stored under since the first
        # store schema (encoders and prefix digest joined in one string), so they are still found.
        return memory.prefix_hash(prefix_ids, self.model_fp, f"{self.encoder_fp or 'dense'}+prefix:{self.prefix_digest}")


@dataclass(slots=True)
class Restored:
    """What a restore loaded (`restored` tokens read from disk, `recomputed` prefilled)."""

    restored: int = 0
    recomputed: int = 0
    seconds: float = 0.0
    recomputed_by_reason: dict[str, int] = field(default_factory=dict)
    stopped_at: int | None = None  # position where stored tokens stopped matching
    notices: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Part:
    """A run [start, end) of the rendered ids to store as one span."""

    owner: str  # "prefix" | "message"
    owner_id: str  # PrefixHash | MessageId
    ordinal: int
    start: int
    end: int
    stored: bool = False  # already a span of the session's chain
    segment_id: str | None = None  # the document segment a prefix span holds (its last one)


@dataclass(slots=True)
class Pending:
    """A part with its rows copied out of the Context, ready to write."""

    part: Part
    tensors: SpanTensors


def chunks(start: int, end: int, size: int = SPAN_TOKENS) -> list[tuple[int, int]]:
    """[start, end) cut into runs of at most `size` tokens."""
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def prefix_layout(rendering: Rendering) -> list[tuple[int, int, str | None]]:
    """The prefix's spans as (start, end, id of the document segment it holds): [0, prefix_len)
    cut where a document segment ends, except the last one (that span runs on to the prefix's
    end, closing tags and template tokens included), then in SPAN_TOKENS runs."""
    n = rendering.prefix_len
    ranges = [r for r in rendering.segments if r.end <= n]
    cuts = [r for r in ranges[:-1] if 0 < r.end < n]
    edges = [0, *(r.end for r in cuts), n]
    owners = [*(r.segment.id for r in cuts), ranges[-1].segment.id if ranges else None]
    return [(s, e, owner) for start, end, owner in zip(edges, edges[1:], owners) for s, e in chunks(start, end)]


def to_span_tensors(rows: KVRows) -> SpanTensors:
    """An engine row copy as the store's span tensors."""
    return SpanTensors(k=rows.k, v=rows.v, token_ids=np.asarray(rows.token_ids, dtype=np.int64),
                       key_codes=rows.key_codes)


def to_rows(span: memory.SpanFile) -> KVRows:
    """A span read back from its mapped file (views, no copy) as engine rows."""
    views = span.to_torch()
    return KVRows(k=views.k, v=views.v, key_codes=span.key_codes, token_ids=span.token_ids.tolist())


class CacheSync:
    """Moves one engine's Contexts to and from the store. Call `restore` and `snapshot` under
    the engine gate (they run the model or read its cache); `plan` and `write` need no gate."""

    def __init__(self, store: Store, engine):
        self.store = store
        self.engine = engine

    def key(self, rendering: Rendering) -> CacheKey:
        return CacheKey.for_engine(self.engine, rendering.prefix_ids)

    # ------------------------------------------------------------------ restore

    def restore(self, session_id: SessionId, rendering: Rendering, *, cancel=None,
                capacity: int | None = None, prefix_only: bool = False) -> tuple[Context, Restored]:
        """A new Context (room for `capacity` tokens, default len(rendering) + 1) holding the
        longest verified stored prefix of the rendering (`prefix_only`: of its prefix spans only,
        for a rendering whose messages are not the conversation's, such as a summary request)."""
        started = time.perf_counter()
        context = self.engine.new_context(max(capacity or 0, len(rendering) + 1))
        report = Restored()
        key = self.key(rendering)
        chain = self._chain(session_id, key, rendering, prefix_only)
        if not chain:
            report.notices += self._fingerprint_notices(session_id, key)
        with self.store.spans.pin([span.id for span in chain]):
            for span in chain:
                if not self._restore_span(context, span, rendering.ids, key, report, cancel):
                    break
        report.seconds = time.perf_counter() - started
        report.notices += _notices(report)
        return context, report

    def _chain(self, session_id, key: CacheKey, rendering: Rendering, prefix_only: bool = False) -> list[SpanRecord]:
        prefix_hash = key.prefix_hash(rendering.prefix_ids) if rendering.prefix_len else None
        if prefix_hash is not None and self.store.spans.find_prefix(prefix_hash) is None:
            return []  # no prefix stored: message spans cannot start at position 0
        chain = self.store.spans.session_chain(session_id, key.span_key, prefix_hash=prefix_hash)
        return [span for span in chain if span.owner == "prefix"] if prefix_only else chain

    def _restore_span(self, context: Context, span: SpanRecord, ids, key: CacheKey, report: Restored,
                      cancel) -> bool:
        """Load or recompute one span; False when the restore must stop here."""
        if span.start_pos != len(context.tokens) or span.start_pos >= len(ids):
            return False
        expected = list(ids[span.start_pos : span.end_pos])
        if len(expected) != span.n_tokens or memory.tokens_sha256(expected) != span.tokens_sha256:
            self._load_matching_head(context, span, expected, key, report)
            return False
        reason = "dtype" if span.dtype != self.engine.fingerprints.kv_dtype else None
        rows = None
        if reason is None:
            try:
                rows = to_rows(self.store.spans.read_span(span.id, key.span_key))
            except memory.SpanUnavailable as error:
                reason = _reason(error)
            except memory.FingerprintMismatch:
                reason = "fingerprint"
        if rows is not None and rows.token_ids == expected:
            context.append_rows(rows)
            report.restored += len(expected)
            return True
        return self._recompute(context, span, expected, key, report, reason or "corrupt", cancel)

    def _load_matching_head(self, context: Context, span: SpanRecord, expected, key: CacheKey,
                            report: Restored) -> None:
        """Append the rows of `span` whose token ids still match `expected`, then stop the
        restore. The span may simply run past the rendering (a reply being regenerated); a
        real difference (template or tokenizer changed) is reported."""
        try:
            rows = to_rows(self.store.spans.read_span(span.id, key.span_key))
        except (memory.SpanUnavailable, memory.FingerprintMismatch):
            return  # the rows cannot be used; what follows is prefilled
        overlap = min(len(rows.token_ids), len(expected))
        n = next((i for i in range(overlap) if rows.token_ids[i] != expected[i]), overlap)
        if n < overlap:
            report.stopped_at = span.start_pos + n
        if n and span.dtype == self.engine.fingerprints.kv_dtype:
            context.append_rows(rows, n)
            report.restored += n

    def _recompute(self, context: Context, span: SpanRecord, expected, key: CacheKey, report: Restored,
                   reason: str, cancel) -> bool:
        """Prefill exactly the span's tokens and store them back."""
        start = len(context.tokens)
        if not self.engine.prefill(context, expected, cancel=cancel):
            return False  # cancelled: the context stays consistent up to what was computed
        rows = context.rows(start, start + len(expected))
        report.recomputed += len(expected)
        report.recomputed_by_reason[reason] = report.recomputed_by_reason.get(reason, 0) + len(expected)
        try:
            self.store.spans.refill_span(span.id, to_span_tensors(rows), key.span_key)
        except memory.StoreError as error:
            report.notices.append(f"Could not store the recomputed cache again ({error}).")
        return True

    def _fingerprint_notices(self, session_id: SessionId, key: CacheKey) -> list[str]:
        """Say so when the conversation's stored cache was computed by another model or encoder."""
        notices = []
        for stored in self.store.spans.session_keys(session_id):
            if stored.model_fp != key.model_fp:
                notice = (f"This conversation's cache was computed with another model (fingerprint "
                          f"{stored.model_fp!r}, now {key.model_fp!r}); it is recomputed, not reused.")
            elif stored.encoder_fp != key.encoder_fp:
                notice = (f"This conversation's cache was computed with other Spotlight encoders (fingerprint "
                          f"{stored.encoder_fp or 'none: dense'!r}, now {key.encoder_fp or 'none: dense'!r}); "
                          "it is recomputed, not reused.")
            else:
                continue
            if notice not in notices:
                notices.append(notice)
        return notices

    # ------------------------------------------------------------------ store

    def plan(self, session_id: SessionId, rendering: Rendering, message_ids: list[MessageId], *,
             prefix_only: bool = False) -> list[Part]:
        """The rendering in parts, by position: the spans of the session's chain (`stored`), the
        prefix spans not stored yet, then a span (or SPAN_TOKENS blocks) per message after the
        chain's end. `message_ids[i]` is the id of the rendering's message i (`prefix_only`: the
        prefix's parts alone, as `restore`)."""
        key = self.key(rendering)
        ids = rendering.ids
        chain = self._chain(session_id, key, rendering, prefix_only)
        parts = [_stored(span) for span in chain if span.end_pos <= len(ids)]
        if rendering.prefix_len:
            parts += self._prefix_parts(key.prefix_hash(rendering.prefix_ids), rendering)
        covered: dict[str, int] = {}  # message id -> end position, for messages in the chain
        for span in chain:
            if span.message_id is not None:
                covered[span.message_id] = max(covered.get(span.message_id, 0), span.end_pos)
        position = rendering.prefix_len
        for index, message_id in enumerate(message_ids):
            if message_id in covered:
                position = covered[message_id]
                continue
            end = len(ids) if index == len(message_ids) - 1 else max(position, rendering.message_ends[index])
            for ordinal, (start, stop) in enumerate(chunks(position, end)):
                parts.append(Part("message", message_id, ordinal, start, stop))
            position = end
        return parts

    def _prefix_parts(self, prefix_hash: PrefixHash, rendering: Rendering) -> list[Part]:
        """The prefix spans not stored yet: after the stored ones (which keep their layout,
        whatever cut them), the current layout's runs, numbered on."""
        record = self.store.spans.find_prefix(prefix_hash)
        if record is not None and record.complete:
            return []
        stored = _contiguous(record.spans) if record is not None else []
        end = stored[-1].end_pos if stored else 0
        parts = []
        for start, stop, segment_id in prefix_layout(rendering):
            if stop > end:
                parts.append(Part("prefix", prefix_hash, len(stored) + len(parts), max(start, end), stop,
                                  segment_id=segment_id))
        return parts

    def snapshot(self, context: Context, parts: list[Part]) -> list[Pending]:
        """Copy the rows of each part not stored yet out of the Context (call under the engine gate)."""
        return [Pending(part, to_span_tensors(context.rows(part.start, part.end)))
                for part in sorted(parts, key=lambda p: p.start) if not part.stored]

    def write(self, session_id: SessionId, rendering: Rendering, pending: list[Pending]) -> list[str]:
        """Store the pending spans (each pinned until all are written), mark a fully stored
        prefix complete and link it to the session. Returns notices for the turn."""
        key = self.key(rendering)
        notices: list[str] = []
        with contextlib.ExitStack() as pins:
            for item in pending:
                try:
                    record = self._put(session_id, key, item)
                except memory.SpanSlotTaken:
                    continue  # stored meanwhile by another run: the same tokens, the same rows
                except memory.NotFound:
                    return []  # the conversation was deleted meanwhile
                except (memory.MalformedSpan, memory.StoreWriteError) as error:
                    notices.append(f"Could not save part of this conversation's cache ({error}). The "
                                   "conversation itself is saved; that part is recomputed when needed.")
                    break  # later spans follow it in the chain: without it they cannot be restored
                pins.enter_context(self.store.spans.pin([record.id]))
        if rendering.prefix_len:
            self._finish_prefix(session_id, key.prefix_hash(rendering.prefix_ids), rendering.prefix_len)
        return notices

    def _put(self, session_id: SessionId, key: CacheKey, item: Pending) -> SpanRecord:
        part = item.part
        if part.owner == "prefix":
            return self.store.spans.put_prefix_span(part.owner_id, part.ordinal, item.tensors, key.span_key,
                                                    start_pos=part.start, session_id=session_id,
                                                    segment_id=part.segment_id)
        return self.store.spans.put_message_span(part.owner_id, part.ordinal, item.tensors, key.span_key,
                                                 start_pos=part.start)

    def _finish_prefix(self, session_id: SessionId, prefix_hash: PrefixHash, prefix_len: int) -> None:
        """Mark the prefix complete once its spans tile [0, prefix_len), and link the session to it."""
        record = self.store.spans.find_prefix(prefix_hash)
        if record is None:
            return
        if not record.complete:
            stored = _contiguous(record.spans)
            if not stored or stored[-1].end_pos != prefix_len:
                return
            self.store.spans.complete_prefix(prefix_hash, prefix_len)
        with contextlib.suppress(memory.PrefixNotFound):
            self.store.spans.link_prefix(session_id, prefix_hash)


def _contiguous(spans: list[SpanRecord]) -> list[SpanRecord]:
    """The spans (by ordinal) that tile [0, e) without a gap."""
    out, position = [], 0
    for span in sorted(spans, key=lambda s: s.ordinal):
        if span.start_pos != position:
            break
        out.append(span)
        position = span.end_pos
    return out


def _stored(span: SpanRecord) -> Part:
    """A span of the chain as a part of the layout."""
    owner_id = span.prefix_hash if span.owner == "prefix" else span.message_id
    return Part(span.owner, owner_id, span.ordinal, span.start_pos, span.end_pos, stored=True)


def _reason(error: memory.SpanUnavailable) -> str:
    if isinstance(error, memory.SpanEvicted):
        return "evicted"
    if isinstance(error, memory.SpanMissing):
        return "missing"
    return "corrupt"


def _notices(report: Restored) -> list[str]:
    notices = [
        f"Recomputed {n:,} tokens of this conversation because {_REASONS[reason]}."
        for reason, n in report.recomputed_by_reason.items()
    ]
    if report.stopped_at is not None:
        notices.append(
            f"The stored cache stopped matching the conversation at token {report.stopped_at:,} "
            "(chat template or tokenizer changed?); the rest is recomputed."
        )
    return notices
