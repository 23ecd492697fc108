"""The chat service: the only place that combines the engine with persistent conversations.

    service = ChatService(AppConfig())
    session = service.create()
    for turn in service.send(session.id, "Hello"):   # streams; the last Turn has .finish
        print(turn.text)

Conversations, their branches and documents live in the store (memory/); their KV
caches are persisted as spans after every turn and restored on the first use after a
restart (chat/cachesync.py, chat/turns.py). The engine is a shared, single-flight resource: one
gate serialises every model call; each conversation has its own cancel flag, checked at
every decode step and between prefill chunks (chat/runtime.py). Errors are `ChatError`s
(chat/errors.py) whose messages say how to fix them.

Undo is delete-less: it marks the last exchange's user message `undone` in its metadata;
the visible conversation ends before the first undone message, the next message starts a
new branch there, and switching back to that branch (`switch_branch`) clears the mark.

Tabs: every change to what a tab shows bumps the conversation's version number in the store
(`version`). Each mutating call takes the version its caller last showed (`seen`; None skips
the check) and raises `ConversationChanged` when the stored one is newer, so a stale tab
never acts on an exchange it did not show; `changed` is the cheap check a tab polls.
"""
from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from memory import CacheSize, DocumentRecord, MessageRecord, Scratch, SegmentSpec, Store
from memory.config import StoreConfig
from segmenter import Document
from spotlight import ReadMeter
from spotlight.config import SamplingConfig
from spotlight.errors import SpotlightError

from . import encoders, export
from .config import GB, REGENERATE_TEMPERATURE, REGENERATE_TOP_P, AppConfig, size_text
from .errors import (
    ChatError,
    ConversationChanged,
    ConversationNotFound,
    ConversationTooLong,
    DocumentTooLong,
    ImportFailed,
    NotEnoughDisk,
    InvalidAction,
    MessageNotFound,
    ModelUnavailable,
    translated,
)
from .documents import count_tokens_within, segment_document
from .records import ChatMessage, DocumentInfo, MessageId, ResumeReport, SessionId, SessionInfo, Turn
from .render import AttachedDocument, Conversation, DocumentSegment
from .runtime import CancelFlags, ContextPool, EngineGate, TabRuns
from .turns import ReplyPlan, TurnRunner

DEFAULT_TITLE = "New chat"
TITLE_LIMIT = 120  # characters kept of a title (rename, import); the UI shortens it further where narrow
_TITLE_CHARS = 60  # of the first message, as the automatic title

__all__ = ["ChatService", "Turn"]


