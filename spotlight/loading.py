"""Find, convert and load models, offline only.

Model sources (`--model NAME|PATH`, EngineConfig.model_path):
  - nothing: the default, the packaged model `qwen2.5-coder-0.5b-instruct` (six wheels whose
    parts join into one checksum-pinned GGUF; chosen by bench/docqa.py, docs/DECISIONS.md);
  - a packaged model's name (spotlight/packaged.py MODELS, e.g. `qwen2.5-coder-0.5b-instruct`):
    its bytes are checked against the pinned size and sha256 (the hash remembered by size and
    mtime in `<home>/cache/file-stamps.json`, spotlight/digests.py, so a start rehashes only a
    changed file); split models are joined once into `<home>/cache/models/`. Damaged bytes raise
    PackagedModelCorrupt naming the file and the command that restores it;
  - a GGUF file: its metadata read first (a cut-short or unreadable file raises CorruptModel),
    then its config and tokenizer written once under `<home>/cache/models/<name>-<hash>/`
    (to a temporary directory, then renamed, so a crash never leaves a half copy under the final
    name); the weights stay in the GGUF (spotlight/quantized.py reads its blocks) unless the
    caller needs fp32 weights (`--weights fp32`, training, the oracle tests): then transformers
    dequantises them once into an fp32 safetensors copy in the same directory;
  - a local Hugging Face directory (config.json + *.safetensors) of a Llama, Qwen2 or
    Mistral model.
`<home>/models/` is the user's own folder (what spotlight/catalog.py lists); nothing is written
there. Nothing is ever fetched from a hub: offline mode is set before transformers is imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .config import SUPPORTED_ARCHITECTURES, ModelArgs  # noqa: E402
from .digests import FileStamps  # noqa: E402
from .errors import CorruptModel, HomeNotWritable, ModelNotFound, UnsupportedModel  # noqa: E402
from . import tokens  # noqa: E402
from .packaged import MODELS, QWEN_CODER_05B, PackagedModel, package_dir, packaged_gguf, packages_in, part_paths  # noqa: E402

DEFAULT_MODEL = QWEN_CODER_05B.name  # the best answering model of bench/docqa.py (issue #22)
Locate = Callable[[str], "Path | None"]  # a package's directory by name (packaged.package_dir, packages_in)
_SAMPLE_BYTES = 1 << 20  # bytes hashed at each of three places of a weight file for its fingerprint


@dataclass(frozen=True)
class ModelSource:
    """A loadable Hugging Face directory plus where it came from."""

    hf_dir: Path
    origin: str  # the path the user gave, or the packaged model's GGUF
    fingerprint: str  # stable id of the exact weights, config and tokenizer

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the weights were converted from; None for a Hugging Face directory."""
        path = Path(self.origin)
        return path if path.suffix.lower() == ".gguf" else None


def locator(packages_dir: str | None) -> Locate:
    """How packaged models' package directories are found: the installed packages, or (with
    EngineConfig.packages_dir) the folders under one directory."""
    return package_dir if packages_dir is None else packages_in(Path(packages_dir))


def models_dir(home: Path) -> Path:
    """The user's models folder: GGUF files and Hugging Face directories put there are listed."""
    return Path(home) / "models"


def cache_dir(home: Path) -> Path:
    """Where joined packaged models and GGUF conversions are kept (not the user's folder)."""
    return Path(home) / "cache" / "models"


def file_stamps(home: Path) -> FileStamps:
    """The remembered hashes and GGUF metadata of model files (spotlight/digests.py)."""
    return FileStamps(Path(home) / "cache" / "file-stamps.json")


def packaged_path(model: PackagedModel, home: Path, locate: Locate = package_dir) -> Path:
    """The verified GGUF of a packaged model (joined once under `cache_dir(home)` when split)."""
    if len(model.parts) > 1 and not (cache_dir(home) / model.file_name).is_file():
        _ensure_writable(cache_dir(home))  # the join writes there: say so in the user's words first
    return packaged_gguf(model, cache_dir(home), locate, file_stamps(home).sha256)


