"""The one-row Linear swap applied at load time (spotlight/onerow.py, issue #18)."""
import torch
from torch import nn

from spotlight.testing import tiny_args
from spotlight.cache import KVCache
from spotlight.attention import DenseDecode
from spotlight.model import Transformer
from spotlight.onerow import OneRowLinear, use_onerow_linear


def test_swap_replaces_every_linear_sharing_its_parameters():
    torch.manual_seed(0)
    plain = Transformer(tiny_args(64)).eval().requires_grad_(False)
    weights = {name: p for name, p in plain.named_parameters()}
    swapped = use_onerow_linear(Transformer(tiny_args(64)).eval().requires_grad_(False))
    swapped.load_state_dict(plain.state_dict())
    kinds = {type(m) for m in swapped.modules() if isinstance(m, nn.Linear)}
    assert kinds == {OneRowLinear}
    assert {type(m) for m in plain.modules() if isinstance(m, nn.Linear)} == {nn.Linear}
    assert [name for name, _ in swapped.named_parameters()] == list(weights)
    assert use_onerow_linear(plain) is plain and all(
        p is weights[name] for name, p in plain.named_parameters())  # the same Parameters, not copies


def test_swapped_model_decodes_as_the_plain_one():
    torch.manual_seed(1)
    plain = Transformer(tiny_args(64)).eval().requires_grad_(False)
    swapped = Transformer(tiny_args(64)).eval().requires_grad_(False)
    swapped.load_state_dict(plain.state_dict())
    use_onerow_linear(swapped)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(2))
    logits = []
    for model in (plain, swapped):
        cache = KVCache(model.args, 32)
        with torch.inference_mode():
            model(ids, cache, DenseDecode())
            logits.append(model(torch.tensor([7]), cache, DenseDecode()))  # a one-row step
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