class ChatService:
    """Conversations with persistent KV memory over one engine and one data directory.

    `_engine` injects a loaded engine (tests, benchmarks); `store_config` overrides
    `config.store` (tests set a disk budget); `keep_contexts` is how many conversations
    keep their KV cache in RAM. The store opens on first use (a second process on the
    same directory gets `StorageUnavailable` then).
    """

    def __init__(self, config: AppConfig, _engine=None, *, store_config: StoreConfig | None = None,
                 keep_contexts: int = 4):
        self.config = config
        self.store_config = store_config or config.store
        self._engine = _engine
        self._store: Store | None = None
        self._runner: TurnRunner | None = None
        self._open_lock = threading.Lock()
        self._gate = EngineGate()
        self._flags = CancelFlags()
        self._pool = ContextPool(keep_contexts)
        self._tabs = TabRuns()
        self._documents: dict[str, AttachedDocument] = {}  # document id -> text and segments; immutable
        self.scratch = Scratch(config.scratch_dir)  # uploads while read, exports for download

    # ------------------------------------------------------------------ resources

    @property
    def engine(self):
        """The engine, loaded on first use (the conversion of the default model runs once).

        It decodes as `config.spotlight` says: Spotlight attention when enabled (dense below
        `dense_below` tokens and in its dense layers), else dense. Spans are keyed by the
        encoder fingerprint ("dense" without codes), so a cache is never restored into the
        other kind of engine. An injected `_engine` keeps its own policy."""
        with self._open_lock:
            if self._engine is None:
                from spotlight import Engine

                try:
                    engine = Engine.load(self.config.engine, self.config.home, spotlight=self.config.spotlight)
                except SpotlightError as exc:
                    raise ModelUnavailable(f"the model could not be loaded: {exc}") from exc
                engine.warm_up()
                self._engine = engine
            return self._engine

    def reconfigured(self, config: AppConfig) -> "ChatService":
        """A service for `config` over the same store, and this one closed (call when no reply
        runs). The loaded model is kept when `config.engine` is unchanged; a Spotlight change
        swaps only the decode policy (`Engine.with_spotlight`), so no warm Context or span of the old
        policy is reused: the new service starts with no warm contexts and restores each
        conversation from the spans stored under its own encoder fingerprint. A model that
        does not load raises `ModelUnavailable` and leaves this service as it was."""
        engine = None
        if config.engine == self.config.engine:
            engine = self.engine
            if config.spotlight != self.config.spotlight:
                try:
                    engine = engine.with_spotlight(config.spotlight)
                except SpotlightError as exc:
                    raise ModelUnavailable(f"Spotlight could not be set up: {exc}") from exc
        fresh = ChatService(config, _engine=engine, store_config=self.store_config, keep_contexts=self._pool.capacity)
        fresh.engine  # load a new model now: if it fails, this service stays in use
        self.close()
        return fresh

    def warm_up(self) -> float:
        """Run the engine once on a few tokens (done after loading it); returns the seconds.
        A first forward in a process pays one-time kernel initialisation (~3 s measured on
        2 CPU cores), which would otherwise land on the first reply or resume."""
        engine = self.engine
        with self._gate.hold("warm-up"):
            return engine.warm_up()

    @property
    def store(self) -> Store:
        """The store, opened on first use."""
        with self._open_lock:
            if self._store is None:
                with translated():
                    self._store = Store(self.store_config)
            return self._store

    @property
    def runner(self) -> TurnRunner:
        engine, store = self.engine, self.store
        with self._open_lock:
            if self._runner is None:
                self._runner = TurnRunner(engine, store, self.config.sampling, self._pool, self._gate,
                                          all_sources=self.config.sources == "all",
                                          checkpoint_tokens=self.config.checkpoint_tokens)
            return self._runner

    def warnings(self) -> tuple[str, ...]:
        """Things the UI should show once (e.g. untrained Spotlight encoders)."""
        return tuple(self.engine.warnings)

    def installed_models(self) -> list:
        """The models this machine can run (`spotlight.installed_models`: the packaged ones that are
        installed, then what is in `<home>/models`), labelled for the configured Spotlight code width."""
        from spotlight import installed_models

        return installed_models(self.config.home, self.config.spotlight.bits,
                                packages_dir=self.config.engine.packages_dir)

    def count_tokens(self, text: str) -> int:
        """How many tokens the model's tokenizer makes of `text` (loads the model on first use)."""
        return self.engine.count_tokens(text)

    def context_window(self) -> int:
        """The most tokens a conversation may hold (loads the model on first use): with Spotlight
        the configured cap, read past the model's own window through retrieval; without, that window."""
        return self.engine.max_context

    def model_window(self) -> int:
        """The model's own context window in tokens: what it reads densely (loads the model on first use)."""
        return self.engine.native_window

    def decodes_densely(self) -> bool:
        """Whether replies decode with dense attention (Spotlight off), not Spotlight."""
        return self.engine.decodes_densely

    def load_model(self) -> None:
        """Load (and on first use convert) the model now: `ModelUnavailable` says why it cannot be."""
        self.engine

    def close(self) -> None:
        """Drop the warm contexts and close the store (call when no reply is running)."""
        self._pool.clear()
        with self._open_lock:
            if self._store is not None:
                self._store.close()
                self._store = None
                self._runner = None

    # ------------------------------------------------------------------ Spotlight encoders (Settings)

    def encoder_status(self) -> encoders.EncoderStatus:
        """Whether the model in use decodes with trained encoders, and its training's progress
        (chat/encoders.py). Cheap (a few small files read): the Settings tab polls it. Never
        loads the model: "unloaded" until it is."""
        return encoders.status(self._engine, self.config)

    def train_encoders(self) -> encoders.EncoderStatus:
        """Train the model's encoders in the background, or resume the saved training
        (`TrainingRunning`, a ValueError saying so, when another model's runs)."""
        return encoders.train(self.engine, self.config)

    def cancel_encoder_training(self) -> encoders.EncoderStatus:
        """Stop the training (its state is saved: `train_encoders` resumes it)."""
        return encoders.cancel(self._engine, self.config)

    def with_trained_encoders(self) -> "ChatService":
        """A service whose engine decodes with the encoders trained since it loaded, over the same
        store, and this one closed (call when no reply runs, as `reconfigured`); this service
        itself when there are none new. Conversations then restore from spans under the new
        encoder fingerprint: the old spans' keys are recomputed (chat/cachesync.py says so)."""
        engine = self.engine.with_encoders_found()
        if engine is self.engine:
            return self
        fresh = ChatService(self.config, _engine=engine, store_config=self.store_config, keep_contexts=self._pool.capacity)
        self.close()
        return fresh

    def clear_scratch(self) -> None:
        """Empty the short-lived files folder (`config.scratch_dir`: uploads, exports) at app
        start. The store opens first, so a second app on the same data directory is refused
        (`StorageUnavailable`) before it deletes anything of the first one's."""
        self.store
        self.scratch.clear()

    def discard_upload(self, path: str | Path) -> None:
        """Delete an uploaded file once it has been read or refused (its text is in the store);
        a file outside the short-lived files folder is left alone."""
        self.scratch.discard(path)

    def saved_settings(self) -> dict:
        """The settings saved by `save_settings` (name -> JSON value; {} before any)."""
        with translated():
            return self.store.settings.get()

    def save_settings(self, values: dict) -> None:
        """Keep `values` (name -> JSON value) for the next start."""
        with translated():
            self.store.settings.put(values)

    # ------------------------------------------------------------------ sessions

    def create(self, title: str = DEFAULT_TITLE, system_prompt: str | None = None) -> SessionInfo:
        """A new empty conversation (system prompt: the configured one unless given)."""
        prompt = self.config.system_prompt if system_prompt is None else system_prompt
        with translated():
            return _session_info(self.store.transcript.create_session(capped_title(title) or DEFAULT_TITLE,
                                                                      system_prompt=prompt))

    def get(self, session_id: SessionId) -> SessionInfo:
        with translated(session_id):
            return _session_info(self.store.transcript.get_session(session_id))

    def list_sessions(self, limit: int | None = None) -> list[SessionInfo]:
        """Conversations, most recently updated first."""
        with translated():
            return [_session_info(record) for record in self.store.transcript.list_sessions(limit)]

    def search(self, query: str) -> list[SessionInfo]:
        """Conversations whose title or messages contain every word of `query` (word prefixes)."""
        with translated():
            return [_session_info(record) for record in self.store.transcript.search_sessions(query)]

    def rename(self, session_id: SessionId, title: str, *, seen: int | None = None) -> SessionInfo:
        if not title.strip():
            raise InvalidAction("a conversation title cannot be empty; type a name")
        with translated(session_id):
            self.check_current(session_id, seen)
            return _session_info(self.store.transcript.update_session(session_id, title=capped_title(title)))

    def delete(self, session_id: SessionId, *, seen: int | None = None) -> None:
        """Delete the conversation, its messages, documents only it uses, its cache and its exports."""
        with translated(session_id), self._flags.running(session_id):
            self.check_current(session_id, seen)
            self.store.transcript.delete_session(session_id)
        self._pool.drop(session_id)
        self.scratch.drop_exports(session_id)

    def version(self, session_id: SessionId) -> int:
        """The conversation's version number (it moves with every change a tab shows)."""
        with translated(session_id):
            return self.store.transcript.session_version(session_id)

    def check_current(self, session_id: SessionId, seen: int | None) -> None:
        """`ConversationChanged` unless the conversation is still at version `seen` (None: no check)."""
        if seen is not None and self.version(session_id) != seen:
            raise ConversationChanged(session_id)

    def changed(self, session_id: SessionId, seen: int | None) -> bool:
        """Whether a tab that shows version `seen` should refresh: the conversation moved on
        (or was deleted) and no reply is being generated in it now (the tab refreshes once
        that reply is stored). One indexed read: cheap enough to poll every few seconds."""
        if self._flags.is_running(session_id):
            return False
        try:
            return self.version(session_id) != seen
        except ConversationNotFound:
            return True

    def continue_in_new_chat(self, session_id: SessionId) -> SessionInfo:
        """A new conversation with the same system prompt and attached documents and no
        messages (for a conversation that filled the model's window); their cache is shared."""
        with translated(session_id):
            old = self.store.transcript.get_session(session_id)
            new = self.store.transcript.create_session(capped_title(f"{old.title} (continued)") or DEFAULT_TITLE,
                                                       system_prompt=old.system_prompt)
            self.store.transcript.copy_documents(session_id, new.id)
            return self.get(new.id)

    def reply_interrupted(self, session_id: SessionId) -> bool:
        """Whether the visible conversation ends with a question whose reply was never stored
        (the app stopped while it was being generated) and no reply is being generated now.
        Read from the stored transcript, so it holds after a crash and a restart."""
        with translated(session_id):
            records = self._visible(session_id)
        return bool(records) and records[-1].role == "user" and not self._flags.is_running(session_id)

    # ------------------------------------------------------------------ messages

    def history(self, session_id: SessionId) -> list[ChatMessage]:
        """The visible conversation, with each message's branch position and turn stats."""
        with translated(session_id):
            return [self._chat_message(record) for record in self._visible(session_id)]

    def send(self, session_id: SessionId, text: str, *, sampling: SamplingConfig | None = None,
             seen: int | None = None) -> Iterator[Turn]:
        """Add a user message and stream the reply (see `Turn`). `EngineBusy` if a reply is
        already running in this conversation; other conversations wait for the engine.
        `sampling` overrides the configured sampling for this reply (the API's per-request options)."""
        text = _checked_text(text)
        with translated(session_id), self._flags.running(session_id) as cancel:
            self.check_current(session_id, seen)
            records = self._visible(session_id)
            conversation = self._conversation(session_id, records).plus("user", text)
            self._check_fits(conversation)
            user = self.store.transcript.add_message(session_id, "user", text, parent_id=records[-1].id if records else None)
            if not records:
                self._title_from(session_id, text)
            plan = ReplyPlan(session_id, conversation, [r.id for r in records] + [user.id],
                             self._reply_to(session_id, user.id), sampling=sampling)
            yield from self.runner.reply(plan, Turn(session_id, user_message_id=user.id), cancel)

    def append(self, session_id: SessionId, role: str, text: str) -> ChatMessage:
        """Add a message to the end of the visible conversation without generating (the API
        stores a request's earlier turns this way); its cache is computed on the next reply."""
        if role not in ("user", "assistant"):
            raise InvalidAction(f"a message's role is 'user' or 'assistant', not {role!r}")
        with translated(session_id), self._flags.running(session_id):
            records = self._visible(session_id)
            record = self.store.transcript.add_message(session_id, role, text,
                                                       parent_id=records[-1].id if records else None)
            return self._chat_message(record)

    def regenerate(self, session_id: SessionId, *, sampling: SamplingConfig | None = None,
                   seen: int | None = None) -> Iterator[Turn]:
        """A new reply to the last user message; the previous reply stays as a sibling branch.
        It is sampled (`regeneration_sampling`: a greedy rerun would repeat the reply word
        for word; `sampling` overrides that) and its stats record the temperature and seed."""
        with translated(session_id), self._flags.running(session_id) as cancel:
            self.check_current(session_id, seen)
            records = self._visible(session_id)
            old = records.pop() if records and records[-1].role == "assistant" else None
            if not records or records[-1].role != "user":
                raise InvalidAction("there is no reply to regenerate yet; send a message first")
            user = records[-1]
            store_reply = self._sibling_of(old.id) if old else self._reply_to(session_id, user.id)
            sampling = sampling or regeneration_sampling(self.config.sampling)
            plan = self._summary_plan(session_id, user.id, store_reply, sampling) if user.metadata.get("summary") else None
            if plan is None:  # a question, or a summary that no longer fits in one pass
                plan = ReplyPlan(session_id, self._conversation(session_id, records), [r.id for r in records],
                                 store_reply, sampling=sampling)
            turn = Turn(session_id, user_message_id=user.id, regenerated_at=sampling.temperature, seed=sampling.seed)
            yield from self.runner.reply(plan, turn, cancel)

    def edit(self, session_id: SessionId, message_id: MessageId, text: str, *,
             sampling: SamplingConfig | None = None, seen: int | None = None) -> Iterator[Turn]:
        """Replace one of your earlier messages with `text` and stream a new reply. The edit is a
        sibling branch: the old message and everything after it are kept, and the cache is
        reused up to the edited message."""
        text = _checked_text(text)
        with translated(session_id), self._flags.running(session_id) as cancel:
            self.check_current(session_id, seen)
            records = self._visible(session_id)
            index = self._visible_index(session_id, records, message_id)
            if records[index].role != "user":
                raise InvalidAction("only your own messages can be edited; use regenerate for a reply")
            conversation = self._conversation(session_id, records[:index]).plus("user", text)
            self._check_fits(conversation)
            user = self.store.transcript.add_sibling(message_id, text)
            plan = ReplyPlan(session_id, conversation, [r.id for r in records[:index]] + [user.id],
                             self._reply_to(session_id, user.id), sampling=sampling)
            yield from self.runner.reply(plan, Turn(session_id, user_message_id=user.id), cancel)

    def undo(self, session_id: SessionId, *, seen: int | None = None) -> str:
        """Hide the last exchange (your last message and its reply) without deleting it;
        returns your message's text so it can be edited and sent again."""
        with translated(session_id), self._flags.running(session_id):
            self.check_current(session_id, seen)
            records = self._visible(session_id)
            users = [record for record in records if record.role == "user"]
            if not users:
                raise InvalidAction("there is nothing to undo in this conversation")
            self.store.transcript.set_message_metadata(users[-1].id, {"undone": True})
            return users[-1].content

    def switch_branch(self, session_id: SessionId, message_id: MessageId, *,
                      seen: int | None = None) -> list[ChatMessage]:
        """Show the branch through `message_id` (its newest continuation); returns the history."""
        with translated(session_id), self._flags.running(session_id):
            self.check_current(session_id, seen)
            if self.store.transcript.get_message(message_id).session_id != session_id:
                raise MessageNotFound(message_id, session_id)
            for record in self.store.transcript.switch_branch(message_id):
                if record.metadata.get("undone"):
                    self.store.transcript.set_message_metadata(record.id, {"undone": False})
        return self.history(session_id)

    def switch_version(self, session_id: SessionId, message_id: MessageId, step: int, *,
                       seen: int | None = None) -> list[ChatMessage]:
        """Show the alternative `step` places from `message_id` among its siblings (edits and
        regenerations; -1 = the older one, +1 = the newer one), clamped to the first and last;
        returns the history. The UI's "< version i of k >" arrows call this."""
        with translated(session_id):
            self.check_current(session_id, seen)
            if self.store.transcript.get_message(message_id).session_id != session_id:
                raise MessageNotFound(message_id, session_id)
            siblings = [record.id for record in self.store.transcript.siblings(message_id)]
        index = min(max(siblings.index(message_id) + step, 0), len(siblings) - 1)
        return self.switch_branch(session_id, siblings[index], seen=seen)

    def stop(self, session_id: str) -> None:
        """Ask the running reply (or resume) of a conversation to stop: it does within one
        decode step or prefill chunk. No-op when nothing runs."""
        self._flags.cancel(session_id)

    def for_tab(self, tab: str | None, session_id: SessionId):
        """A context manager: the work done inside it for `session_id` (an upload: reading and
        prefill) belongs to browser tab `tab`, so `tab_closed(tab)` stops it."""
        return self._tabs.running(tab, session_id)

    def tab_closed(self, tab: str) -> list[SessionId]:
        """Stop the work browser tab `tab` started (its page was closed or reloaded): each
        such conversation's reply or prefill stops within one step or chunk, keeping what
        was computed. Returns those conversations."""
        sessions = self._tabs.of(tab)
        for session_id in sessions:
            self.stop(session_id)
        return sessions

    def resume(self, session_id: SessionId, progress=None) -> ResumeReport:
        """Make the conversation's KV cache ready without generating: from memory, else from
        its span files (verified), prefilling and storing whatever is missing;
        `progress(tokens done, tokens total)` after each prefill chunk."""
        with translated(session_id), self._flags.running(session_id) as cancel:
            records = self._visible(session_id)
            conversation = self._conversation(session_id, records)
            self._check_fits(conversation, reply=False)
            return self.runner.resume(session_id, conversation, [r.id for r in records], cancel, progress)

    # ------------------------------------------------------------------ documents

    def attach_text(self, session_id: SessionId, name: str, text: str, *, pages: int | None = None,
                    seen: int | None = None) -> DocumentInfo:
        """Attach plain text as a document (see `attach_document`)."""
        return self.attach_document(session_id, Document(name, "txt", text, page_count=pages), seen=seen)

    def attach_document(self, session_id: SessionId, document: Document, *, seen: int | None = None) -> DocumentInfo:
        """Attach a read document (segmenter) to the conversation's prefix (the system
        message): it is cut into segments once, here, with their pages and headings, and
        stored with them. Refused before any long work and before the engine gate (tokens are
        counted with an early exit, no ids kept): `DocumentTooLong` past the configured token
        limit for one document (`config.uploads.max_tokens`), `ConversationTooLong` if the
        conversation would not fit `context_window()` (past the model's window it is read
        through Spotlight). Its KV cache is computed on the next message (or `resume`)."""
        if not document.text.strip():
            raise InvalidAction(f"the document {document.name!r} is empty; attach a file with text in it")
        with translated(session_id), self._flags.running(session_id):
            self.check_current(session_id, seen)
            records = self._visible(session_id)
            conversation = self._conversation(session_id, records)
            prompt_tokens = len(self.runner.renderer.prompt(conversation))
            room = self.engine.max_context - 1 - prompt_tokens
            cap = self.config.uploads.max_tokens
            limit = room if cap is None else min(room, cap)
            n_tokens = count_tokens_within(self.engine.count_tokens, document.text, limit)
            if n_tokens is None and limit < room:
                raise DocumentTooLong(over_token_limit(document.name, limit))
            if n_tokens is None:
                raise ConversationTooLong(too_long(document.name, room, self.engine.max_context,
                                                   self.engine.decodes_densely, self.engine.memory_bound))
            self._check_disk(document.name, n_tokens, prompt_tokens + n_tokens)
            segments = segment_document(document, self.engine.count_tokens)
            self._check_fits(conversation.with_document(AttachedDocument("", document.name, document.text,
                                                                         tuple(segments))))
            record = self.store.transcript.add_document(
                document.name, document.text, pages=document.page_count, session_id=session_id,
                n_tokens=n_tokens, segments=[_segment_spec(s) for s in segments])
            return _document_info(record)

    def _check_disk(self, name: str, document_tokens: int, conversation_tokens: int) -> None:
        """Refuse, before any long work, a document whose cache would not fit: the whole
        conversation's within the disk budget (else its own spans would be evicted as they are
        written), the document's within the free disk space."""
        per_token = self.engine.stored_bytes_per_token
        budget = self.store_config.disk_budget_bytes
        if conversation_tokens * per_token > budget:
            raise NotEnoughDisk(over_disk_budget(name, conversation_tokens * per_token, budget))
        free = self.store.free_disk_bytes()
        if document_tokens * per_token > free:
            raise NotEnoughDisk(disk_too_full(name, document_tokens * per_token, free))

    def documents(self, session_id: SessionId) -> list[DocumentInfo]:
        with translated(session_id):
            return [_document_info(record) for record in self.store.transcript.session_documents(session_id)]

    # ------------------------------------------------------------------ export / import

    def export_json(self, session_id: SessionId) -> str:
        """Every message of every branch, the documents with their text (no KV cache)."""
        with translated(session_id):
            return export.to_json(self.store.transcript.export_session(session_id))

    def export_markdown(self, session_id: SessionId) -> str:
        with translated(session_id):
            return export.to_markdown(self.store.transcript.export_session(session_id))

    def export_file(self, session_id: SessionId, name: str) -> Path:
        """The conversation exported to a short-lived file `name` (Markdown for a .md name, else
        JSON) for one download: it replaces the conversation's earlier export and goes with the
        conversation (memory/scratch.py)."""
        text = self.export_markdown(session_id) if name.endswith(".md") else self.export_json(session_id)
        return self.scratch.write_export(session_id, name, text)

    def import_file(self, path: str | Path) -> SessionInfo:
        """`import_json` of an uploaded file, which is then deleted (see `discard_upload`)."""
        return self.import_json(self.scratch.take(path))

    def import_json(self, text: str | bytes) -> SessionInfo:
        """A new conversation from an `export_json` file (its cache is computed on first use)."""
        try:
            data = export.from_json(text)
            if isinstance(data.get("session"), dict) and isinstance(data["session"].get("title"), str):
                data["session"]["title"] = capped_title(data["session"]["title"]) or DEFAULT_TITLE
            with translated():
                session_id = self.store.transcript.import_session(data)
        except ChatError:
            raise
        except (ValueError, KeyError, TypeError, IndexError) as error:  # a malformed or edited export
            raise ImportFailed(f"cannot import this file: {error!s}; export the conversation again") from error
        return self.get(session_id)

    # ------------------------------------------------------------------ cache

    def cache_size(self, session_id: SessionId) -> CacheSize:
        """Disk used by the conversation's cache: its own spans and prefixes it shares."""
        with translated(session_id):
            return self.store.spans.session_cache_size(session_id)

    def drop_cache(self, session_id: SessionId) -> int:
        """Delete the conversation's cache from disk and memory (recomputed on next use);
        returns the number of span files removed. The conversation itself is kept."""
        with translated(session_id), self._flags.running(session_id):
            dropped = self.store.spans.drop_session_cache(session_id)
        self._pool.drop(session_id)
        return len(dropped)

    # ------------------------------------------------------------------ summaries

    def summarize(self, session_id: SessionId, progress=None, *, seen: int | None = None) -> Iterator[Turn]:
        """Summarise the attached documents: a request of its own over the documents alone (the
        conversation's earlier turns are not rendered, chat/summarize.py), up to
        `config.summary_tokens` tokens long. One pass from the documents' cached prefix when the
        documents, the request and at least `summarize.MIN_TOKENS` of summary fit the window;
        otherwise map-reduce over segment groups, labelled as such, with one notice per part and
        `progress(done, total, text)`. Both store the request (naming the documents) and the
        summary at the end of the conversation."""
        from . import summarize as summary

        with translated(session_id):
            self.check_current(session_id, seen)
            records = self._visible(session_id)
            documents = self._conversation(session_id, []).documents
        if not documents:
            raise InvalidAction("there is no document to summarize; attach one first")
        text = summary.request([document.name for document in documents])
        with translated(session_id), self._flags.running(session_id) as cancel:
            user = self.store.transcript.add_message(session_id, "user", text,
                                                     parent_id=records[-1].id if records else None,
                                                     metadata={"summary": [d.name for d in documents]})
            if not records:
                self._title_from(session_id, text)
            turn = Turn(session_id, user_message_id=user.id)
            plan = self._summary_plan(session_id, user.id, self._reply_to(session_id, user.id))
            if plan is not None:
                yield from self.runner.reply(plan, turn, cancel)
                return
            system = self.store.transcript.get_session(session_id).system_prompt
            meter = ReadMeter()
            with self._gate.hold(session_id):
                yield from summary.map_reduce(self.engine, self.config.sampling, system, documents, turn, cancel,
                                              progress, observers=[meter], summary_tokens=self.config.summary_tokens)
            turn.read_share, turn.spotlight = meter.share(), not self.engine.decodes_densely
            stats = {**turn.stats(), "summary": "map-reduce"}
            turn.message_id = self.store.transcript.add_message(session_id, "assistant", turn.text, parent_id=user.id,
                                                                metadata={"stats": stats}).id
        yield turn

    def _summary_plan(self, session_id: SessionId, request_id: MessageId, store_reply,
                      sampling: SamplingConfig | None = None) -> ReplyPlan | None:
        """The one-pass summary of the conversation's documents (None when it does not fit):
        rendered without the conversation's turns, with the summary's own token budget
        (`sampling`: a regeneration's, else the configured one)."""
        from . import summarize as summary

        session = self.store.transcript.get_session(session_id)
        conversation = summary.conversation(session.system_prompt, self._conversation(session_id, []).documents)
        budget = min(self.config.summary_tokens,
                     self.engine.native_window - len(self.runner.renderer.prompt(conversation)))
        if budget < min(summary.MIN_TOKENS, self.config.summary_tokens):
            return None

        def store_summary(content: str, stats: dict) -> MessageRecord:
            return store_reply(content, {**stats, "summary": "one pass"})
        return ReplyPlan(session_id, conversation, [request_id], store_summary,
                         sampling=replace(sampling or self.config.sampling, max_new_tokens=budget), prefix_only=True)

    # ------------------------------------------------------------------ helpers

    def _visible(self, session_id: SessionId) -> list[MessageRecord]:
        """The active path up to (not including) its first undone message."""
        path = self.store.transcript.active_path(session_id)
        cut = next((i for i, record in enumerate(path) if record.metadata.get("undone")), len(path))
        return path[:cut]

    def _visible_index(self, session_id: SessionId, records: list[MessageRecord], message_id: MessageId) -> int:
        for index, record in enumerate(records):
            if record.id == message_id:
                return index
        if self.store.transcript.get_message(message_id).session_id != session_id:
            raise MessageNotFound(message_id, session_id)
        raise InvalidAction("that message is not on the branch shown; switch to its branch first")

    def _conversation(self, session_id: SessionId, records: list[MessageRecord]) -> Conversation:
        session = self.store.transcript.get_session(session_id)
        documents = tuple(self._document(d) for d in self.store.transcript.session_documents(session_id))
        return Conversation(session.system_prompt, documents, tuple((r.role, r.content) for r in records))

    def _document(self, attached: DocumentRecord) -> AttachedDocument:
        """The attached document with its stored segments, under the name it was attached with
        (the content is shared by every attachment of the same text). A document stored without
        segments (before they were stored at ingest, or imported) is cut now, once, and its
        segments stored."""
        document_id = attached.id
        if document_id not in self._documents:
            record, text = self.store.transcript.get_document(document_id), self.store.transcript.document_text(document_id)
            rows = self.store.transcript.segments(document_id)
            if not rows:
                specs = [_segment_spec(s) for s in segment_document(Document(record.name, "txt", text),
                                                                    self.engine.count_tokens)]
                self.store.transcript.add_document(record.name, text, segments=specs)
                rows = self.store.transcript.segments(document_id)
            segments = tuple(DocumentSegment(r.ordinal, r.char_start, r.char_end, r.page, r.heading, r.n_tokens, r.id)
                             for r in rows)
            self._documents[document_id] = AttachedDocument(document_id, record.name, text, segments)
        return replace(self._documents[document_id], name=attached.name)

    def _check_fits(self, conversation: Conversation, *, reply: bool = True) -> None:
        """`ConversationTooLong`, in the user's terms, unless the conversation's prompt leaves
        room for a reply token (`reply`; else: unless the conversation itself fits)."""
        renderer, window = self.runner.renderer, self.engine.max_context
        n_tokens = len(renderer.prompt(conversation) if reply else renderer.full(conversation))
        if n_tokens + reply <= window:
            return
        documents = [(d.name, _document_tokens(d, self.engine.count_tokens)) for d in conversation.documents]
        questions = [m for m in conversation.messages if m[0] == "user"][-1:]
        fresh = Conversation(conversation.system_prompt, conversation.documents, tuple(questions))
        fits = len(renderer.prompt(fresh)) + 1 <= window
        raise ConversationTooLong(window_full(documents, n_tokens, window, fits), fresh_chat_fits=fits)

    def _reply_to(self, session_id: SessionId, user_id: MessageId):
        def store_reply(content: str, stats: dict) -> MessageRecord:
            return self.store.transcript.add_message(session_id, "assistant", content, parent_id=user_id,
                                          metadata={"stats": stats})
        return store_reply

    def _sibling_of(self, reply_id: MessageId):
        def store_reply(content: str, stats: dict) -> MessageRecord:
            return self.store.transcript.add_sibling(reply_id, content, metadata={"stats": stats})
        return store_reply

    def _title_from(self, session_id: SessionId, text: str) -> None:
        if self.store.transcript.get_session(session_id).title == DEFAULT_TITLE:
            title = capped_title(text, _TITLE_CHARS) or DEFAULT_TITLE
            self.store.transcript.update_session(session_id, title=title)

    def _chat_message(self, record: MessageRecord) -> ChatMessage:
        siblings = [m.id for m in self.store.transcript.siblings(record.id)]
        return ChatMessage(record.id, record.role, record.content, record.parent_id,
                           siblings.index(record.id), len(siblings), record.metadata.get("stats", {}))


