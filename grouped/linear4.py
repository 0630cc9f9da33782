"""linear_4bit: a dense Linear whose weight is 4-bit as stored (MXFP4 or INT4), one group of
grouped_matmul's 4-bit 2D x 3D mode (grouped/w4.py)."""

from __future__ import annotations

import torch

from ..core import checks
from ..core.scaling import INT4_SCALE_DTYPES, MXFP4_PREPACKED, MXFP4_SCALE, weight_4bit
from .ops import grouped_matmul
from .w4 import PER_ELEMENT


def linear_4bit(x, weight, weight_scale, bias=None, *, activation=None):
    """F.linear with a 4-bit weight as stored: act(x @ W.T + bias), W dequantised in the K loop.

    x [..., K] bf16 / fp16; ``weight`` MXFP4 [N, K/2] (float4_e2m1fn_x2) with e8m0
    ``weight_scale`` [N, K/32], or INT4 [N, K/8] (int32, compressed-tensors' ``weight_packed``)
    with float ``weight_scale`` [N, K/group] (int32 with zero points: blockscaled.pack_int4_zeros);
    bias [N]. One group of grouped_matmul's 4-bit
    2D x 3D mode (its checks, errors and kernel). Output in x's dtype and x's leading dims.
    Differentiable in x and bias (the weight is frozen).
    """
    checks.check_tensor("x", x, dtypes=(torch.bfloat16, torch.float16))
    checks.check_tensor("weight", weight, ndim=2)
    fmt = weight_4bit(weight)
    if not fmt or weight.dtype == MXFP4_PREPACKED:  # (fragment order is grouped_matmul's and moe_ffn's)
        raise checks.bad_dtype("weight", "a 4-bit weight: float4_e2m1fn_x2 (MXFP4) or int32 (INT4)", weight.dtype)
    if x.dim() == 0:
        raise checks.bad_shape("x", "[..., K] (at least 1-D)", x.shape)
    K, N = x.shape[-1], weight.shape[0]
    what = {"mxfp4": f"MXFP4 [out_features, {K} / 2]", "int4": f"INT4 [out_features, {K} / 8]"}[fmt]
    if weight.shape[1] * PER_ELEMENT[fmt] != K:
        raise checks.bad_shape("weight", f"{what} (x has {K} features in its last dim)", weight.shape)
    if fmt == "int4" and weight.stride(1) != 1:
        raise checks.bad_value("weight", "an INT4 weight with unit stride along K / 8 (as stored)",
                               f"strides {tuple(weight.stride())}")
    checks.check_tensor("weight_scale", weight_scale, ndim=2,
                        dtypes=(MXFP4_SCALE,) if fmt == "mxfp4" else INT4_SCALE_DTYPES)
    if weight_scale.shape[0] != N:
        raise checks.bad_shape("weight_scale", f"[{N}, K / group] (one row per output feature)", weight_scale.shape)
    checks.check_bias(bias, (N,))
    x2 = x.reshape(-1, x.shape[-1])
    offs = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x.device)  # one group: every row
    out = grouped_matmul(x2, weight[None].transpose(1, 2), offs, scale_b=weight_scale[None].transpose(1, 2),
                         bias=None if bias is None else bias[None], activation=activation)
    return out.reshape(*x.shape[:-1], weight.shape[0])
