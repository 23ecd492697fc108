"""Model resolution and loading: clear errors for bad input, atomic conversion. Issue #2."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, TEST_HOME, TEST_MODEL, tiny_hf_config
from spotlight import loading
from spotlight.errors import CorruptModel, HomeNotWritable, ModelNotFound, UnsupportedModel
from tiny_models import write_tiny_gguf


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        loading.resolve(str(tmp_path / "nope"), tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(UnsupportedModel, match="no config.json"):
        loading.resolve(str(tmp_path), tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModel, match="'gpt2'.*supported: llama, qwen2, mistral"):
        loading.resolve(str(tmp_path), tmp_path)


def test_neither_gguf_nor_directory(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(UnsupportedModel, match="neither a GGUF file nor a Hugging Face directory"):
        loading.resolve(str(path), tmp_path)


def test_unreadable_gguf_is_refused_before_anything_is_written(tmp_path):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\x07" * 100)
    home = tmp_path / "home"
    with pytest.raises(CorruptModel, match="cannot read the GGUF file .*copy it again from where you got it"):
        loading.resolve(str(gguf), home)
    assert not (home / "cache" / "models").exists()


def test_gguf_that_does_not_convert_leaves_nothing_half_written(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "no-tokenizer.gguf")  # readable metadata, no tokenizer: transformers refuses
    home = tmp_path / "home"
    with pytest.raises(UnsupportedModel, match="cannot load GGUF"):  # the config-only conversion
        loading.resolve(str(gguf), home, fp32_weights=False)
    assert list((home / "cache" / "models").iterdir()) == []


def test_home_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(HomeNotWritable, match="set SPOTLIGHT_HOME"):
        loading.resolve(None, blocker / "home")


def test_local_hf_directory_loads_and_is_fingerprinted(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_hf_config("qwen2")).save_pretrained(tmp_path)
    source = loading.resolve(str(tmp_path), tmp_path)
    _, args = loading.load_config(source)
    assert (args.arch, args.qkv_bias, args.n_kv_heads) == ("qwen2", True, 2)
    assert source.fingerprint == loading.resolve(str(tmp_path), tmp_path).fingerprint


@pytest.mark.model
def test_default_model_is_cached_once_under_home(engine):
    """The quantized engine needs only config and tokenizer from the GGUF's directory; asking for
    fp32 weights later adds the copy into the same directory (a cache, not the user's models folder)."""
    directory = engine.source.hf_dir
    assert directory.parent == TEST_HOME / "cache" / "models"
    assert {"config.json", "tokenizer.json", "fingerprint.txt"} <= {p.name for p in directory.iterdir()}
    fp32 = loading.resolve(engine.source.origin, TEST_HOME)
    assert (fp32.hf_dir, fp32.fingerprint) == (directory, engine.source.fingerprint)
    assert (directory / "model.safetensors").is_file() and loading.has_fp32_weights(directory)
    assert not list((TEST_HOME / "cache" / "models").glob(".convert-*"))


def cli(*args, stdin=b"", env_home=TEST_HOME):
    import os

    env = {**os.environ, "SPOTLIGHT_HOME": str(env_home)}
    return subprocess.run([sys.executable, "-m", "spotlight", *args], input=stdin, capture_output=True,
                          cwd=ROOT, env=env, timeout=300)


def test_cli_help_lists_commands_and_options():
    out = cli("--help")
    assert out.returncode == 0 and b"chat" in out.stdout and b"generate" in out.stdout
    out = cli("generate", "--help")
    assert out.returncode == 0 and b"--prompt-file" in out.stdout and b"--temperature" in out.stdout
    help_text = b" ".join(out.stdout.split())  # argparse wraps lines
    assert b"--quantize {q8_0}" in help_text and b"no fp32 copy" in help_text and b"1/4 of the fp32 bytes" in help_text


def test_cli_non_utf8_prompt_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    out = cli("generate", "--prompt-file", str(bad))
    assert out.returncode == 2
    assert b"not valid UTF-8" in out.stderr and b"Traceback" not in out.stderr


def test_cli_missing_model_is_a_clear_error():
    out = cli("generate", "--model", "/nonexistent/model", stdin=b"hello")
    assert out.returncode == 2
    assert b"does not exist" in out.stderr and b"Traceback" not in out.stderr


def test_cli_kernel_threads_out_of_range_is_a_clear_error():
    out = cli("generate", "--kernel-threads", "0", stdin=b"hello")
    assert out.returncode == 2
    assert b"kernel_threads must be >= 1, got 0" in out.stderr and b"Traceback" not in out.stderr
    out = cli("generate", "--kernel-threads", "100000", stdin=b"hello")
    assert out.returncode == 2
    assert b"threads must be in [1, " in out.stderr and b"got 100000" in out.stderr and b"Traceback" not in out.stderr


@pytest.mark.model
def test_cli_prompt_longer_than_context_names_the_limit(engine, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)
    # dense: the model's window is the limit (with Spotlight on the prompt is read past it, issue #21)
    out = cli("generate", "--model", TEST_MODEL, "--raw", "--no-spotlight", "--prompt-file", str(long))
    assert out.returncode == 2
    assert b"at most 8,192 fit this conversation" in out.stderr and b"Traceback" not in out.stderr, out.stderr


@pytest.mark.model
def test_cli_generate_streams_a_completion(engine):
    out = cli("generate", "--model", TEST_MODEL, "--max-new-tokens", "8", stdin=b"What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert b"Paris" in out.stdout