def capped_title(title: str, limit: int = TITLE_LIMIT) -> str:
    """`title` on one line (runs of whitespace become one space), at most `limit` characters."""
    return " ".join(title.split())[:limit].rstrip()


def too_long(name: str, room: int, limit: int, dense: bool, memory_bound: bool = False) -> str:
    """Why a document does not fit, in the user's terms, and what they can do. `limit`: the most
    tokens a conversation holds; `dense`: Spotlight is off, so that is the model's own window."""
    if dense:
        return (f"{name} is longer than the {max(room, 0):,} tokens left in this conversation: with Spotlight "
                f"off the model reads at most {limit:,} tokens at once (about {limit // 400:,} pages). Turn "
                "Spotlight on to read beyond that, attach a shorter excerpt, or start a new chat for it.")
    return (f"{name} is longer than the {max(room, 0):,} tokens left in this conversation: a conversation "
            f"holds at most {limit:,} tokens (about {limit // 400:,} pages){' on this machine, whose memory must hold its cache' if memory_bound else ''}. "
            "Attach a shorter excerpt, or start a new chat for it.")


def window_full(documents: list[tuple[str, int]], n_tokens: int, window: int, fresh_chat_fits: bool) -> str:
    """Why a conversation does not fit the model's window, in the user's terms, and what to do:
    `documents` are (name, tokens); `fresh_chat_fits`: a new chat with them and the last question would."""
    pages = f"about {window // 400:,} pages"
    named = " and ".join(f"{name} ({tokens:,} tokens)" for name, tokens in documents)
    if fresh_chat_fits:
        kept = f" with {named}" if documents else ""
        return (f"This conversation has filled the model's context window: it comes to {n_tokens:,} tokens, and "
                f"the model reads at most {window:,} at once ({pages}). Continue in a new chat{kept} (the button "
                "under the message box), or choose a model with a larger window in Settings.")
    if not documents:
        return (f"Your message is too long for this model: the conversation would come to {n_tokens:,} tokens, and "
                f"the model reads at most {window:,} at once ({pages}). Shorten it, or choose a model with a "
                "larger window in Settings.")
    return (f"{named} {'is' if len(documents) == 1 else 'are'} too long for this model: with the conversation it "
            f"comes to {n_tokens:,} tokens, and the model reads at most {window:,} at once ({pages}). Attach a "
            "shorter excerpt, or choose a model with a larger window in Settings.")


