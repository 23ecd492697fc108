"""Persistent memory: sessions, branch-aware messages, documents, and KV spans on disk.

`Store` (memory/store.py) is the only code that touches the SQLite index or the span
files: it composes `Connections` (memory/connections.py), `store.transcript` (a
`Transcript`, memory/transcript.py) and `store.spans` (a `SpanIndex`, memory/spans.py).
`records` holds ids, `SpanKey` and the row records; `blobs` owns the span file format;
`errors` holds the named failures; `Scratch` (memory/scratch.py) the short-lived files (uploads
while they are read, exports for download) and `store.settings` the app's saved settings.
`python -m memory verify [PATH]` checks a store.
Importing this package does not import torch.
"""

from memory.blobs import SpanFile, SpanTensors, prefix_hash, tokens_sha256
from memory.errors import (
    DocumentNotFound,
    FingerprintMismatch,
    MalformedSpan,
    MessageNotFound,
    NotFound,
    PrefixNotFound,
    SchemaTooNew,
    SessionNotFound,
    SpanCorrupt,
    SpanEvicted,
    SpanMissing,
    SpanNotFound,
    SpanSlotTaken,
    SpanUnavailable,
    StoreCorrupt,
    StoreError,
    StoreLocked,
    StoreWriteError,
)
from memory.records import (
    CacheSize,
    DocumentId,
    DocumentRecord,
    MessageId,
    MessageRecord,
    PrefixHash,
    PrefixRecord,
    SegmentId,
    SegmentRecord,
    SegmentSpec,
    SessionId,
    SessionRecord,
    SpanId,
    SpanKey,
    SpanRecord,
)
from memory.scratch import Scratch
from memory.settings import SavedSettings
from memory.spans import SpanIndex
from memory.store import ACTIVE_LEAF, SCHEMA_VERSION, Store, verify
from memory.transcript import Transcript

__all__ = [
    "ACTIVE_LEAF",
    "SCHEMA_VERSION",
    "CacheSize",
    "DocumentId",
    "DocumentNotFound",
    "DocumentRecord",
    "FingerprintMismatch",
    "MalformedSpan",
    "MessageId",
    "MessageNotFound",
    "MessageRecord",
    "NotFound",
    "PrefixHash",
    "PrefixNotFound",
    "PrefixRecord",
    "SavedSettings",
    "Scratch",
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
    "SpanIndex",
    "SpanKey",
    "SpanMissing",
    "SpanNotFound",
    "SpanRecord",
    "SpanSlotTaken",
    "SpanTensors",
    "SpanUnavailable",
    "Store",
    "StoreCorrupt",
    "StoreError",
    "StoreLocked",
    "StoreWriteError",
    "Transcript",
    "prefix_hash",
    "tokens_sha256",
    "verify",
]
