"""Span files (memory/blobs.py): format, round trips, corruption detection, failed writes."""

import errno

import numpy as np
import pytest
import torch
from safetensors import safe_open

from memory import blobs
from memory.blobs import SpanTensors
from memory.errors import MalformedSpan, SpanCorrupt, SpanMissing, StoreWriteError
from memory.records import SpanKey

KEY = SpanKey("model-fp", "encoder-fp", "0123456789abcdef")

L, HKV, T, D, W = 2, 3, 5, 4, 2  # tiny shapes: layers, KV heads, tokens, head dim, code words


def make_tensors(dtype=np.float32, words=W, seed=0, n_tokens=T) -> SpanTensors:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((L, HKV, n_tokens, D)).astype(dtype)  # [L, Hkv, T, D]
    v = rng.standard_normal((L, HKV, n_tokens, D)).astype(dtype)  # [L, Hkv, T, D]
    codes = rng.integers(0, 2**64, size=(L, HKV, words, n_tokens), dtype=np.uint64)  # [L, Hkv, W, T]
    codes[..., :1, :1] = np.uint64(2**64 - 1)  # high bit set: must survive exactly
    return SpanTensors(k=k, v=v, token_ids=np.arange(100, 100 + n_tokens), key_codes=codes)


def write(tmp_path, tensors, name="s.safetensors", start_pos=7):
    prepared = blobs.prepare(tensors)
    meta = blobs.span_metadata(prepared, KEY, start_pos)
    return blobs.write_span_file(tmp_path, name, prepared, meta)