def regeneration_sampling(sampling: SamplingConfig) -> SamplingConfig:
    """How a regeneration samples: the configured temperature and top-p, or REGENERATE_TEMPERATURE
    and REGENERATE_TOP_P when they are greedy, with a fresh seed."""
    if sampling.greedy:
        sampling = replace(sampling, temperature=REGENERATE_TEMPERATURE, top_p=REGENERATE_TOP_P)
    return replace(sampling, seed=secrets.randbits(31))


def _document_tokens(document: AttachedDocument, count_tokens) -> int:
    counts = [segment.n_tokens for segment in document.segments]
    return sum(counts) if counts and None not in counts else count_tokens(document.text)


def over_disk_budget(name: str, need: int, budget: int) -> str:
    allow = max(1, math.ceil(1.25 * need / GB))
    return (f"{name} needs about {size_text(need)} of disk for this conversation's cache (what makes questions "
            f"about it fast), more than the {size_text(budget)} the cache may use. Start the app with "
            f"--disk-budget-gb {allow} to allow more, or attach a shorter excerpt.")


def disk_too_full(name: str, need: int, free: int) -> str:
    return (f"{name} needs about {size_text(need)} of disk for its cache, and the disk that holds the data "
            f"directory has {size_text(free)} free. Free some disk space (deleting conversations you no longer "
            "need frees their cache), then attach it again.")


def over_token_limit(name: str, limit: int) -> str:
    """Why a document is refused by the app's token limit for one document, and what to do."""
    pages = max(limit // 400, 1)
    return (f"{name} is longer than {limit:,} tokens (about {pages:,} page{'s' if pages > 1 else ''}), the most "
            "this app reads from one document. Attach a shorter excerpt, or split it into parts.")


def _segment_spec(segment: DocumentSegment) -> SegmentSpec:
    return SegmentSpec(segment.char_start, segment.char_end, segment.page, segment.heading, segment.n_tokens)


def _document_info(record) -> DocumentInfo:
    return DocumentInfo(record.id, record.name, record.n_chars, record.n_tokens, record.pages)


def _session_info(record) -> SessionInfo:
    return SessionInfo(record.id, record.title, record.created, record.updated, record.system_prompt)


def _checked_text(text: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidAction("the message is empty; type something to send")
    return text
