"""Named errors of the chat service; the UI turns them into toasts (only app.py builds `gr.Error`).

Every class is a `ValueError` (bad input or a state the user can fix) whose message says
what happened and what to do. `translated()` converts the store's and the engine's
errors at the service boundary, so callers of `chat/` catch `ChatError` alone.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import memory
from spotlight.errors import ContextTooLong


class ChatError(ValueError):
    """Base class for the chat service's user-facing errors."""


class EngineBusy(ChatError):
    """A reply is already being generated for this conversation (one reply at a time)."""

    def __init__(self, session_id: str, message: str | None = None):
        super().__init__(
            message
            or f"a reply is still being generated in conversation {session_id!r}; wait for it to "
            "finish or press Stop, then send again"
        )
        self.session_id = session_id


class ModelUnavailable(ChatError):
    """The model could not be loaded; the message says why and how to fix it."""


class NotFoundError(ChatError, LookupError):
    """Base of the "no such id" errors."""


class ConversationNotFound(NotFoundError):
    def __init__(self, session_id: str):
        super().__init__(
            f"no conversation with id {session_id!r}; it may have been deleted. Pick one from "
            "the conversation list (ChatService.list_sessions())"
        )
        self.session_id = session_id


class MessageNotFound(NotFoundError):
    def __init__(self, message_id: str, session_id: str | None = None):
        where = f" in conversation {session_id!r}" if session_id else ""
        super().__init__(
            f"no message with id {message_id!r}{where}; take message ids from ChatService.history()"
        )
        self.message_id = message_id


class InvalidAction(ChatError):
    """The action does not apply here (nothing to undo, editing an assistant message, ...)."""


class ConversationTooLong(ChatError):
    """The document(s) plus the conversation do not fit the model's context window.

    `fresh_chat_fits`: a new chat with the same documents would fit (the UI then offers
    "Continue in a new chat", `ChatService.continue_in_new_chat`)."""

    def __init__(self, message: str, *, fresh_chat_fits: bool = False):
        super().__init__(message)
        self.fresh_chat_fits = fresh_chat_fits


class ConversationChanged(ChatError):
    """The conversation changed (in another tab, or through the API) since the caller last
    showed it, so an action on it would act on something the user has not seen."""

    def __init__(self, session_id: str):
        super().__init__("This conversation changed in another tab; it has been refreshed. Look at it, then try again.")
        self.session_id = session_id


class DocumentTooLong(ChatError):
    """A document is longer than the app's limit for one document (`UploadLimits.max_tokens`)."""


class NotEnoughDisk(ChatError):
    """A document's KV cache would not fit the cache's disk budget or the free disk space; it
    is refused before it is read, and the message says how much it needs and what to free."""


class StorageUnavailable(ChatError):
    """The data directory cannot be used: another process holds it, it was written by a newer
    version, or it is unreadable. The message names the directory and the fix."""


class SaveFailed(ChatError):
    """A write failed (disk full, read-only directory); nothing was committed."""


class ImportFailed(ChatError):
    """An imported file is not a usable Spotlight Chat export."""


@contextlib.contextmanager
def translated(session_id: str | None = None) -> Iterator[None]:
    """Re-raise the store's and the engine's expected failures as `ChatError`s."""
    try:
        yield
    except memory.SessionNotFound as error:
        raise ConversationNotFound(error.session_id) from error
    except memory.MessageNotFound as error:
        raise MessageNotFound(error.message_id, session_id) from error
    except memory.NotFound as error:
        raise NotFoundError(str(error)) from error
    except memory.StoreWriteError as error:
        raise SaveFailed(str(error)) from error
    except (memory.StoreLocked, memory.SchemaTooNew, memory.StoreCorrupt) as error:
        raise StorageUnavailable(str(error)) from error
    except memory.StoreError as error:
        raise StorageUnavailable(f"the conversation store failed: {error}") from error
    except ContextTooLong as error:
        raise ConversationTooLong(str(error)) from error