def resolve(model_path: str | None, home: Path, fp32_weights: bool = True, *, locate: Locate = package_dir,
            registry: Mapping[str, PackagedModel] = MODELS) -> ModelSource:
    """Turn a user's model argument (None, a packaged model's name, or a path) into a loadable HF
    directory, converting a GGUF once. `locate` finds packaged models' package directories.

    fp32_weights=False: a GGUF's directory needs only its config and tokenizer (the quantized
    engine reads the weights from the GGUF itself), so no fp32 copy is made."""
    name = DEFAULT_MODEL if model_path is None else model_path.strip()
    if name in registry:
        return _converted(packaged_path(registry[name], home, locate), home, fp32_weights)
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelNotFound(
            f"model path {str(path)!r} does not exist; pass a GGUF file, a Hugging Face model directory "
            f"or a packaged model's name ({', '.join(registry)})"
        )
    if not os.access(path, os.R_OK):
        raise ModelNotFound(f"model path {str(path)!r} is not readable; check its permissions")
    if path.is_dir():
        check_hf_dir(path)
        return ModelSource(path, str(path), fingerprint_dir(path))
    if path.suffix.lower() != ".gguf":
        raise UnsupportedModel(
            f"{str(path)!r} is neither a GGUF file nor a Hugging Face directory; "
            f"supported: a .gguf file or a directory with config.json and *.safetensors"
        )
    check_gguf_architecture(path, gguf_facts(path, home))
    return _converted(path, home, fp32_weights)


def gguf_facts(path: Path, home: Path) -> dict:
    """{"arch": ..., "window": ...} from a GGUF's metadata, remembered while the file is unchanged
    (an unreadable file's reason too, so a listing does not parse it again). Raises CorruptModel
    for a file gguf's reader cannot parse (cut short, damaged, not a GGUF)."""
    try:
        facts = file_stamps(home).get(path, "gguf", read_gguf_facts)
    except OSError as exc:  # not remembered: fixing the permissions must not need a new mtime
        raise ModelNotFound(f"cannot read {str(path)!r} ({exc.strerror or exc}); check its permissions") from exc
    if "unreadable" in facts:
        raise CorruptModel(
            f"cannot read the GGUF file {str(path)!r} ({facts['unreadable']}): it is damaged, cut short "
            f"(an interrupted download or copy?) or not a GGUF; copy it again from where you got it")
    return facts


def read_gguf_facts(path: Path) -> dict:
    """The architecture and context window in a GGUF's metadata, read by gguf's reader (which
    maps the file and checks every tensor's extent; no tensor is loaded or converted), or
    {"unreadable": why} when the reader cannot parse it."""
    import gguf

    try:
        fields = gguf.GGUFReader(path).fields
        arch = fields["general.architecture"].contents()
        window = fields.get(f"{arch}.context_length")
        return {"arch": arch, "window": int(window.contents()) if window is not None else None}
    except (ValueError, IndexError, KeyError) as exc:
        return {"unreadable": str(exc) or type(exc).__name__}


