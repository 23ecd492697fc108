"""Persistent KV memory: save a conversation's cache as spans, restore it into a fresh Context.

Shape legend: L layers, Hkv KV heads, T tokens of a span, D head dim, W code words.

Keys. A span is stored under the engine's model fingerprint and a *span encoder
fingerprint* = the engine's encoder fingerprint ("dense" without codes) joined with a
digest of the conversation's prefix ids. Message K/V depend on everything before them,
prefix included; the store keys message spans by (message, model fp, encoder fp), so
tagging the fingerprint with the prefix gives a conversation whose prefix changed
(document attached later, system prompt edited) fresh slots instead of stale ones. The
prefix itself is content-addressed: `prefix_hash(prefix ids, model fp, span encoder
fp)` is the same in every conversation with the same system prompt and documents.

Restore (`SpanCache.restore`): map the chain (`Store.session_chain`), pin it, and for
each span in order check fingerprints and checksum (`read_span`) and that its token ids
equal the rendered conversation at its positions; load it with `KVCache.load`. A span
that is evicted, missing, corrupt, or stored with another dtype is recomputed in place
(prefill of exactly its tokens), written back with `refill_span`, and reported in a
notice; a span whose tokens differ ends the restore there (also reported). Nothing
that fails a check is ever loaded.

Save: `plan()` lays the rendered conversation out in parts (the stored chain, then the
prefix spans missing by ordinal, then every message after the chain's end), `snapshot()`
copies the tensors of those not stored yet out of the Context (under the engine lock),
`write()` stores them (outside it). Long parts are split into spans of `SPAN_TOKENS`.

Segments (DESIGN.md §6). Every span is one segment of the KV cache's segment table
(`Context.mark_span`, spotlight/twolevel.py), the unit two-level retrieval picks first. The
prefix is cut where a document segment ends (`prefix_layout`, chat/documents.py
`segment_ends`), so each document segment is its own span, with its own code table and
the summary of its codes (`code_summary`, stored in the span file); each message is its
own span. A restore registers every span it loads (with the stored summary) or recomputes;
`snapshot()` registers every part of the layout, stored earlier or not. So a Context has
the same segment table whether it was restored from disk or computed.

    prefix:  [ template + prompt + <document> + seg 0 | seg 1 | ... | seg S-1 + </document> ... ]
    then:    [ message | message | ... ]   each part longer than SPAN_TOKENS cut into blocks
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import memory
from memory import MessageId, PrefixHash, SessionId, SpanRecord, SpanTensors, Store
from spotlight import Context, KVRows
from spotlight.generate import prefill

from .documents import segment_ends

SPAN_TOKENS = 2048  # tokens per span file: a 2048-token SmolLM2 span is ~90 MiB in fp32
_LAYOUTS_KEPT = 8  # prefix layouts memoised per SpanCache (one per recently stored prefix)
_REASONS = {
    "evicted": "their cached tensors had been evicted to stay within the disk budget",
    "missing": "their cache file was missing (deleted outside Spotlight Chat?)",
    "corrupt": "their cache file was corrupt (size, checksum or header did not match)",
    "fingerprint": "their cache was computed by another model or encoder",
    "dtype": "their cache was stored in another precision",
}


def encoder_fingerprint(engine) -> str:
    """Fingerprint of the Spotlight encoders that produced the key codes ("" for dense decode)."""
    if not getattr(engine.policy, "code_words", 0):
        return ""
    return engine.policy.selector.encoders.fingerprint


@dataclass(slots=True, frozen=True)
class CacheKey:
    """The fingerprints a conversation's spans are stored under (see the module docstring)."""

    model_fp: str
    encoder_fp: str  # the engine's encoder fingerprint, "" for dense
    prefix_digest: str

    @classmethod
    def for_engine(cls, engine, prefix_ids: list[int]) -> "CacheKey":
        digest = memory.tokens_sha256(list(prefix_ids))[:16]
        return cls(engine.fingerprint, encoder_fingerprint(engine), digest)

    @property
    def span_encoder_fp(self) -> str:
        return f"{self.encoder_fp or 'dense'}+prefix:{self.prefix_digest}"

    @property
    def fps(self) -> dict:
        """The keyword arguments the store's span calls take."""
        return {"model_fp": self.model_fp, "encoder_fp": self.span_encoder_fp}

    def prefix_hash(self, prefix_ids: list[int]) -> PrefixHash:
        return memory.prefix_hash(prefix_ids, self.model_fp, self.span_encoder_fp)


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


