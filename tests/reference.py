"""float64 torch references and the error measure every test and benchmark uses."""

import math

import torch
import torch.nn.functional as F

# Relative Frobenius error bounds against a float64 reference of the same inputs (DESIGN.md).
# bf16: its 8-bit mantissa, rounded once at the output cast. fp8 inputs are exact in fp64,
# so their bound is the output cast's (bf16 by default).
TOL = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}
TF32_TOL = 1e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64; inf if out holds any NaN or inf."""
    out = out.detach().double()
    ref = ref.detach().double().to(out.device)
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output"):
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    n_nan = int(torch.isnan(out.detach().float()).sum()) if out.numel() else 0
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} ({n_nan} NaN of {out.numel()})"


def act_ref(x: torch.Tensor, activation):
    if activation is None:
        return x
    if activation == "relu":
        return F.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    raise ValueError(activation)


def matmul_ref(a, b, bias=None, activation=None):
    """act(a @ b + bias) in float64, on the inputs' device."""
    out = a.double() @ b.double()
    if bias is not None:
        out = out + bias.double()
    return act_ref(out, activation)
