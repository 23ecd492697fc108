"""Running the engine for a conversation: one reply, or a resume, with persistent KV memory.

A reply (`TurnRunner.reply`) enters each module once, top to bottom, under the engine gate:
  1. render the visible conversation + generation prompt (chat/render.py: one Rendering);
  2. take the conversation's warm Context, or restore one from its spans (chat/cachesync.py);
  3. stream: the engine keeps the common prefix, prefills the rest, decodes; its observers
     measure the read share and tally the attention sources come from (chat/sources.py);
  4. commit the assistant message (the caller's `store_reply`);
  5. settle: render the conversation with the reply and bring the Context to exactly those
     ids (truncate where the generated ids differ from the re-tokenised reply, prefill the
     difference: at least the end-of-turn tokens);
  6. copy the parts that have no span yet out of the Context (cachesync.plan + snapshot);
then, outside the gate, store those spans (cachesync.write) and yield the final Turn. So the
stored chain always equals what the renderer gives for the conversation.

    send:  service -> turns -> render -> cachesync (restore) -> engine.stream
                            -> (store reply) -> render -> engine.prefill -> cachesync (plan, snapshot, write) -> memory
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from memory import MessageId, MessageRecord, SessionId, Store
from spotlight import Context, ReadMeter
from spotlight.config import SamplingConfig

from .cachesync import CacheSync, Restored
from .records import ResumeReport, Turn
from .render import Conversation, Renderer, Rendering
from .runtime import ContextPool, EngineGate
from .sources import SourceTracker

_END_OF_TURN_ROOM = 16  # tokens: the end-of-turn marker that settling appends after a reply
EMPTY_REPLY = ("The model ended its reply before writing anything, so nothing was saved. Regenerate "
               "(Ctrl+Shift+R) to sample another reply, or rephrase the question.")
StoreReply = Callable[[str, dict], MessageRecord]  # (content, stats) -> the committed assistant message
PrefillProgress = Callable[[int, int], None]  # (tokens done, tokens total)


@dataclass(slots=True)
class ReplyPlan:
    """A reply to generate: the conversation to continue (ending with a user message), the
    ids of its messages, and how to commit the reply (new message or regenerated sibling)."""

    session_id: SessionId
    conversation: Conversation
    message_ids: list[MessageId]
    store_reply: StoreReply
    sources: bool = True  # tally the reply's attention over attached documents (chat/sources.py)
    sampling: SamplingConfig | None = None  # None: the runner's (the configured) sampling
    # A request over the documents alone (a summary: chat/summarize.py): it runs on a Context of its
    # own restored from the prefix's spans (the conversation's warm Context is kept), and its
    # messages get no spans: they are computed where they stand when the conversation continues.
    prefix_only: bool = False


class TurnRunner:
    """Runs replies and resumes on one engine against one store."""

    def __init__(self, engine, store: Store, sampling: SamplingConfig, pool: ContextPool, gate: EngineGate,
                 all_sources: bool = False):
        self.engine = engine
        self.all_sources = all_sources  # also sources that share no word with the reply (AppConfig.sources)
        self.store = store
        self.sampling = sampling
        self.pool = pool
        self.gate = gate
        self.renderer = Renderer(engine)
        self.sync = CacheSync(store, engine)

    # ------------------------------------------------------------------ reply

    def reply(self, plan: ReplyPlan, turn: Turn, cancel) -> Iterator[Turn]:
        """Stream the reply: yields `turn` after every generated token, then once more finished.

        Closing the generator early (a UI that stops listening) counts as a stop: the text
        generated so far is stored as the reply, like after `stop()`."""
        prompt = self.renderer.prompt(plan.conversation)
        sampling = plan.sampling or self.sampling
        closed = False
        with self.gate.hold(plan.session_id):
            # the decode loop stops at engine.max_context, so no room beyond it is needed up front
            capacity = min(len(prompt) + sampling.max_new_tokens + _END_OF_TURN_ROOM, self.engine.max_context)
            context, restored = self._prepare(plan.session_id, prompt, cancel, capacity, pooled=not plan.prefix_only)
            _report_restore(turn, restored)
            context.reserve(capacity)
            tracker = SourceTracker.for_rendering(plan.conversation, prompt) if plan.sources else None
            meter = ReadMeter()
            observers = [meter] if tracker is None else [meter, tracker.observer]
            try:
                for step in self.engine.stream(context, list(prompt.ids), sampling, cancel=cancel,
                                               observers=observers):
                    turn.text += step.text
                    if step.finish is None:
                        yield turn
                        continue
                    _fill_stats(turn, step.finish, step.stats, restored)
            except GeneratorExit:
                closed, turn.finish = True, "cancelled"
                cancel.set()
            turn.read_share, turn.spotlight = meter.share(), not self.engine.decodes_densely
            if tracker is not None and turn.text:
                turn.sources = tracker.sources(None if self.all_sources else turn.text) or None
            full, pending = (self._commit_aside(plan, turn, context, prompt) if plan.prefix_only
                             else self._commit(plan, turn, context, cancel))
        turn.notices += self.sync.write(plan.session_id, full, pending)
        if not closed:  # a closed generator must not yield again
            yield turn

    def _commit(self, plan: ReplyPlan, turn: Turn, context: Context, cancel) -> tuple[Rendering, list]:
        """Store the reply (if any text came), then settle the Context on the conversation
        including it. A stop during prefill (no text) also stops settling; a stop while
        decoding still stores the reply and its end-of-turn tokens."""
        conversation, message_ids = plan.conversation, list(plan.message_ids)
        if turn.text:
            message = plan.store_reply(turn.text, turn.stats())
            turn.message_id = message.id
            conversation, message_ids = conversation.plus("assistant", turn.text), message_ids + [message.id]
        elif turn.finish != "cancelled":
            turn.notices.append(EMPTY_REPLY)
        full, pending, _ = self._settle(plan.session_id, context, conversation, message_ids,
                                        cancel=None if turn.text else cancel)
        return full, pending

    def _commit_aside(self, plan: ReplyPlan, turn: Turn, context: Context, prompt: Rendering) -> tuple[Rendering, list]:
        """Store a prefix-only request's reply; copy out only the prefix spans not stored yet."""
        if turn.text:
            turn.message_id = plan.store_reply(turn.text, turn.stats()).id
        parts = [part for part in self.sync.plan(plan.session_id, prompt, [], prefix_only=True)
                 if part.end <= len(context.tokens)]
        return prompt, self.sync.snapshot(context, parts)

    # ------------------------------------------------------------------ resume

    def resume(self, session_id: SessionId, conversation: Conversation, message_ids: list[MessageId], cancel,
               progress: PrefillProgress | None = None) -> ResumeReport:
        """Make the conversation's Context ready: from memory, else from its spans, then
        prefill whatever is not stored (reporting `progress`), and store it."""
        started = time.perf_counter()
        report = ResumeReport(session_id)
        rendering = self.renderer.full(conversation)
        if not len(rendering):
            return report
        self.engine.check_fits(len(rendering))
        with self.gate.hold(session_id):
            context, restored = self._prepare(session_id, rendering, cancel)
            full, pending, report.computed_tokens = self._settle(session_id, context, conversation, message_ids,
                                                                 cancel=cancel, progress=progress)
        report.from_memory = restored is None
        if restored is not None:
            report.restored_tokens = restored.restored
            report.computed_tokens += restored.recomputed
            report.notices += restored.notices
        report.notices += self.sync.write(session_id, full, pending)
        report.n_tokens = len(context.tokens)
        report.seconds = time.perf_counter() - started
        return report

    # ------------------------------------------------------------------ steps

    def _prepare(self, session_id: SessionId, rendering: Rendering, cancel,
                 capacity: int = 0, *, pooled: bool = True) -> tuple[Context, Restored | None]:
        """The conversation's Context: warm from the pool (restored None), else restored from
        disk (with room for `capacity` tokens, so the reply does not grow and copy the cache).
        Not `pooled`: a Context of its own restored from the prefix's spans, the pool untouched."""
        if not pooled:
            return self.sync.restore(session_id, rendering, cancel=cancel, capacity=capacity, prefix_only=True)
        context = self.pool.get(session_id)
        if context is not None:
            return context, None
        context, restored = self.sync.restore(session_id, rendering, cancel=cancel, capacity=capacity)
        self.pool.put(session_id, context)
        return context, restored

    def _settle(self, session_id: SessionId, context: Context, conversation: Conversation, message_ids, *,
                cancel, progress: PrefillProgress | None = None) -> tuple[Rendering, list, int]:
        """Bring the Context to exactly the conversation's rendering and copy out the parts
        that have no span yet (under the gate). Returns (the rendering, pending spans, tokens
        prefilled)."""
        full = self.renderer.full(conversation)
        context.truncate(context.common_prefix(list(full.ids)))
        missing = list(full.ids[len(context.tokens):])
        if not self.engine.prefill(context, missing, cancel=cancel, progress=progress):
            return full, [], len(missing)  # cancelled: store nothing now, the next turn completes it
        parts = self.sync.plan(session_id, full, message_ids)
        return full, self.sync.snapshot(context, parts), len(missing)


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
