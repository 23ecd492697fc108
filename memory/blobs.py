"""Span files: one safetensors file per span, written crash-safely, read memory-mapped.

Shape legend: L layers, Hkv KV heads, T tokens in the span, D head dim, W packed
64-bit words per key code.

A span file is a standard safetensors file (`safetensors.safe_open` reads it):

    u64 little-endian N | N bytes of JSON header, space-padded to a multiple of 8 | data

holding, in this order in the data (8-byte types first, so every view is aligned):

    key_codes     [L, Hkv, W, T] uint64   absent for a model without encoders
    token_ids     [T] int64
    k             [L, Hkv, T, D] float32 | float16 | bfloat16 (raw 16-bit words)
    v             [L, Hkv, T, D] same dtype as k

(files written before session 38 may also hold `code_summary` [L, Hkv, 64 W] int32 after
key_codes, per-bit counts that two-level retrieval read; reading maps every tensor the header
lists and returns the ones above, so such files stay valid) and metadata strings: format,
model_fp, encoder_fp, prefix_digest, dtype, start_pos, n_tokens (files written before
migration m003 have no prefix_digest and the packed encoder_fp "<enc or 'dense'>+prefix:<digest>";
reading splits it, see `records.SpanKey`).

Writing (`write_span_file`): a temporary name in the same directory (".<name>.tmp"),
written straight from the arrays' buffers (no serialised copy), fsynced, renamed to
its final name, then the directory fsynced. Only after that may the caller commit
the index row. The checksum is computed while writing: xxh3-128 of the whole file
(about 35 GB/s here, so ~40 ms for a 1.4 GB span set; blake2b runs at 1.4 GB/s and
zlib.crc32 at 7 GB/s). Without the `xxhash` package new files use crc32; the
checksum string names its algorithm ("xxh3_128:<hex>"), so both kinds stay readable.

Reading (`read_span_file`): map the file copy-on-write (arrays are writable views,
writes never reach the file), check size, then checksum, then header, and return
zero-copy numpy views. Errors: a missing file raises `SpanMissing`; any difference
in size, checksum or header raises `SpanCorrupt`.

Torch tensors are accepted duck-typed (anything with `.detach()`); torch itself is
imported lazily, only for bfloat16 and `SpanFile.to_torch()`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from memory.errors import MalformedSpan, SpanCorrupt, SpanMissing, StoreError, StoreWriteError
from memory.records import PrefixHash, SpanKey, split_legacy_encoder_fp

try:
    import xxhash
except ImportError:  # pragma: no cover - exercised only where xxhash is absent
    xxhash = None


FORMAT = "spotlight-span/1"
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
CHECKSUM_ALGO = "xxh3_128" if xxhash is not None else "crc32"

# numpy dtype name -> safetensors dtype code; bfloat16 travels as raw uint16 words.
_ST_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint64": "U64", "int64": "I64",
             "int32": "I32"}
_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U64": np.uint64, "I64": np.int64,
              "I32": np.int32}
KV_DTYPES = ("float32", "float16", "bfloat16")
_ORDER = ("key_codes", "token_ids", "k", "v")  # 8-byte types first: every view aligned


@dataclass(slots=True)
class SpanTensors:
    """What a caller hands in to store a span (numpy arrays or torch tensors, any device).

    k, v: [L, Hkv, T, D] float32 / float16 / bfloat16 (same dtype and shape).
    token_ids: [T] integers (stored as int64).
    key_codes: [L, Hkv, W, T] uint64, or None for a model without encoders.
    """

    k: Any
    v: Any
    token_ids: Any
    key_codes: Any = None


@dataclass(slots=True)
class SpanFile:
    """A span read back: zero-copy numpy views on the mapped file, plus its metadata.

    For dtype "bfloat16" k and v hold raw uint16 words; `to_torch()` reinterprets them.
    """

    k: Any  # [L, Hkv, T, D]
    v: Any  # [L, Hkv, T, D]
    token_ids: Any  # [T] int64
    key_codes: Any  # [L, Hkv, W, T] uint64, or None
    dtype: str
    key: SpanKey
    start_pos: int
    n_tokens: int

    def to_torch(self) -> "SpanFile":
        """The same span with torch tensors sharing the mapped memory (no copy)."""
        import torch

        def convert(array):
            return None if array is None else torch.from_numpy(array)

        k, v = convert(self.k), convert(self.v)
        if self.dtype == "bfloat16":
            k, v = k.view(torch.bfloat16), v.view(torch.bfloat16)
        return replace(self, k=k, v=v, token_ids=convert(self.token_ids), key_codes=convert(self.key_codes))


@dataclass(slots=True, frozen=True)
class PreparedSpan:
    """Validated, contiguous little-endian arrays ready to be written."""

    arrays: dict[str, np.ndarray]
    dtype: str  # float32 | float16 | bfloat16
    n_tokens: int


@dataclass(slots=True, frozen=True)
class WrittenFile:
    name: str  # file name inside the spans directory
    bytes: int
    checksum: str  # "<algo>:<hex>"


def prepare(tensors: SpanTensors) -> PreparedSpan:
    """Check shapes and dtypes and convert to numpy; raises MalformedSpan saying what to fix."""
    k, k_dtype = _to_numpy(tensors.k)
    v, v_dtype = _to_numpy(tensors.v)
    if k_dtype not in KV_DTYPES:
        raise MalformedSpan(f"k must be float32, float16 or bfloat16, got {k_dtype}; cast it first")
    if k.ndim != 4 or v.shape != k.shape or v_dtype != k_dtype:
        raise MalformedSpan(
            f"k and v must both be [L, Hkv, T, D] with one dtype; got k {k.shape} {k_dtype}, "
            f"v {v.shape} {v_dtype}"
        )
    n_layers, n_kv_heads, n_tokens, _ = k.shape
    if n_tokens < 1:
        raise MalformedSpan("a span needs at least one token")
    token_ids, ids_dtype = _to_numpy(tensors.token_ids)
    if token_ids.shape != (n_tokens,) or not np.issubdtype(token_ids.dtype, np.integer):
        raise MalformedSpan(f"token_ids must be [T={n_tokens}] integers, got {token_ids.shape} {ids_dtype}")
    arrays = {"token_ids": token_ids.astype("<i8", copy=False)}
    if tensors.key_codes is not None:
        codes, codes_dtype = _to_numpy(tensors.key_codes)
        if (
            codes_dtype != "uint64"
            or codes.ndim != 4
            or codes.shape[:2] != (n_layers, n_kv_heads)
            or codes.shape[3] != n_tokens
        ):
            raise MalformedSpan(
                f"key_codes must be [L={n_layers}, Hkv={n_kv_heads}, W, T={n_tokens}] uint64, "
                f"got {codes.shape} {codes_dtype}"
            )
        arrays["key_codes"] = codes
    arrays["k"], arrays["v"] = k, v
    little = {name: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for name, a in arrays.items()}
    return PreparedSpan(arrays=little, dtype=k_dtype, n_tokens=n_tokens)


def _to_numpy(value) -> tuple[np.ndarray, str]:
    """(array, logical dtype name). Torch tensors are moved to CPU; bfloat16 becomes raw uint16."""
    if hasattr(value, "detach"):  # a torch tensor, duck-typed
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            import torch

            return tensor.contiguous().view(torch.int16).numpy().view(np.uint16), "bfloat16"
        value = tensor.numpy()
    array = np.asarray(value)
    return array, array.dtype.name


def header_bytes(prepared: PreparedSpan, metadata: dict[str, str]) -> bytes:
    """The safetensors length prefix + JSON header for `prepared`, padded to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in _ORDER:
        array = prepared.arrays.get(name)
        if array is None:
            continue
        code = _ST_CODES[prepared.dtype if name in ("k", "v") else array.dtype.name]
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def span_metadata(prepared: PreparedSpan, key: SpanKey, start_pos: int) -> dict[str, str]:
    """The metadata strings stored in every span file's header."""
    return {
        "format": FORMAT,
        "model_fp": key.model_fp,
        "encoder_fp": key.encoder_fp,
        "prefix_digest": key.prefix_digest,
        "dtype": prepared.dtype,
        "start_pos": str(int(start_pos)),
        "n_tokens": str(prepared.n_tokens),
    }


