"""Named errors of the chat service; the UI turns them into toasts."""


class ChatError(ValueError):
    """Base class for the chat service's user-facing errors."""


class EngineBusy(ChatError):
    """Another reply is being generated for this conversation."""


class ModelUnavailable(ChatError):
    """The model could not be loaded; the message says why and how to fix it."""