def read(tmp_path, written, **kwargs):
    return blobs.read_span_file(tmp_path / written.name, "span-1", written.bytes, written.checksum, **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_round_trip_is_exact(tmp_path, dtype):
    tensors = make_tensors(dtype)
    written = write(tmp_path, tensors)
    span = read(tmp_path, written)
    np.testing.assert_array_equal(span.k, tensors.k)
    np.testing.assert_array_equal(span.v, tensors.v)
    np.testing.assert_array_equal(span.key_codes, tensors.key_codes)
    assert span.token_ids.tolist() == [100, 101, 102, 103, 104]
    assert (span.k.dtype, span.key_codes.dtype, span.token_ids.dtype) == (
        np.dtype(dtype),
        np.uint64,
        np.int64,
    )
    assert (span.dtype, span.key, span.start_pos, span.n_tokens) == (np.dtype(dtype).name, KEY, 7, T)
    assert written.checksum.startswith(f"{blobs.CHECKSUM_ALGO}:")  # xxh3_128 when xxhash is installed
    assert written.bytes == (tmp_path / written.name).stat().st_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_round_trip_is_exact(tmp_path, dtype):
    k = torch.randn(L, HKV, T, D).to(dtype)
    v = torch.randn(L, HKV, T, D).to(dtype)
    codes = torch.from_numpy(make_tensors().key_codes)
    tensors = SpanTensors(k=k, v=v, token_ids=torch.arange(T, dtype=torch.int32), key_codes=codes)
    span = read(tmp_path, write(tmp_path, tensors)).to_torch()
    assert span.k.dtype == dtype and span.v.dtype == dtype
    assert torch.equal(span.k, k) and torch.equal(span.v, v)
    assert torch.equal(span.key_codes.view(torch.int64), codes.view(torch.int64))
    assert span.token_ids.tolist() == [0, 1, 2, 3, 4] and span.token_ids.dtype == torch.int64


def test_file_is_standard_safetensors(tmp_path):
    tensors = make_tensors(np.float16)
    written = write(tmp_path, tensors)
    with safe_open(str(tmp_path / written.name), framework="numpy") as file:
        assert file.metadata() == {
            "format": "spotlight-span/1",
            "model_fp": "model-fp",
            "encoder_fp": "encoder-fp",
            "prefix_digest": "0123456789abcdef",
            "dtype": "float16",
            "start_pos": "7",
            "n_tokens": "5",
        }
        assert sorted(file.keys()) == ["k", "key_codes", "token_ids", "v"]
        np.testing.assert_array_equal(file.get_tensor("key_codes"), tensors.key_codes)
        np.testing.assert_array_equal(file.get_tensor("v"), tensors.v)


def test_codes_absent_or_empty(tmp_path):
    absent = make_tensors()
    absent.key_codes = None
    assert read(tmp_path, write(tmp_path, absent, "a.safetensors")).key_codes is None
    empty = make_tensors(words=0)
    span = read(tmp_path, write(tmp_path, empty, "b.safetensors"))
    assert span.key_codes.shape == (L, HKV, 0, T)


def test_a_file_written_with_a_code_summary_still_reads(tmp_path):
    """Files written before session 38 hold `code_summary` (per-bit code counts, read by the retired
    two-level retrieval) between key_codes and token_ids: reading returns the same span without it."""
    import json

    tensors = make_tensors()
    prepared = blobs.prepare(tensors)
    summary = np.arange(L * HKV * 64 * W, dtype=np.int32).reshape(L, HKV, 64 * W)
    arrays = {"key_codes": prepared.arrays["key_codes"], "code_summary": summary,
              "token_ids": prepared.arrays["token_ids"], "k": prepared.arrays["k"], "v": prepared.arrays["v"]}
    header, offset = {"__metadata__": blobs.span_metadata(prepared, KEY, 7)}, 0
    for name, array in arrays.items():
        code = {"uint64": "U64", "int32": "I32", "int64": "I64", "float32": "F32"}[array.dtype.name]
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = len(text).to_bytes(8, "little") + text + b"".join(a.tobytes() for a in arrays.values())
    (tmp_path / "old.safetensors").write_bytes(data)
    span = blobs.read_span_file(tmp_path / "old.safetensors", "old", len(data),
                                f"{blobs.CHECKSUM_ALGO}:{blobs.checksum(data)}")
    np.testing.assert_array_equal(span.k, tensors.k)
    np.testing.assert_array_equal(span.key_codes, tensors.key_codes)
    assert (span.token_ids.tolist(), span.key, span.start_pos) == ([100, 101, 102, 103, 104], KEY, 7)
    with safe_open(str(tmp_path / "old.safetensors"), framework="numpy") as f:  # a standard file, as written
        np.testing.assert_array_equal(f.get_tensor("code_summary"), summary)


def test_views_are_copy_on_write(tmp_path):
    tensors = make_tensors()
    written = write(tmp_path, tensors)
    span = read(tmp_path, written)
    span.k[...] = 0  # writable, but private to this mapping
    np.testing.assert_array_equal(read(tmp_path, written).k, tensors.k)


def test_flipped_byte_is_corrupt(tmp_path):
    written = write(tmp_path, make_tensors())
    path = tmp_path / written.name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(SpanCorrupt, match="checksum mismatch"):
        read(tmp_path, written)
    read(tmp_path, written, verify=False)  # size still matches: only the checksum can tell


def test_truncated_file_is_corrupt(tmp_path):
    written = write(tmp_path, make_tensors())
    path = tmp_path / written.name
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(SpanCorrupt, match=f"size {written.bytes - 10} bytes, expected {written.bytes}"):
        read(tmp_path, written)


def test_deleted_file_is_missing(tmp_path):
    written = write(tmp_path, make_tensors())
    (tmp_path / written.name).unlink()
    with pytest.raises(SpanMissing, match="is missing"):
        read(tmp_path, written)


def test_bad_header_with_matching_checksum_is_corrupt(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes((1000).to_bytes(8, "little") + b"{}      ")
    digest = f"{blobs.CHECKSUM_ALGO}:" + blobs.checksum(path.read_bytes())
    with pytest.raises(SpanCorrupt, match="bad header"):
        blobs.read_span_file(path, "span-1", 16, digest)


def test_crc32_checksums_stay_readable(tmp_path, monkeypatch):
    monkeypatch.setattr(blobs, "CHECKSUM_ALGO", "crc32")
    tensors = make_tensors()
    written = write(tmp_path, tensors)
    assert written.checksum.startswith("crc32:")
    np.testing.assert_array_equal(read(tmp_path, written).v, tensors.v)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def disk_full(file, buffer):
        calls.append(len(buffer))
        if len(calls) == 3:  # header and codes written, then the disk fills up
            raise OSError(errno.ENOSPC, "No space left on device")
        file.write(buffer)

    monkeypatch.setattr(blobs, "_write_all", disk_full)
    with pytest.raises(StoreWriteError, match="No space left on device; free disk space"):
        write(tmp_path, make_tensors())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(v=np.zeros((L, HKV, T + 1, D), np.float32)), "k and v must both be"),
        (
            dict(k=np.zeros((L, HKV, T, D), np.int32), v=np.zeros((L, HKV, T, D), np.int32)),
            "k must be float32",
        ),
        (dict(token_ids=np.arange(T - 1)), "token_ids must be"),
        (dict(key_codes=np.zeros((L, HKV, W, T), np.int64)), "key_codes must be"),
        (dict(key_codes=np.zeros((L, HKV, W, T + 1), np.uint64)), "key_codes must be"),
    ],
)
def test_prepare_rejects_bad_shapes(change, message):
    tensors = make_tensors()
    for field, value in change.items():
        setattr(tensors, field, value)
    with pytest.raises(MalformedSpan, match=message):
        blobs.prepare(tensors)


def test_prefix_hash_is_deterministic_and_specific():
    ids = [1, 2, 3, 50000]
    value = blobs.prefix_hash(ids, "model-a", "enc-a")
    # Pinned: a change of this value invalidates every cached prefix on users' disks.
    assert value == "0a2cbea07043382ca6e2f731fee7fbc50771a5dfb92c71a7706edf3c49aa8ace"
    assert blobs.prefix_hash(np.array(ids, np.int32), "model-a", "enc-a") == value
    assert blobs.prefix_hash(torch.tensor(ids), "model-a", "enc-a") == value
    others = {
        blobs.prefix_hash(ids[:-1], "model-a", "enc-a"),
        blobs.prefix_hash(ids, "model-b", "enc-a"),
        blobs.prefix_hash(ids, "model-a", "enc-b"),
        blobs.prefix_hash(ids, "model-a\0", "enc-a"),
        blobs.prefix_hash(ids, "model-a", "\0enc-a"),
    }
    assert value not in others and len(others) == 5
