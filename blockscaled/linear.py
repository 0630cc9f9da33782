"""onegemm.Fp8Linear: an nn.Linear with an fp8 weight, for prototyping FP8 inference."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..core import checks
from .matmul import run_blockscaled
from .quantize import BLOCK, quantize_fp8


class Fp8Linear(nn.Module):
    """y = x @ W.T + bias with the DeepSeek-V3 recipe: W quantised once in 128x128 blocks,
    x quantised per call in 1x128 blocks (the fused quantiser), both fp8 e4m3 with fp32
    scales, multiplied by blockscaled_matmul with the bias fused in its epilogue.

    Buffers (saved in the state_dict, so it round-trips through safetensors):
      weight        float8_e4m3fn [out_features, in_features]
      weight_scale  float32 [ceil(out_features/128), ceil(in_features/128)]
    and ``bias`` [out_features] (a Parameter in ``dtype``, or None).

    x [..., in_features] of float32 / bfloat16 / float16 -> y [..., out_features], x's dtype.
    ``dtype`` is the dtype of the bias and of the random initial weight before quantisation
    (default: torch's default dtype), as in nn.Linear.

    The forward pass does not check x for NaN/inf (that needs a host sync per call); a
    non-finite activation gives a non-finite output, as nn.Linear would.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None, dtype=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        dtype = dtype or torch.get_default_dtype()
        # nn.Linear's initialisation, then quantised: a fresh Fp8Linear behaves like a fresh Linear.
        w = torch.empty(out_features, in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        self.register_buffer("weight", torch.empty(0, device=device, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.empty(0, device=device, dtype=torch.float32))
        self.set_weight(w)
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor, name: str = "weight") -> None:
        """Quantise a float weight [out_features, in_features] (128x128 blocks) into the buffers.
        ``name``: what errors call it (from_linear says 'linear.weight')."""
        checks.check_tensor(name, weight, ndim=2, dtypes=checks.FLOAT_DTYPES)
        checks.check_shape(name, weight, (self.out_features, self.in_features),
                           f"[out_features, in_features] = [{self.out_features}, {self.in_features}]")
        q, scale = quantize_fp8(weight.detach(), (BLOCK, BLOCK))
        if not bool(torch.isfinite(scale).all()):  # once per weight, not per call: the sync is fine
            raise checks.bad_value(name, "finite", "NaN or inf")
        self.weight, self.weight_scale = q, scale

    def _apply(self, fn, recurse=True):
        # .half() / .to(dtype) and the like cast floating tensors; the fp8 weight and its fp32
        # scales must keep their dtypes (only the bias and the output follow the module's
        # dtype), so they are moved, never cast.
        weight, scale = self.weight, self.weight_scale
        super()._apply(fn, recurse)
        if self.weight.dtype != weight.dtype:
            self.weight = weight.to(self.weight.device)
        if self.weight_scale.dtype != scale.dtype:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """An Fp8Linear with linear's weight (quantised) and bias (copied), on its device."""
        if not isinstance(linear, nn.Linear):
            raise checks.bad_type("linear", "a torch.nn.Linear", linear)
        w = linear.weight
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.register_buffer("weight", torch.empty(0, device=w.device, dtype=torch.float8_e4m3fn))
        module.register_buffer("weight_scale", torch.empty(0, device=w.device, dtype=torch.float32))
        module.set_weight(w, "linear.weight")
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone())
        else:
            module.register_parameter("bias", None)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checks.check_tensor("x", x, dtypes=checks.FLOAT_DTYPES)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise checks.bad_shape("x", f"[..., in_features] = [..., {self.in_features}]", x.shape)
        self._check_buffers(x)
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        q, scale = quantize_fp8(x2, (1, BLOCK))
        # b = W.t(): K-major, the fast layout for Hopper's fp8 MMA; its 128x128 scale
        # [kb, nb] is then weight_scale.t(), torch._scaled_mm's layout too.
        y = run_blockscaled(q, self.weight.t(), scale, self.weight_scale.t(), "1x128", "128x128", x.dtype, self.bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _check_buffers(self, x) -> None:
        """The weight, its scales and the bias as the GEMM reads them (they may have been
        replaced since construction, e.g. by load_state_dict or assignment)."""
        w, s, bias = self.weight, self.weight_scale, self.bias
        kb, nb = -(-self.in_features // BLOCK), -(-self.out_features // BLOCK)
        if w.dtype != torch.float8_e4m3fn or w.shape != (self.out_features, self.in_features):
            raise checks.bad_value("Fp8Linear.weight", f"float8_e4m3fn [{self.out_features}, {self.in_features}]",
                                   f"{w.dtype} {tuple(w.shape)}")
        if s.dtype != torch.float32 or s.shape != (nb, kb):
            raise checks.bad_value("Fp8Linear.weight_scale", f"float32 [{nb}, {kb}]", f"{s.dtype} {tuple(s.shape)}")
        if bias is not None and (bias.shape != (self.out_features,) or bias.dtype not in checks.FLOAT_DTYPES):
            raise checks.bad_value("Fp8Linear.bias", f"[{self.out_features}] of dtype in ({checks.dtype_names(checks.FLOAT_DTYPES)})",
                                   f"{bias.dtype} {tuple(bias.shape)}")
        checks.check_same_device(x=x, weight=w, weight_scale=s, bias=bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, weight=float8_e4m3fn 128x128, activations=1x128"