def write_span_file(
    directory: Path, name: str, prepared: PreparedSpan, metadata: dict[str, str]
) -> WrittenFile:
    """Write `prepared` as `directory/name` crash-safely; returns its size and checksum.

    On any OSError nothing is left behind (neither the temporary nor the final file)
    and `StoreWriteError` is raised with the cause.
    """
    final = directory / name
    temp = directory / f".{name}{TEMP_SUFFIX}"
    chunks = [header_bytes(prepared, metadata)]
    chunks += [_byte_view(prepared.arrays[n]) for n in _ORDER if n in prepared.arrays]
    hasher = _new_hasher(CHECKSUM_ALGO)
    try:
        with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb", buffering=0) as file:
            for chunk in chunks:
                _write_all(file, chunk)
                hasher.update(chunk)
            os.fsync(file.fileno())
        os.replace(temp, final)
        fsync_directory(directory)
    except OSError as error:
        remove_quietly(temp)
        remove_quietly(final)
        raise StoreWriteError(
            f"could not write a span file in {directory}: {error.strerror or error}; free disk "
            "space, lower the disk budget, or set SPOTLIGHT_HOME to a writable directory. "
            "Nothing was stored."
        ) from error
    size = sum(len(chunk) for chunk in chunks)
    return WrittenFile(name=name, bytes=size, checksum=f"{CHECKSUM_ALGO}:{hasher.hexdigest()}")


