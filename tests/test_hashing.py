"""Encoders and their checkpoint format. Issue #3."""
import pytest
import torch

from conftest import tiny_pair
from spotlight.errors import CorruptCheckpoint, EncoderMismatch
from spotlight.hashing import EncoderSpec, Encoders, load_encoders


def encoders(bits=128, **kw):
    _, model = tiny_pair("llama")
    return Encoders(EncoderSpec.for_model(model.args, bits, **kw), seed=3, model_fingerprint="model-a",
                    provenance={"trained": True, "corpus": "test"})


def test_checkpoint_round_trip_keeps_weights_spec_and_provenance(tmp_path):
    enc = encoders()
    fingerprint = enc.save(tmp_path / "enc.safetensors")
    back = load_encoders(tmp_path / "enc.safetensors", model_fingerprint="model-a", bits=128)
    assert back.spec == enc.spec
    assert back.provenance == {"trained": True, "corpus": "test"}
    assert back.fingerprint == fingerprint and len(fingerprint) == 32
    for (name, a), (_, b) in zip(enc.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_for_another_model_is_refused(tmp_path):
    encoders().save(tmp_path / "enc.safetensors")
    with pytest.raises(EncoderMismatch, match="trained for model 'model-a'"):
        load_encoders(tmp_path / "enc.safetensors", model_fingerprint="model-b")


def test_wrong_bit_count_is_refused(tmp_path):
    encoders(bits=64).save(tmp_path / "enc.safetensors")
    with pytest.raises(EncoderMismatch, match="64-bit codes but 128 bits"):
        load_encoders(tmp_path / "enc.safetensors", bits=128)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "enc.safetensors"
    encoders().save(path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x13" * 100, "empty": b""}[damage])
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        load_encoders(path)


@pytest.mark.parametrize("bits,depth", [(32, 0), (64, 1), (128, 2), (256, 1)])
def test_code_shapes_for_every_bit_count(bits, depth):
    enc = encoders(bits=bits, depth=depth)
    q = torch.randn(enc.spec.n_heads, 3, enc.spec.head_dim)
    k = torch.randn(enc.spec.n_kv_heads, 3, enc.spec.head_dim)
    assert enc.query_bits(0, q).shape == (enc.spec.n_heads, 3, bits)
    assert enc.key_bits(1, k).shape == (enc.spec.n_kv_heads, 3, bits)


def test_random_init_differs_from_identity():
    ident, rand = encoders(init="identity"), encoders(init="random")
    x = torch.randn(ident.spec.n_kv_heads, 4, ident.spec.head_dim)
    assert not torch.equal(ident.key_bits(0, x) > 0, rand.key_bits(0, x) > 0)


def test_trained_encoders_are_found_by_model_and_bits_in_the_users_folder(tmp_path):
    from spotlight.engine import encoder_dirs, trained_encoders

    home = tmp_path / "home"
    (home / "encoders").mkdir(parents=True)
    encoders(bits=64).save(home / "encoders" / "a-64.safetensors")
    encoders(bits=128).save(home / "encoders" / "a-128.safetensors")
    (home / "encoders" / "broken.safetensors").write_bytes(b"\x13" * 100)
    dirs = encoder_dirs(home)[1:]  # the user's folder only (the shipped ones are for SmolLM2)
    assert [trained_encoders(fp, bits, dirs) for fp, bits in
            [("model-a", 128), ("model-a", 64), ("model-b", 128), ("model-a", 32)]] == [
        home / "encoders" / "a-128.safetensors", home / "encoders" / "a-64.safetensors", None, None]
