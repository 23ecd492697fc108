"""Model resolution and loading: clear errors for bad input, atomic conversion. Issue #2."""
import json
import os
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
    args = loading.load_args(source)
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


def write_tokenizer_dir(directory, config: dict):
    """A tiny word-level tokenizer.json, the given tokenizer_config.json and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    return loading.ModelSource(directory, str(directory), "0" * 32)


def test_plain_tokenizer_configs_get_the_lean_tokenizer_others_transformers(tmp_path):
    from spotlight.tokens import TemplateTokenizer, plain_config

    plain = {"tokenizer_class": "TokenizersBackend", "eos_token": "<eos>", "unk_token": "<unk>"}
    lean = loading.load_tokenizer(write_tokenizer_dir(tmp_path / "plain", plain))
    assert (type(lean), lean.encode("hello world"), lean.eos_token_id, lean.unk_token_id,
            lean.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)) == \
        (TemplateTokenizer, [2, 3], 1, 0, "hello<eos>")
    for extra in ({"clean_up_tokenization_spaces": True}, {"add_bos_token": True}, {"chat_template": [{"name": "x"}]}):
        other = loading.load_tokenizer(write_tokenizer_dir(tmp_path / str(len(extra)) / next(iter(extra)), {**plain, **extra}))
        assert type(other) is not TemplateTokenizer and other.encode("hello world", add_special_tokens=False) == [2, 3]
    assert [plain_config(c) for c in (plain, {**plain, "pad_token": {"content": "<eos>", "lstrip": True}}, {"eos_token": 1})] == \
        [{"eos_token": "<eos>", "unk_token": "<unk>"}, None, None]


def test_damaged_tokenizer_files_say_which_file(tmp_path):
    source = write_tokenizer_dir(tmp_path, {"eos_token": "<eos>"})
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CorruptModel) as error:
        loading.load_tokenizer(source)
    assert str(error.value).startswith(f"cannot read {str(tmp_path / 'tokenizer.json')!r} (")
    assert str(error.value).endswith("); restore the model's directory")
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ bad }}")
    with pytest.raises(CorruptModel, match="chat_template.jinja"):
        loading.load_tokenizer(source)
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(CorruptModel, match="tokenizer_config.json"):
        loading.load_tokenizer(source)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_model_args_from_config_json_equal_transformers_config(tmp_path, arch):
    from transformers import AutoConfig

    tiny_hf_config(arch, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}).save_pretrained(tmp_path)
    source = loading.ModelSource(tmp_path, str(tmp_path), "0" * 32)
    from spotlight.config import ModelArgs

    want = ModelArgs.from_hf_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True))
    assert loading.load_args(source) == want
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rms_norm_eps"]  # a key it needs is missing: transformers' class default fills it
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert loading.load_args(source) == ModelArgs.from_hf_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True))


def test_damaged_config_json_says_which_file(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CorruptModel, match="config.json"):
        loading.load_args(loading.ModelSource(tmp_path, str(tmp_path), "0" * 32))


def test_quantized_model_skeleton_imports_no_compiler_stack():
    """The meta-device skeleton the quantized model is built on draws no random values and makes
    no meta tensors through torch's Python references: those import torch._dynamo and sympy
    (~90 MiB resident, issue #20)."""
    code = ("import sys, torch\nfrom spotlight.config import ModelArgs\nfrom spotlight.model import Transformer\n"
            "args = ModelArgs(vocab_size=211, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, "
            "intermediate_size=96, max_seq_len=512, arch='qwen2')\n"
            "with torch.device('meta'):\n    model = Transformer(args)\n"
            "print(model.tok_embeddings.weight.is_meta, model.inv_freq.device, 'torch._dynamo' in sys.modules, "
            "'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, "True cpu False False"), out.stderr[-2000:]