def _byte_view(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))


def _write_all(file, buffer: memoryview | bytes) -> None:
    """Write every byte of `buffer` (raw files may write less than asked)."""
    view = memoryview(buffer)
    while view.nbytes:
        written = file.write(view)
        if not written:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[written:]


def read_span_file(
    path: Path, span_id: str, expected_bytes: int, expected_checksum: str, verify: bool = True
) -> SpanFile:
    """Map `path`, check size (+ checksum when `verify`), and return zero-copy views."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size != expected_bytes:
                raise SpanCorrupt(span_id, path, f"size {size} bytes, expected {expected_bytes}")
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise SpanMissing(span_id, path) from None
    except OSError as error:
        raise SpanCorrupt(span_id, path, f"cannot read it: {error.strerror or error}") from error
    if verify:
        algo, _, digest = expected_checksum.partition(":")
        if checksum(mapped, algo) != digest:
            raise SpanCorrupt(span_id, path, f"{algo} checksum mismatch")
    try:
        return _parse(mapped, size)
    except (ValueError, KeyError, TypeError) as error:
        raise SpanCorrupt(span_id, path, f"bad header: {error}") from error


def _parse(mapped: mmap.mmap, size: int) -> SpanFile:
    header_len = int.from_bytes(mapped[:8], "little")
    if not 2 <= header_len <= size - 8:
        raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
    header = json.loads(bytes(mapped[8 : 8 + header_len]))
    meta = header.pop("__metadata__")
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    base = 8 + header_len
    arrays = {}
    for name, info in header.items():
        dtype = np.dtype(_NP_DTYPES[info["dtype"]])
        shape = tuple(int(n) for n in info["shape"])
        begin, end = (int(n) for n in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or base + end > size:
            raise ValueError(f"tensor {name} offsets {begin}..{end} do not match shape {shape}")
        arrays[name] = np.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin).reshape(shape)
    return SpanFile(
        k=arrays["k"],  # [L, Hkv, T, D]
        v=arrays["v"],  # [L, Hkv, T, D]
        token_ids=arrays["token_ids"],  # [T]
        key_codes=arrays.get("key_codes"),  # [L, Hkv, W, T] or None
        dtype=meta["dtype"],
        key=_file_key(meta),
        start_pos=int(meta["start_pos"]),
        n_tokens=int(meta["n_tokens"]),
    )


def _file_key(meta: dict[str, str]) -> SpanKey:
    if "prefix_digest" in meta:
        return SpanKey(meta["model_fp"], meta["encoder_fp"], meta["prefix_digest"])
    return SpanKey(meta["model_fp"], *split_legacy_encoder_fp(meta["encoder_fp"]))  # before m003


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _new_hasher(algo: str):
    if algo == "crc32":
        return _Crc32()
    if algo == "xxh3_128":
        if xxhash is None:
            raise StoreError(
                "span checksums use xxh3_128 but the xxhash package is missing; "
                "install it with: pip install xxhash==4.1.0"
            )
        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def checksum(buffer, algo: str = CHECKSUM_ALGO) -> str:
    """Hex digest of `buffer` with `algo` (xxh3_128 or crc32)."""
    hasher = _new_hasher(algo)
    hasher.update(buffer)
    return hasher.hexdigest()


def tokens_sha256(token_ids) -> str:
    """sha256 of the token ids as little-endian int64: deterministic across processes."""
    array, _ = _to_numpy(token_ids)
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<i8").tobytes()).hexdigest()


def prefix_hash(token_ids, model_fp: str, encoder_fp: str) -> PrefixHash:
    """Content address of a cached prefix: its exact token ids + model + encoder fingerprints."""
    hasher = hashlib.sha256(b"spotlight-prefix/1\0")
    hasher.update(json.dumps([model_fp, encoder_fp]).encode())  # unambiguous field boundaries
    hasher.update(tokens_sha256(token_ids).encode())
    return PrefixHash(hasher.hexdigest())


def fsync_directory(directory: Path) -> None:
    """Make renames and creations in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: Path) -> None:
    """Delete `path` if it exists; errors are ignored (leftovers are cleaned on the next open)."""
    try:
        os.unlink(path)
    except OSError:
        pass
