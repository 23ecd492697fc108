"""Document readers (txt, md, pdf, docx) and semantic segmentation.

    doc = read_document("report.pdf", max_bytes=..., max_pages=...)   # -> Document
    segments = segment(doc, count_tokens, max_tokens=512, min_tokens=64, embed=None)

Pure functions: no model, no database. Failures are the named errors in `segmenter.errors`.
"""
from segmenter.errors import (
    CorruptDocument,
    DocumentError,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    NoTextLayer,
    UnsupportedFormat,
)
from segmenter.readers import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PAGES,
    SUPPORTED_EXTENSIONS,
    Document,
    Heading,
    PageStart,
    display_name,
    read_document,
)
from segmenter.segment import DEFAULT_MAX_TOKENS, DEFAULT_MIN_TOKENS, Segment, segment

__all__ = [
    "CorruptDocument", "DocumentError", "DocumentTooLarge", "EmptyDocument", "EncryptedDocument",
    "NoTextLayer", "UnsupportedFormat", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_PAGES", "SUPPORTED_EXTENSIONS",
    "Document", "Heading", "PageStart", "display_name", "read_document", "DEFAULT_MAX_TOKENS",
    "DEFAULT_MIN_TOKENS", "Segment", "segment",
]
