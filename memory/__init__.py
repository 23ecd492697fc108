"""Persistent memory: sessions, branch-aware messages, documents, and KV spans on disk.

`Store` (memory/store.py: connections, lock, open, verify; assembled from
memory/transcript.py and memory/spans.py) is the only code that touches the SQLite
index or the span files; `blobs` owns the span file format; `errors` holds the named
failures.
Importing this package does not import torch.
"""

from memory.blobs import PrefixHash, SpanFile, SpanId, SpanTensors, prefix_hash, tokens_sha256
from memory.errors import (
    DocumentNotFound,
    FingerprintMismatch,
    MessageNotFound,
    NotFound,
    PrefixNotFound,
    SchemaTooNew,
    SessionNotFound,
    SpanCorrupt,
    SpanEvicted,
    SpanMissing,
    SpanNotFound,
    SpanUnavailable,
    StoreCorrupt,
    StoreError,
    StoreLocked,
    StoreWriteError,
)
from memory.migrations import (
    CacheSize,
    DocumentId,
    DocumentRecord,
    MessageId,
    MessageRecord,
    PrefixRecord,
    SegmentId,
    SegmentRecord,
    SegmentSpec,
    SessionId,
    SessionRecord,
    SpanRecord,
)
from memory.store import ACTIVE_LEAF, SCHEMA_VERSION, Store, verify

__all__ = [
    "ACTIVE_LEAF",
    "SCHEMA_VERSION",
    "CacheSize",
    "DocumentId",
    "DocumentNotFound",
    "DocumentRecord",
    "FingerprintMismatch",
    "MessageId",
    "MessageNotFound",
    "MessageRecord",
    "NotFound",
    "PrefixHash",
    "PrefixNotFound",
    "PrefixRecord",
    "SchemaTooNew",
    "SegmentId",
    "SegmentRecord",
    "SegmentSpec",
    "SessionId",
    "SessionNotFound",
    "SessionRecord",
    "SpanCorrupt",
    "SpanEvicted",
    "SpanFile",
    "SpanId",
    "SpanMissing",
    "SpanNotFound",
    "SpanRecord",
    "SpanTensors",
    "SpanUnavailable",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreLocked",
    "StoreWriteError",
    "prefix_hash",
    "tokens_sha256",
    "verify",
]
