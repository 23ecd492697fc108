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

A resume (reading an upload into the cache) prefills in stages of `checkpoint_tokens` and stores
the spans each stage completes before the next starts (`_prefill_stages`): a stop, a crash or a
restart part way loses at most one stage, and the next restore loads what was stored. A reply
whose document prefix is far from read (its ingest was stopped or killed) first reads the rest of
the prefix the same way.

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
READ_STOPPED = ("Reading stopped at {done:,} of {total:,} tokens. What was read is kept (also across a restart); "
                "the rest is read with your next question.")
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
                 all_sources: bool = False, checkpoint_tokens: int = 4096):
        self.engine = engine
        self.checkpoint_tokens = checkpoint_tokens  # AppConfig.checkpoint_tokens
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
            read_ahead = yield from self._read_prefix(plan.session_id, context, prompt, turn, cancel)
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
                    _fill_stats(turn, step.finish, step.stats, read_ahead + (restored.recomputed if restored else 0))
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
        return self._settle(plan.session_id, context, conversation, message_ids,
                            cancel=None if turn.text else cancel)

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
            context.truncate(context.common_prefix(list(rendering.ids)))
            report.computed_tokens = len(rendering) - len(context.tokens)
            notices = [notice for stage in self._prefill_stages(session_id, context, rendering, message_ids,
                                                                len(rendering), cancel=cancel, progress=progress)
                       for notice in stage]
            if len(context.tokens) < len(rendering):
                notices.append(READ_STOPPED.format(done=len(context.tokens), total=len(rendering)))
        report.from_memory = restored is None
        if restored is not None:
            report.restored_tokens = restored.restored
            report.computed_tokens += restored.recomputed
            report.notices += restored.notices
        report.notices += notices
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

    def _prefill_stages(self, session_id: SessionId, context: Context, rendering: Rendering, message_ids, end: int,
                        *, cancel, progress: PrefillProgress | None = None,
                        prefix_only: bool = False) -> Iterator[list[str]]:
        """Prefill `rendering.ids` up to `end` in stages of `checkpoint_tokens`, storing after
        each stage (and after a stop) the spans that lie wholly in what is computed, so a stop, a
        crash or a restart loses at most one stage. Yields each stage's notices (spans that could
        not be stored); ends when `end` is reached or the prefill was stopped. `progress(done, end)`
        counts from position 0. Under the gate."""
        ids = list(rendering.ids)
        while len(context.tokens) < end:
            start = len(context.tokens)
            stage = ids[start : min(end, start + self.checkpoint_tokens)]
            report = None if progress is None else (lambda done, _total, start=start: progress(start + done, end))
            finished = self.engine.prefill(context, stage, cancel=cancel, progress=report)
            parts = [part for part in self.sync.plan(session_id, rendering, message_ids, prefix_only=prefix_only)
                     if part.end <= len(context.tokens)]
            yield self.sync.write(session_id, rendering, self.sync.snapshot(context, parts))
            if not finished:
                return

    def _read_prefix(self, session_id: SessionId, context: Context, prompt: Rendering, turn: Turn,
                     cancel) -> Iterator[Turn]:
        """Before a reply: when more than a stage of the documents is not read yet (an upload
        stopped or killed while it was read), read the rest of the prefix storing it stage by
        stage, as an upload does, yielding `turn` with `reading` set after each stage. Returns
        the tokens prefilled."""
        context.truncate(context.common_prefix(list(prompt.ids)))
        start, end = len(context.tokens), prompt.prefix_len
        if end - start <= self.checkpoint_tokens:
            return 0
        started = time.perf_counter()
        turn.reading = (start, end)
        yield turn
        for notices in self._prefill_stages(session_id, context, prompt, [], end, cancel=cancel, prefix_only=True):
            turn.notices += notices
            turn.reading = (len(context.tokens), end)
            turn.reading_tps = (len(context.tokens) - start) / max(time.perf_counter() - started, 1e-9)
            yield turn
        turn.reading = None
        return len(context.tokens) - start

    def _settle(self, session_id: SessionId, context: Context, conversation: Conversation, message_ids, *,
                cancel) -> tuple[Rendering, list]:
        """Bring the Context to exactly the conversation's rendering and copy out the parts
        that have no span yet (under the gate). Returns (the rendering, pending spans)."""
        full = self.renderer.full(conversation)
        context.truncate(context.common_prefix(list(full.ids)))
        missing = list(full.ids[len(context.tokens):])
        if not self.engine.prefill(context, missing, cancel=cancel):
            return full, []  # cancelled: store nothing now, the next turn completes it
        parts = self.sync.plan(session_id, full, message_ids)
        return full, self.sync.snapshot(context, parts)


def _report_restore(turn: Turn, restored: Restored | None) -> None:
    if restored is not None:
        turn.restored_tokens = restored.restored
        turn.notices += restored.notices


def _fill_stats(turn: Turn, finish: str, stats, recomputed: int) -> None:
    """Copy the engine's numbers; tokens `recomputed` before the stream (restoring, reading the
    prefix) count as computed."""
    turn.finish = finish
    turn.cached_tokens = stats.cached_tokens - recomputed
    turn.prefill_tokens = stats.prefill_tokens + recomputed
    turn.prefill_tps = stats.prefill_tps
    turn.decode_tokens = stats.decode_tokens
    turn.decode_tps = stats.decode_tps
