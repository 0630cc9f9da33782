"""4-bit expert weights in grouped_matmul's 2D x 3D mode (weight-only; core/scaling.py's formats).

b [G, K/2, N] of torch.float4_e2m1fn_x2 with e8m0 ``scale_b`` [G, K/32, N] (MXFP4, gpt-oss),
or b [G, K/8, N] of torch.int32 with 16-bit / fp32 ``scale_b`` [G, K/group, N] (INT4,
compressed-tensors' symmetric pack-quantized; int32 scale words with zero points for
asymmetric groups, core/scaling.py INT4_ZERO): the transpose(1, 2) of the weights as stored,
[G, N, K/2] or [G, N, K/8]. The kernels read either as bytes, two values each along K.
"""

from __future__ import annotations

import torch

from ..blockscaled.quantize import dequantize_int4, dequantize_mxfp4
from ..core import checks
from ..core.runtime import INTERPRET
from ..core.runtime import cdiv
from ..core.scaling import (INT4, INT4_MIN_GROUP, INT4_SCALE_DTYPES, MXFP4, MXFP4_BLOCK, MXFP4_PREPACKED, MXFP4_SCALE,
                            weight_4bit)
from ..core.tma import no_tma, tma_hardware
from .kernels import grouped_scales
from .prepack import PrepackedMxfp4

# values along K per element of b, by format
PER_ELEMENT = {"mxfp4": 2, "int4": 8}
_WHAT = {"mxfp4": "MXFP4 [G, K / 2, N]", "int4": "INT4 [G, K / 8, N]"}
_ELEMENT = {"mxfp4": "float4_e2m1fn_x2: two values along K per element",
            "int4": "int32: eight values along K per element"}


def w4_bytes(b: torch.Tensor) -> torch.Tensor:
    """A 4-bit b as the kernels read it: uint8 [G, K/2, N], two values per byte along K, the
    first in the lower nibble (an INT4 int32 is four such bytes along K, little-endian)."""
    if b.dtype == INT4:
        return b.transpose(1, 2).view(torch.uint8).transpose(1, 2)
    return b.view(torch.uint8)


def check_w4_operands(a, b, scale_a, scale_b) -> str:
    """A 4-bit b (weight-only): a 16-bit a [sum_M, K], b [G, K/2 or K/8, N], scale_b, no
    scale_a. Returns the format."""
    fmt = weight_4bit(b)
    name = fmt.upper()
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise checks.bad_dtype("a", f"bfloat16 or float16 with an {name} b (weight-only: the weights are dequantised "
                               "to a's dtype)", a.dtype)
    if (a.dim(), b.dim()) != (2, 3):
        raise checks.bad_value("b", f"an {name} b only in the 2D x 3D mode (a [sum_M, K], b {_WHAT[fmt]})",
                               f"a {a.dim()}D x {b.dim()}D call")
    if scale_a is not None:
        raise checks.bad_value("scale_a", f"None with an {name} b (a is not quantised)", "a tensor")
    if fmt == "mxfp4":
        if scale_b is None:
            raise checks.bad_value("scale_b", "b's e8m0 block scales [G, K / 32, N] with an MXFP4 b", None)
        checks.check_tensor("scale_b", scale_b, ndim=3, dtypes=(MXFP4_SCALE,))
    else:
        if scale_b is None:
            raise checks.bad_value("scale_b", "b's group scales [G, K / group, N] with an INT4 b", None)
        checks.check_tensor("scale_b", scale_b, ndim=3, dtypes=INT4_SCALE_DTYPES)
        if b.stride(1) != 1:
            raise checks.bad_value("b", "an INT4 b [G, K / 8, N] with unit stride along K / 8 (the transpose(1, 2) "
                                   "of the weights as stored, [G, N, K / 8])", f"strides {tuple(b.stride())}")
    checks.check_same_device(a=a, b=b, scale_b=scale_b)
    if b.dtype == MXFP4_PREPACKED:  # (grouped_matmul unwrapped a PrepackedMxfp4 and checked its k)
        if b.shape[1] != cdiv(a.shape[1], 128) * 64 or b.stride(1) != 1:
            raise checks.bad_shape("b", f"fragment-order MXFP4 [G, ceil(K / 128) * 64, N] for K = {a.shape[1]}", b.shape)
    elif a.shape[1] != b.shape[1] * PER_ELEMENT[fmt]:
        raise checks.bad_shape("b", f"{_WHAT[fmt]} with K = {a.shape[1]} (a is [sum_M, K] = {tuple(a.shape)}; "
                               f"{_ELEMENT[fmt]})", b.shape)
    return fmt


