"""Named failures of reading a document.

Every class subclasses `ValueError` (bad user input, per STYLE rule 14), so a caller that only
knows `ValueError` still catches them; the UI layer turns them into messages. Each message says
what went wrong with which file and how the user can fix it. Library exceptions (pypdf,
python-docx, zipfile) are always wrapped in one of these, with the original as `__cause__`.
"""
from __future__ import annotations


class DocumentError(ValueError):
    """Base class: a document could not be turned into text."""


class UnsupportedFormat(DocumentError):
    """The file type is not one we read, or its content is not what its extension claims."""


class CorruptDocument(DocumentError):
    """The file claims a supported format but its structure cannot be parsed."""


class NoTextLayer(DocumentError):
    """The file is readable but holds no extractable text (e.g. a scanned, image-only PDF)."""


class EncryptedDocument(NoTextLayer):
    """The file is password-protected, so its text layer cannot be read."""


class DocumentTooLarge(DocumentError):
    """The file exceeds a configured size or page limit."""


class EmptyDocument(DocumentError):
    """The file parses but contains no text at all."""