def check_gguf_architecture(path: Path, facts: dict) -> None:
    if facts["arch"] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {facts['arch']!r} of {str(path)!r} is not supported; "
                               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def check_hf_dir(path: Path) -> dict:
    """The config of a supported Hugging Face directory; UnsupportedModel says what is missing."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UnsupportedModel(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"cannot read {config_file}: {exc}") from exc
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {arch!r} in {config_file} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if not list(path.glob("*.safetensors")):
        raise UnsupportedModel(f"{str(path)!r} has no *.safetensors weights (PyTorch .bin files are not loaded)")
    return config


def fingerprint_dir(path: Path) -> str:
    """Hash config, tokenizer files and samples of every weight file (size + start/middle/end)."""
    stamp = path / "fingerprint.txt"
    if stamp.is_file():  # written by our own conversion: the GGUF's full hash
        return stamp.read_text().strip()
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (path / name).is_file():
            digest.update(name.encode() + (path / name).read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            for offset in (0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)):
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def has_fp32_weights(directory: Path) -> bool:
    """Whether a converted GGUF directory holds the fp32 safetensors copy (one file or an index
    of shards, the index written last)."""
    return (directory / "model.safetensors").is_file() or (directory / "model.safetensors.index.json").is_file()


def _converted(gguf: Path, home: Path, fp32_weights: bool = True) -> ModelSource:
    """Write a GGUF's config and tokenizer (and with fp32_weights its dequantised weights) into
    `cache_dir(home)` once; later calls reuse them."""
    file_hash = file_stamps(home).sha256(gguf)
    models = cache_dir(home)
    target = models / f"{gguf.stem}-{file_hash[:12]}"
    complete = (target / "fingerprint.txt").is_file()
    if not complete or (fp32_weights and not has_fp32_weights(target)):
        _ensure_writable(models)
        _convert_gguf(gguf, target, file_hash, fp32_weights)
    return ModelSource(target, str(gguf), file_hash[:32])


def _ensure_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise HomeNotWritable(
            f"cannot write to the data directory {str(directory)!r} ({exc.strerror or exc}); "
            f"set SPOTLIGHT_HOME to a writable directory"
        ) from exc


def _convert_gguf(gguf: Path, target: Path, file_hash: str, fp32_weights: bool = True) -> None:
    """Config + tokenizer (+ with fp32_weights the dequantised weights) of `gguf` into `target`.
    A target that has config and tokenizer but no weights gets the weight files moved in, the
    index (if sharded) last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for stale in target.parent.glob(".convert-*"):  # left by a crash mid-conversion
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        try:
            if fp32_weights:
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
                )
                config = model.config
            else:  # the GGUF's metadata only: nothing is dequantised
                config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        except (ValueError, KeyError, OSError) as exc:
            raise UnsupportedModel(f"cannot load GGUF {str(gguf)!r}: {exc}") from exc
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"GGUF architecture {config.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        if fp32_weights:
            # The weights are already plain fp32 tensors; drop the quantizer so save_pretrained works.
            model.hf_quantizer = None
            model.save_pretrained(tmp)
        else:
            config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "fingerprint.txt").write_text(file_hash[:32] + "\n")
        _fsync_tree(tmp)
        if (target / "fingerprint.txt").is_file():  # config and tokenizer are there already
            if fp32_weights and not has_fp32_weights(target):
                weights = sorted(tmp.glob("*.safetensors")) + sorted(tmp.glob("model.safetensors.index.json"))
                for file in weights:
                    os.replace(file, target / file.name)
                _fsync_dir(target)
            shutil.rmtree(tmp)
            return
        if target.exists():  # a directory without fingerprint: an interrupted copy of old
            shutil.rmtree(target)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(directory: Path) -> None:
    for file in directory.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# config.json keys ModelArgs.from_hf_config reads without a default of its own; where one is
# missing, transformers' config class supplies its default
REQUIRED_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size", "max_position_embeddings", "rms_norm_eps")


def load_args(source: ModelSource) -> ModelArgs:
    """The ModelArgs of a resolved model, from its config.json as written; through transformers'
    AutoConfig (24 MiB more memory) only where a key it needs is missing."""
    config = _model_file(source.hf_dir / "config.json", json.loads)
    if isinstance(config, dict) and all(key in config for key in REQUIRED_CONFIG_KEYS):
        return ModelArgs.from_hf_config(types.SimpleNamespace(**config))
    from transformers import AutoConfig

    return ModelArgs.from_hf_config(AutoConfig.from_pretrained(source.hf_dir, local_files_only=True))


def load_tokenizer(source: ModelSource):
    """The model's tokenizer: a `tokens.TemplateTokenizer` over its tokenizer.json and chat
    template where its tokenizer_config.json asks for nothing more (the packaged models; ~100 MiB
    less memory), else transformers' tokenizer class."""
    directory = source.hf_dir
    config_file, tokenizer_file = directory / "tokenizer_config.json", directory / "tokenizer.json"
    config = _model_file(config_file, json.loads) if config_file.is_file() and tokenizer_file.is_file() else None
    specials = tokens.plain_config(config) if isinstance(config, dict) else None
    if specials is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    import tokenizers

    template_file = directory / "chat_template.jinja"
    template = _model_file(template_file) if template_file.is_file() else config.get("chat_template")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust library raises plain Exception for a bad file
        raise _damaged(tokenizer_file, exc) from exc
    return tokens.TemplateTokenizer(tokenizer, template, specials)


def _model_file(file: Path, parse: Callable[[str], object] = str):
    """`parse` of the text of one file of a model's directory; CorruptModel naming the file where it
    cannot be read, is not UTF-8 text or does not parse."""
    try:
        return parse(file.read_text())
    except (OSError, ValueError) as exc:
        raise _damaged(file, exc) from exc


def _damaged(file: Path, exc: Exception) -> CorruptModel:
    return CorruptModel(f"cannot read {str(file)!r} ({exc}); restore the model's directory")


def load_state_dict(source: ModelSource) -> dict:
    """All weight tensors of the HF directory (memory-mapped safetensors)."""
    from safetensors.torch import load_file

    state = {}
    for weights in sorted(source.hf_dir.glob("*.safetensors")):
        state.update(load_file(weights))
    return state