def w4_scales(fmt: str, scale_b: torch.Tensor, G: int, N: int, K: int, frag: bool = False):
    """A 4-bit b's scales as ragged_kernel takes them: (``scales(scale_a, scale_b)``, the
    group, values along K per scale). MXFP4: [G, K / 32, N] e8m0 (gpt-oss's ``*_scales``
    transposed; ``frag``, prepacked: [G, ceil(K / 128) * 4, N]). INT4: [G, K / group, N], the group a power of two from 32 dividing K."""
    if fmt == "mxfp4":
        if K % MXFP4_BLOCK:
            raise checks.bad_shape("a", f"[sum_M, K] with K a multiple of {MXFP4_BLOCK} (MXFP4's block)", (K,))
        if frag:  # padded to the 128 block
            checks.check_shape("scale_b", scale_b, (G, cdiv(K, 128) * 4, N), "[G, ceil(K / 128) * 4, N] (prepacked)")
            return (lambda sa, sb: grouped_scales(b=sb.view(torch.uint8))), MXFP4_BLOCK
        checks.check_shape("scale_b", scale_b, (G, K // MXFP4_BLOCK, N),
                           f"[G, K / {MXFP4_BLOCK}, N] = [{G}, {K // MXFP4_BLOCK}, {N}] (one e8m0 scale per "
                           f"{MXFP4_BLOCK} values along K)")
        return (lambda sa, sb: grouped_scales(b=sb.view(torch.uint8))), MXFP4_BLOCK
    groups = scale_b.shape[1]
    group = K // groups if groups and K % groups == 0 else 0
    if group < INT4_MIN_GROUP or group & (group - 1):
        raise checks.bad_shape("scale_b", f"[G, K / group, N] with K = {K} and the group a power of two >= "
                               f"{INT4_MIN_GROUP} dividing K", scale_b.shape)
    checks.check_shape("scale_b", scale_b, (G, groups, N), f"[G, K / group, N] = [{G}, {groups}, {N}]")
    return (lambda sa, sb: grouped_scales(b=sb)), group


def w4_flavour(tma, b, strides_b) -> str:
    """How a 4-bit b's packed bytes (``w4_bytes``) are read: "tma" (tiles.TileSpec.W4_TMA: a
    descriptor over each expert's weights as stored, [N, K/2] byte rows) or "ptr" (pointer
    loads). b [G, K/2, N] needs unit stride along K/2 and 16-byte aligned base, row and group
    strides. Automatic (tma=None): TMA on a Hopper GPU where b allows it; the interpreter, which
    runs descriptors too, defaults to pointers, as for every other operand."""
    if tma is False or (tma is None and (INTERPRET or not b.is_cuda)):
        return "ptr"
    reason = None
    if not tma_hardware(b.device):
        reason = f"TMA needs a Hopper (sm_90) or newer GPU, the operands are on {b.device}"
    elif strides_b[1] != 1 or strides_b[2] % 16 or strides_b[0] % 16 or b.data_ptr() % 16:
        reason = (f"a 4-bit b through TMA is the weights as stored ([G, N, K/2] byte rows, b = w.transpose(1, 2)) "
                  f"with 16-byte aligned rows; b has byte strides {tuple(strides_b)} and data_ptr % 16 = "
                  f"{b.data_ptr() % 16}")
    if reason is None:
        return "tma"
    if tma:
        raise no_tma(reason)
    return "ptr"


def dequantize_w4(b: torch.Tensor, scale_b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grouped_matmul's 4-bit b and scale_b -> the experts [G, N, K] in ``dtype`` (torch;
    prepacked: K padded to the 128 block)."""
    if b.dtype == MXFP4_PREPACKED:
        b, scale_b = PrepackedMxfp4(b.transpose(1, 2), scale_b.transpose(1, 2), 2 * b.shape[1]).unpack()
        return dequantize_mxfp4(b, scale_b, dtype)
    if b.dtype == MXFP4:
        return dequantize_mxfp4(b.transpose(1, 2), scale_b.transpose(1, 2), dtype)
    return dequantize_int4(b.transpose(1, 2), scale_b.transpose(1, 2), dtype)

