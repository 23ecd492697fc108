"""Running the engine for a conversation: one reply, or a resume, with persistent KV memory.

A reply (`TurnRunner.reply`), all under the engine gate:
  1. render the visible conversation + generation prompt (chat.render);
  2. take the conversation's warm Context, or restore one from its spans (chat.kv);
  3. stream: the engine keeps the common prefix, prefills the rest, decodes;
  4. commit the assistant message (the caller's `store_reply`);
  5. canonicalise: render the conversation with the reply and bring the Context to
     exactly those ids (truncate where the generated ids differ from the re-tokenised
     reply, prefill the difference: at least the end-of-turn tokens);
  6. copy the parts that have no span yet out of the Context;
then, outside the gate, write those spans and yield the final Turn. So the stored
chain always equals what `engine.chat_ids(messages)` renders for the conversation.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from memory import MessageId, MessageRecord, SessionId, Store
from spotlight.config import SamplingConfig
from spotlight.generate import Context, prefill

from .kv import CacheKey, Restored, SpanCache
from .reads import measuring, uses_spotlight
from .records import ResumeReport, Turn
from .render import Conversation, Renderer
from .runtime import ContextPool, EngineGate
from .sources import SourceTracker

_END_OF_TURN_ROOM = 16  # tokens: the end-of-turn marker that settling appends after a reply
StoreReply = Callable[[str, dict], MessageRecord]  # (content, stats) -> the committed assistant message


@dataclass(slots=True)
class ReplyPlan:
    """A reply to generate: the conversation to continue (ending with a user message), the
    ids of its messages, and how to commit the reply (new message or regenerated sibling)."""

    session_id: SessionId
    conversation: Conversation
    message_ids: list[MessageId]
    store_reply: StoreReply
    sources: bool = True  # tally the reply's attention over attached documents (chat/sources.py)


@dataclass(slots=True)
class _Prepared:
    """A Context brought up to date for a rendering, with what it took."""

    context: Context
    key: CacheKey
    prefix_ids: list[int]
    restored: Restored | None  # None: the Context was already in memory


class TurnRunner:
    """Runs replies and resumes on one engine against one store."""

    def __init__(self, engine, store: Store, sampling: SamplingConfig, pool: ContextPool, gate: EngineGate):
        self.engine = engine
        self.store = store
        self.sampling = sampling
        self.pool = pool
        self.gate = gate
        self.renderer = Renderer(engine)
        self.spans = SpanCache(store, engine)
        self._linked: set[tuple[str, str]] = set()  # (session, prefix hash) linked by this process

    def check_fits(self, conversation: Conversation) -> None:
        """`ContextTooLong` unless the conversation's prompt leaves room for a reply token."""
        self.engine.check_fits(len(self.renderer.prompt(conversation)), 1)

    # ------------------------------------------------------------------ reply

    def reply(self, plan: ReplyPlan, turn: Turn, cancel) -> Iterator[Turn]:
        """Stream the reply: yields `turn` after every generated token, then once more finished.

        Closing the generator early (a UI that stops listening) counts as a stop: the text
        generated so far is stored as the reply, like after `stop()`."""
        prompt = self.renderer.prompt(plan.conversation)
        closed = False
        with self.gate.hold(plan.session_id):
            # the decode loop stops at the model's window, so no room beyond it is needed up front
            capacity = min(len(prompt) + self.sampling.max_new_tokens + _END_OF_TURN_ROOM, self.engine.max_context)
            prepared = self._prepare(plan.session_id, plan.conversation, prompt, cancel, capacity)
            self._report_restore(turn, prepared.restored)
            prepared.context.cache.reserve(capacity)
            tracker = SourceTracker.for_prompt(self.engine, plan.conversation.system, prompt) if plan.sources else None
            with measuring(self.engine) as meter:
                if tracker is not None:
                    tracker.start()
                try:
                    for step in self.engine.stream(prepared.context, prompt, self.sampling, cancel=cancel):
                        turn.text += step.text
                        if step.finish is None:
                            yield turn
                            continue
                        _fill_stats(turn, step.finish, step.stats, prepared.restored)
                except GeneratorExit:
                    closed, turn.finish = True, "cancelled"
                    cancel.set()
                finally:
                    if tracker is not None:
                        tracker.stop()
            turn.read_share, turn.spotlight = meter.share(), uses_spotlight(self.engine)
            if tracker is not None and turn.text:
                turn.sources = tracker.sources() or None
            pending = self._commit(plan, turn, prepared, cancel)
        turn.notices += self._save(plan.session_id, prepared, pending)
        if not closed:  # a closed generator must not yield again
            yield turn

    def _commit(self, plan: ReplyPlan, turn: Turn, prepared: _Prepared, cancel) -> list:
        """Store the reply (if any text came), then settle the Context on the conversation
        including it. A stop during prefill (no text) also stops settling; a stop while
        decoding still stores the reply and its end-of-turn tokens."""
        conversation, message_ids = plan.conversation, list(plan.message_ids)
        if turn.text:
            message = plan.store_reply(turn.text, turn.stats())
            turn.message_id = message.id
            conversation, message_ids = conversation.plus("assistant", turn.text), message_ids + [message.id]
        pending, _ = self._settle(plan.session_id, prepared, conversation, message_ids,
                                  cancel=None if turn.text else cancel)
        return pending

    # ------------------------------------------------------------------ resume

    def resume(
        self, session_id: SessionId, conversation: Conversation, message_ids: list[MessageId], cancel
    ) -> ResumeReport:
        """Make the conversation's Context ready: from memory, else from its spans, then
        prefill whatever is not stored, and store it."""
        started = time.perf_counter()
        full = self.renderer.full(conversation)
        report = ResumeReport(session_id)
        if not full:
            return report
        self.engine.check_fits(len(full))
        with self.gate.hold(session_id):
            prepared = self._prepare(session_id, conversation, full, cancel)
            pending, report.computed_tokens = self._settle(
                session_id, prepared, conversation, message_ids, cancel=cancel
            )
        restored = prepared.restored
        report.from_memory = restored is None
        if restored is not None:
            report.restored_tokens = restored.restored
            report.computed_tokens += restored.recomputed
            report.notices += restored.notices
        report.notices += self._save(session_id, prepared, pending)
        report.n_tokens = len(prepared.context.tokens)
        report.seconds = time.perf_counter() - started
        return report

    # ------------------------------------------------------------------ steps

    def _prepare(
        self, session_id: SessionId, conversation: Conversation, ids: list[int], cancel, capacity: int = 0
    ) -> _Prepared:
        """The conversation's Context: warm from the pool, else restored from disk (with
        room for `capacity` tokens, so the reply does not grow and copy the cache)."""
        prefix_len = self.renderer.prefix_len(conversation, ids)
        prefix_ids = ids[:prefix_len]
        key = CacheKey.for_engine(self.engine, prefix_ids)
        context = self.pool.get(session_id)
        if context is not None:
            return _Prepared(context, key, prefix_ids, None)
        context, restored = self.spans.restore(session_id, ids, key, prefix_len, cancel=cancel, capacity=capacity)
        restored.notices[:0] = self._fingerprint_notices(session_id, key)
        self.pool.put(session_id, context)
        return _Prepared(context, key, prefix_ids, restored)

    def _settle(self, session_id, prepared: _Prepared, conversation, message_ids, *, cancel) -> tuple[list, int]:
        """Bring the Context to exactly the conversation's rendering and copy out the parts
        that have no span yet (under the gate). Returns (pending spans, tokens prefilled)."""
        full = self.renderer.full(conversation)
        context = prepared.context
        context.truncate(context.common_prefix(full))
        missing = full[len(context.tokens):]
        engine = self.engine
        prefill(engine.model, context, missing, engine.policy, chunk=engine.config.prefill_chunk, cancel=cancel)
        if context.tokens != full:
            return [], len(missing)  # cancelled: store nothing now, the next turn completes it
        parts = self.spans.plan(
            session_id, prepared.key, full, len(prepared.prefix_ids), message_ids,
            lambda index, floor: self.renderer.message_end(conversation, index, full, floor),
        )
        return self.spans.snapshot(context, parts), len(missing)

    def _save(self, session_id: SessionId, prepared: _Prepared, pending: list) -> list[str]:
        """Write the copied spans, link the shared prefix, remember the fingerprints used."""
        notices = self.spans.write(session_id, prepared.key, pending, prepared.prefix_ids)
        link = (session_id, prepared.key.prefix_hash(prepared.prefix_ids))
        if prepared.prefix_ids and link not in self._linked:
            self.spans.link(session_id, prepared.key, prepared.prefix_ids)
            self._linked.add(link)
        self._record_fingerprints(session_id, prepared.key)
        return notices

    def _fingerprint_notices(self, session_id: SessionId, key: CacheKey) -> list[str]:
        """Say so when the conversation's cache was computed by another model or encoder."""
        stored = self.store.transcript.get_session(session_id).settings.get("kv")
        if not stored:
            return []
        notices = []
        if stored.get("model_fp") != key.model_fp:
            notices.append(
                f"This conversation's cache was computed with another model (fingerprint "
                f"{stored.get('model_fp')!r}, now {key.model_fp!r}); it is recomputed, not reused."
            )
        elif stored.get("encoder_fp") != key.encoder_fp:
            notices.append(
                f"This conversation's cache was computed with other Spotlight encoders (fingerprint "
                f"{stored.get('encoder_fp')!r}, now {key.encoder_fp!r}); it is recomputed, not reused."
            )
        return notices

    def _record_fingerprints(self, session_id: SessionId, key: CacheKey) -> None:
        current = {"model_fp": key.model_fp, "encoder_fp": key.encoder_fp}
        settings = self.store.transcript.get_session(session_id).settings
        if settings.get("kv") != current:
            self.store.transcript.update_session(session_id, settings={**settings, "kv": current})

    @staticmethod
    def _report_restore(turn: Turn, restored: Restored | None) -> None:
        if restored is not None:
            turn.restored_tokens = restored.restored
            turn.notices += restored.notices


def _fill_stats(turn: Turn, finish: str, stats, restored: Restored | None) -> None:
    """Copy the engine's numbers; tokens recomputed while restoring count as computed."""
    recomputed = restored.recomputed if restored is not None else 0
    turn.finish = finish
    turn.cached_tokens = stats.cached_tokens - recomputed
    turn.prefill_tokens = stats.prefill_tokens + recomputed
    turn.prefill_tps = stats.prefill_tps
    turn.decode_tokens = stats.decode_tokens
    turn.decode_tps = stats.decode_tps
