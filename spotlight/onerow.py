"""One-row Linear: a decode step's weight products on kernels.linear's matrix-vector loop.

Applied at load time, the way gpt-fast applies weight-only quantization (quantize.py swaps
each `nn.Linear` for its own module): `use_onerow_linear(model)` replaces every `nn.Linear`
of a model with a `OneRowLinear` sharing its parameters, so spotlight/model.py stays plain
torch and the swap is one visible call in `Engine.load`.

Why: decode reads every weight once per token, so it is bound by weight bandwidth; on this
CPU class torch's (1, E) @ (E, F) path streams ~11 GB/s and the numba loop ~25 GB/s
(bench/spotlight_speed.py). Results equal F.linear's up to float summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import linear as cpu_linear
from kernels.cpu import HAVE_NUMBA


class OneRowLinear(nn.Linear):
    """nn.Linear whose one-row fp32 CPU inference (a decode step, the last prefill position)
    runs kernels.linear's matrix-vector loop instead of torch's GEMV. Anything else (T > 1,
    autograd, other dtypes or devices) is F.linear."""

    _matvec: cpu_linear.MatVec | None = None  # numpy views of weight and bias, made at the first one-row call
    _matvec_of: tuple = ()  # the (weight, bias) memory they view

    @classmethod
    def sharing(cls, linear: nn.Linear) -> "OneRowLinear":
        """A OneRowLinear over the same weight and bias Parameters (tied weights stay tied)."""
        with torch.device("meta"):  # no memory for weights that are replaced right away
            module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: self._parameters, not self.weight: nn.Module's attribute lookup costs ~1 us a time,
        # and a decode step makes ~120 of these calls
        weight, bias = self._parameters["weight"], self._parameters["bias"]
        if (x.shape[0] == 1 and x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32
                and HAVE_NUMBA and x.device.type == "cpu" and not torch.is_grad_enabled()):
            out = torch.empty(1, self.out_features)  # (1, F)
            self._matvec_for(weight, bias)(x.detach().numpy().reshape(-1), out.numpy().reshape(-1))
            return out
        return F.linear(x, weight, bias)

    def _matvec_for(self, weight: torch.Tensor, bias: torch.Tensor | None) -> cpu_linear.MatVec:
        """The one-row product of these weight and bias tensors (remade when they get new memory)."""
        memory = (weight.data_ptr(), None if bias is None else bias.data_ptr())
        if memory != self._matvec_of:
            self._matvec = cpu_linear.MatVec(weight.detach(), None if bias is None else bias.detach())
            self._matvec_of = memory
        return self._matvec


def use_onerow_linear(model: nn.Module) -> nn.Module:
    """Replace every plain `nn.Linear` inside `model` with a `OneRowLinear` sharing its
    parameters (in place); returns `model`."""
    for name, child in model.named_children():
        if type(child) is nn.Linear:
            setattr(model, name, OneRowLinear.sharing(child))
        else:
            use_onerow_linear(child)
    return model
