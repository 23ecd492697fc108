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
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

from memory import CacheSize, MessageRecord, SegmentSpec, Store
from memory.config import StoreConfig
from segmenter import Document
from spotlight import ReadMeter
from spotlight.config import SamplingConfig
from spotlight.errors import SpotlightError

from . import export
from .config import AppConfig
from .errors import (
    ChatError,
    ConversationTooLong,
    DocumentTooLong,
    ImportFailed,
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
                self._runner = TurnRunner(engine, store, self.config.sampling, self._pool, self._gate)
            return self._runner

    def warnings(self) -> tuple[str, ...]:
        """Things the UI should show once (e.g. untrained Spotlight encoders)."""
        return tuple(self.engine.warnings)

    def count_tokens(self, text: str) -> int:
        """How many tokens the model's tokenizer makes of `text` (loads the model on first use)."""
        return self.engine.count_tokens(text)

    def context_window(self) -> int:
        """The most tokens the model reads at once (loads the model on first use)."""
        return self.engine.max_context

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

    def rename(self, session_id: SessionId, title: str) -> SessionInfo:
        if not title.strip():
            raise InvalidAction("a conversation title cannot be empty; type a name")
        with translated(session_id):
            return _session_info(self.store.transcript.update_session(session_id, title=capped_title(title)))

    def delete(self, session_id: SessionId) -> None:
        """Delete the conversation, its messages, documents only it uses, and its cache."""
        with translated(session_id), self._flags.running(session_id):
            self.store.transcript.delete_session(session_id)
        self._pool.drop(session_id)

    # ------------------------------------------------------------------ messages

    def history(self, session_id: SessionId) -> list[ChatMessage]:
        """The visible conversation, with each message's branch position and turn stats."""
        with translated(session_id):
            return [self._chat_message(record) for record in self._visible(session_id)]

    def send(self, session_id: SessionId, text: str, *, sampling: SamplingConfig | None = None) -> Iterator[Turn]:
        """Add a user message and stream the reply (see `Turn`). `EngineBusy` if a reply is
        already running in this conversation; other conversations wait for the engine.
        `sampling` overrides the configured sampling for this reply (the API's per-request options)."""
        text = _checked_text(text)
        with translated(session_id), self._flags.running(session_id) as cancel:
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

    def regenerate(self, session_id: SessionId) -> Iterator[Turn]:
        """A new reply to the last user message; the previous reply stays as a sibling branch."""
        with translated(session_id), self._flags.running(session_id) as cancel:
            records = self._visible(session_id)
            old = records.pop() if records and records[-1].role == "assistant" else None
            if not records or records[-1].role != "user":
                raise InvalidAction("there is no reply to regenerate yet; send a message first")
            user = records[-1]
            store_reply = self._sibling_of(old.id) if old else self._reply_to(session_id, user.id)
            plan = ReplyPlan(session_id, self._conversation(session_id, records), [r.id for r in records],
                             store_reply)
            yield from self.runner.reply(plan, Turn(session_id, user_message_id=user.id), cancel)

    def edit(self, session_id: SessionId, message_id: MessageId, text: str, *,
             sampling: SamplingConfig | None = None) -> Iterator[Turn]:
        """Replace one of your earlier messages with `text` and stream a new reply. The edit is a
        sibling branch: the old message and everything after it are kept, and the cache is
        reused up to the edited message."""
        text = _checked_text(text)
        with translated(session_id), self._flags.running(session_id) as cancel:
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

    def undo(self, session_id: SessionId) -> str:
        """Hide the last exchange (your last message and its reply) without deleting it;
        returns your message's text so it can be edited and sent again."""
        with translated(session_id), self._flags.running(session_id):
            records = self._visible(session_id)
            users = [record for record in records if record.role == "user"]
            if not users:
                raise InvalidAction("there is nothing to undo in this conversation")
            self.store.transcript.set_message_metadata(users[-1].id, {"undone": True})
            return users[-1].content

    def switch_branch(self, session_id: SessionId, message_id: MessageId) -> list[ChatMessage]:
        """Show the branch through `message_id` (its newest continuation); returns the history."""
        with translated(session_id), self._flags.running(session_id):
            if self.store.transcript.get_message(message_id).session_id != session_id:
                raise MessageNotFound(message_id, session_id)
            for record in self.store.transcript.switch_branch(message_id):
                if record.metadata.get("undone"):
                    self.store.transcript.set_message_metadata(record.id, {"undone": False})
        return self.history(session_id)

    def switch_version(self, session_id: SessionId, message_id: MessageId, step: int) -> list[ChatMessage]:
        """Show the alternative `step` places from `message_id` among its siblings (edits and
        regenerations; -1 = the older one, +1 = the newer one), clamped to the first and last;
        returns the history. The UI's "< version i of k >" arrows call this."""
        with translated(session_id):
            if self.store.transcript.get_message(message_id).session_id != session_id:
                raise MessageNotFound(message_id, session_id)
            siblings = [record.id for record in self.store.transcript.siblings(message_id)]
        index = min(max(siblings.index(message_id) + step, 0), len(siblings) - 1)
        return self.switch_branch(session_id, siblings[index])

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
            return self.runner.resume(session_id, conversation, [r.id for r in records], cancel, progress)

    # ------------------------------------------------------------------ documents

    def attach_text(self, session_id: SessionId, name: str, text: str, *, pages: int | None = None) -> DocumentInfo:
        """Attach plain text as a document (see `attach_document`)."""
        return self.attach_document(session_id, Document(name, "txt", text, page_count=pages))

    def attach_document(self, session_id: SessionId, document: Document) -> DocumentInfo:
        """Attach a read document (segmenter) to the conversation's prefix (the system
        message): it is cut into segments once, here, with their pages and headings, and
        stored with them. Refused before any long work and before the engine gate (tokens are
        counted with an early exit, no ids kept): `DocumentTooLong` past the configured token
        limit for one document (`config.uploads.max_tokens`), `ConversationTooLong` if the
        conversation would not fit the context window. Its KV cache is computed on the next
        message (or `resume`)."""
        if not document.text.strip():
            raise InvalidAction(f"the document {document.name!r} is empty; attach a file with text in it")
        with translated(session_id), self._flags.running(session_id):
            records = self._visible(session_id)
            conversation = self._conversation(session_id, records)
            room = self.engine.max_context - 1 - len(self.runner.renderer.prompt(conversation))
            cap = self.config.uploads.max_tokens
            limit = room if cap is None else min(room, cap)
            n_tokens = count_tokens_within(self.engine.count_tokens, document.text, limit)
            if n_tokens is None and limit < room:
                raise DocumentTooLong(over_token_limit(document.name, limit))
            if n_tokens is None:
                raise ConversationTooLong(too_long(document.name, room, self.engine.max_context))
            segments = segment_document(document, self.engine.count_tokens)
            self._check_fits(conversation.with_document(AttachedDocument("", document.name, document.text,
                                                                         tuple(segments))))
            record = self.store.transcript.add_document(
                document.name, document.text, pages=document.page_count, session_id=session_id,
                n_tokens=n_tokens, segments=[_segment_spec(s) for s in segments])
            return _document_info(record)

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

    def summarize(self, session_id: SessionId, progress=None) -> Iterator[Turn]:
        """Summarise the attached documents: one pass through `send` when the conversation,
        the request and a full reply fit the window; otherwise map-reduce over segment
        groups (chat/summarize.py), labelled as such, with one notice per part and
        `progress(done, total, text)`. Both store the request and the answer."""
        from . import summarize as summary

        with translated(session_id):
            records = self._visible(session_id)
            conversation = self._conversation(session_id, records).plus("user", summary.REQUEST)
            documents = conversation.documents
        if not documents:
            raise InvalidAction("there is no document to summarize; attach one first")
        prompt = self.runner.renderer.prompt(conversation)
        if len(prompt) + self.config.sampling.max_new_tokens <= self.engine.max_context:
            yield from self.send(session_id, summary.REQUEST)
            return
        with translated(session_id), self._flags.running(session_id) as cancel:
            user = self.store.transcript.add_message(session_id, "user", summary.REQUEST,
                                          parent_id=records[-1].id if records else None)
            turn = Turn(session_id, user_message_id=user.id)
            system = self.store.transcript.get_session(session_id).system_prompt
            meter = ReadMeter()
            with self._gate.hold(session_id):
                yield from summary.map_reduce(self.engine, self.config.sampling, system, documents, turn,
                                              cancel, progress, observers=[meter])
            turn.read_share, turn.spotlight = meter.share(), not self.engine.decodes_densely
            stats = {**turn.stats(), "summary": "map-reduce"}
            turn.message_id = self.store.transcript.add_message(session_id, "assistant", turn.text, parent_id=user.id,
                                                     metadata={"stats": stats}).id
        yield turn

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
        documents = tuple(self._document(d.id) for d in self.store.transcript.session_documents(session_id))
        return Conversation(session.system_prompt, documents, tuple((r.role, r.content) for r in records))

    def _document(self, document_id: str) -> AttachedDocument:
        """The document with its stored segments. A document stored without segments (before
        they were stored at ingest, or imported) is cut now, once, and its segments stored."""
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
        return self._documents[document_id]

    def _check_fits(self, conversation: Conversation) -> None:
        try:
            self.runner.check_fits(conversation)
        except SpotlightError as error:
            raise ConversationTooLong(str(error)) from error

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


def too_long(name: str, room: int, window: int) -> str:
    """Why a document does not fit, in the user's terms, and what they can do."""
    return (f"{name} is longer than the {max(room, 0):,} tokens left in this conversation: the model reads "
            f"at most {window:,} tokens at once (about {window // 400:,} pages). Attach a shorter excerpt, "
            "or start a new chat for it.")


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