@dataclass(slots=True)
class Pending:
    """A part with its tensors copied out of the Context, ready to write."""

    part: Part
    tensors: SpanTensors


def chunks(start: int, end: int, size: int = SPAN_TOKENS) -> list[tuple[int, int]]:
    """[start, end) cut into runs of at most `size` tokens."""
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def prefix_layout(prefix_len: int, segment_ends: list[int]) -> list[tuple[int, int]]:
    """The prefix's spans: [0, prefix_len) cut where a document segment ends (ascending; the last
    span runs on to the prefix's end, closing template tokens included), then in SPAN_TOKENS runs."""
    edges = [0, *(end for end in segment_ends[:-1] if 0 < end < prefix_len), prefix_len]
    return [run for start, end in zip(edges, edges[1:]) for run in chunks(start, end)]


def span_tensors(context: Context, start: int, end: int) -> SpanTensors:
    """Copies of rows [start, end) of the context (`Context.rows`) as the store takes them."""
    rows = context.rows(start, end)
    return SpanTensors(k=rows.k, v=rows.v, token_ids=torch.tensor(rows.token_ids, dtype=torch.long),  # (T,)
                       key_codes=rows.key_codes, code_summary=rows.code_summary)


class SpanCache:
    """Moves one engine's Contexts to and from the store. Call restore/snapshot under the
    engine lock (they run the model or read its cache); plan/write need no lock."""

    def __init__(self, store: Store, engine):
        self.store = store
        self.engine = engine
        self.dtype_name = str(engine.model.tok_embeddings.weight.dtype).removeprefix("torch.")
        self._layouts: OrderedDict[PrefixHash, list[tuple[int, int]]] = OrderedDict()

    # ------------------------------------------------------------------ restore

    def restore(
        self, session_id: SessionId, ids: list[int], key: CacheKey, prefix_len: int, *,
        cancel=None, capacity: int | None = None,
    ) -> tuple[Context, Restored]:
        """A new Context (room for `capacity` tokens, default len(ids) + 1) holding the
        longest verified stored prefix of `ids`."""
        started = time.perf_counter()
        context = self.engine.new_context(max(capacity or 0, len(ids) + 1))
        report = Restored()
        chain = self._chain(session_id, key, ids, prefix_len)
        with self.store.pin([span.id for span in chain]):
            for span in chain:
                if not self._restore_span(context, span, ids, key, report, cancel):
                    break
        report.seconds = time.perf_counter() - started
        report.notices += _notices(report)
        return context, report

    def _chain(self, session_id, key: CacheKey, ids: list[int], prefix_len: int) -> list[SpanRecord]:
        prefix_hash = key.prefix_hash(ids[:prefix_len]) if prefix_len else None
        if prefix_hash is not None and self.store.find_prefix(prefix_hash) is None:
            return []  # no prefix stored: message spans cannot start at position 0
        return self.store.session_chain(session_id, **key.fps, prefix_hash=prefix_hash)

    def _restore_span(self, context, span: SpanRecord, ids, key, report: Restored, cancel) -> bool:
        """Load or recompute one span; False when the restore must stop here."""
        if span.start_pos != len(context.tokens) or span.start_pos >= len(ids):
            return False
        expected = ids[span.start_pos : span.end_pos]
        if len(expected) != span.n_tokens or memory.tokens_sha256(expected) != span.tokens_sha256:
            self._load_matching_head(context, span, expected, key, report)
            return False
        reason = "dtype" if span.dtype != self.dtype_name else None
        data = None
        if reason is None:
            try:
                data = self.store.read_span(span.id, **key.fps).to_torch()
            except memory.SpanUnavailable as error:
                reason = _reason(error)
            except memory.FingerprintMismatch:
                reason = "fingerprint"
        if data is not None and data.token_ids.tolist() == expected:
            _load(context, data, len(expected))
            summary = data.code_summary.numpy() if data.code_summary is not None else None  # (L, Hkv, B)
            context.mark_span(span.start_pos, span.end_pos, summary)
            report.restored += len(expected)
            return True
        return self._recompute(context, span, expected, key, report, reason or "corrupt", cancel)

    def _load_matching_head(self, context, span, expected, key, report: Restored) -> None:
        """Load the rows of `span` whose token ids still match `expected`, then stop the
        restore. The span may simply run past the rendering (a reply being regenerated);
        a real difference (template or tokenizer changed) is reported."""
        try:
            data = self.store.read_span(span.id, **key.fps).to_torch()
        except (memory.SpanUnavailable, memory.FingerprintMismatch):
            return  # the rows cannot be used; what follows is prefilled
        stored = data.token_ids.tolist()
        overlap = min(len(stored), len(expected))
        n = next((i for i in range(overlap) if stored[i] != expected[i]), overlap)
        if n < overlap:
            report.stopped_at = span.start_pos + n
        if n and span.dtype == self.dtype_name:
            _load(context, data, n)
            report.restored += n

    def _recompute(self, context, span, expected, key, report: Restored, reason: str, cancel) -> bool:
        """Prefill exactly the span's tokens and store them back (refill_span)."""
        engine = self.engine
        start = len(context.tokens)
        prefill(engine.model, context, expected, engine.policy, chunk=engine.config.prefill_chunk, cancel=cancel)
        if len(context.tokens) != start + len(expected):
            return False  # cancelled: the context stays consistent up to what was computed
        context.mark_span(start, start + len(expected))
        report.recomputed += len(expected)
        report.recomputed_by_reason[reason] = report.recomputed_by_reason.get(reason, 0) + len(expected)
        try:
            self.store.refill_span(span.id, span_tensors(context, start, start + len(expected)), **key.fps)
        except (memory.StoreError, ValueError) as error:
            report.notices.append(f"Could not store the recomputed cache again ({error}).")
        return True

    # ------------------------------------------------------------------ save

    def plan(
        self,
        session_id: SessionId,
        key: CacheKey,
        ids: list[int],
        prefix_len: int,
        message_ids: list[MessageId],
        message_end: Callable[[int, int], int],
    ) -> list[Part]:
        """The rendered conversation `ids` in parts, by position: the spans of the session's
        chain (`stored`), then the prefix spans missing by ordinal (`prefix_layout`), then a
        span (or SPAN_TOKENS blocks) per message after the chain's end.

        `message_end(i, floor)` is the end position of message i (see chat.render)."""
        chain = self._chain(session_id, key, ids, prefix_len)
        parts = [_stored(span) for span in chain if span.end_pos <= len(ids)]
        if prefix_len:
            prefix_hash = key.prefix_hash(ids[:prefix_len])
            record = self.store.find_prefix(prefix_hash)
            if record is None or not record.complete:
                have = {span.ordinal for span in record.spans} if record else set()
                layout = self._prefix_layout(session_id, prefix_hash, ids[:prefix_len])
                for ordinal, (start, end) in enumerate(layout):
                    if ordinal not in have:
                        parts.append(Part("prefix", prefix_hash, ordinal, start, end))
        covered: dict[str, int] = {}  # message id -> end position, for messages in the chain
        for span in chain:
            if span.message_id is not None:
                covered[span.message_id] = max(covered.get(span.message_id, 0), span.end_pos)
        position = prefix_len
        for index, message_id in enumerate(message_ids):
            if message_id in covered:
                position = covered[message_id]
                continue
            end = len(ids) if index == len(message_ids) - 1 else message_end(index, position)
            for ordinal, (start, stop) in enumerate(chunks(position, end)):
                parts.append(Part("message", message_id, ordinal, start, stop))
            position = end
        return parts

    def _prefix_layout(self, session_id, prefix_hash: PrefixHash, prefix_ids: list[int]) -> list[tuple[int, int]]:
        """`prefix_layout` of the session's documents in this prefix (memoised by prefix hash)."""
        layout = self._layouts.get(prefix_hash)
        if layout is None:
            texts = [self.store.document_text(document.id) for document in self.store.session_documents(session_id)]
            layout = prefix_layout(len(prefix_ids), segment_ends(self.engine, texts, prefix_ids))
            self._layouts[prefix_hash] = layout
            while len(self._layouts) > _LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
        return layout

    def snapshot(self, context: Context, parts: list[Part]) -> list[Pending]:
        """Copy the rows of each part not stored yet out of the Context, and make every part a
        segment of its cache (call under the engine lock)."""
        pending: list[Pending] = []
        for part in sorted(parts, key=lambda p: p.start):
            summary = None
            if not part.stored:
                pending.append(Pending(part, span_tensors(context, part.start, part.end)))
                summary = pending[-1].tensors.code_summary
            if part.end <= context.cache.length:
                context.mark_span(part.start, part.end, summary)
        return pending

    def write(
        self, session_id: SessionId, key: CacheKey, pending: list[Pending], prefix_ids: list[int]
    ) -> list[str]:
        """Store the pending spans, pinning each written one until all are written; mark a
        fully stored prefix complete. Returns notices (a failed write is one, not an error:
        the transcript is already committed and spans are only a cache)."""
        with contextlib.ExitStack() as pins:
            for item in pending:
                try:
                    record = self._put(session_id, key, item)
                except ValueError:
                    continue  # that slot already holds a span (written by an earlier run)
                except memory.NotFound:
                    return []  # the conversation was deleted meanwhile
                except memory.StoreWriteError as error:
                    return [f"Could not save this conversation's cache ({error}) The conversation "
                            "itself is saved; its cache will be recomputed when needed."]
                pins.enter_context(self.store.pin([record.id]))
        if prefix_ids:
            self._finish_prefix(key.prefix_hash(prefix_ids), len(prefix_ids))
        return []

    def _put(self, session_id, key: CacheKey, item: Pending) -> SpanRecord:
        part = item.part
        if part.owner == "prefix":
            return self.store.put_prefix_span(
                part.owner_id, part.ordinal, item.tensors, **key.fps, start_pos=part.start, session_id=session_id
            )
        return self.store.put_message_span(part.owner_id, part.ordinal, item.tensors, **key.fps, start_pos=part.start)

    def _finish_prefix(self, prefix_hash: PrefixHash, prefix_len: int) -> None:
        """Mark the prefix complete once its spans, by ordinal, tile [0, prefix_len)."""
        record = self.store.find_prefix(prefix_hash)
        if record is None or record.complete:
            return
        position = 0
        for span in record.spans:
            if span.start_pos != position:
                return
            position = span.end_pos
        if position == prefix_len:
            self.store.complete_prefix(prefix_hash, prefix_len)

    def link(self, session_id: SessionId, key: CacheKey, prefix_ids: list[int]) -> None:
        """Record that the session uses its (already stored) prefix."""
        if prefix_ids:
            with contextlib.suppress(memory.PrefixNotFound):
                self.store.link_prefix(session_id, key.prefix_hash(prefix_ids))


def _stored(span: SpanRecord) -> Part:
    """A span of the chain as a part of the layout."""
    owner_id = span.prefix_hash if span.owner == "prefix" else span.message_id
    return Part(span.owner, owner_id, span.ordinal, span.start_pos, span.end_pos, stored=True)


def _load(context: Context, data: memory.SpanFile, n: int) -> None:
    """Append the first n rows of a span read from disk (torch views on the mapped file), tokens included."""
    rows = KVRows(k=data.k, v=data.v, token_ids=data.token_ids.tolist(), key_codes=data.key_codes)
    context.append_rows(rows, n)


def _reason(error: memory.SpanUnavailable) -> str:
    if isinstance(error, memory.SpanEvicted):
        return "evicted"
    if isinstance(error, memory.SpanMissing):
        return "missing"
    return "corrupt"


def _notices(report: Restored) -> list[str]:
    notices = [
        f"Recomputed {n} tokens of this conversation because {_REASONS[reason]}."
        for reason, n in report.recomputed_by_reason.items()
    ]
    if report.stopped_at is not None:
        notices.append(
            f"The stored cache stopped matching the conversation at token {report.stopped_at} "
            "(chat template or tokenizer changed?); the rest is recomputed."
        )
    return notices
