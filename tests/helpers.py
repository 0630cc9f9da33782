"""Helpers the test modules share (``from helpers import make, tol_for``).

pytest puts tests/ on sys.path (the folder has no ``__init__.py``, import mode "prepend"), so
this module is imported as ``helpers`` whatever the checkout's folder is called; test modules
import each other never.
"""

import torch

import onegemm
from onegemm.core.configs import MATMUL_INTERPRET, cfg, with_meta
from onegemm.testing import TF32_TOL, TOL

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# The input dtypes every dense-GEMM flavour runs.
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]

# Hopper's fp8 MMA adds products inside one K block in reduced precision (6.6e-5 measured on
# the H200 with K = 70 and an fp32 output), so an fp32 output of fp8 inputs is not 1e-5-exact.
FP8_MMA_TOL = 2e-4


def make(shape, dtype, device, layout="contig", scale=1.0):
    """A random [R, C] operand of ``dtype`` laid out as asked.

    contig: row-major. transposed: a .t() view of a [C, R] tensor (column-major).
    sliced: a strided view with gaps (every other row, an offset column window).
    """
    R, C = shape
    if layout == "contig":
        t = torch.randn(R, C, device=device) * scale
    elif layout == "transposed":
        t = (torch.randn(C, R, device=device) * scale).t()
    elif layout == "sliced":
        t = (torch.randn(2 * R + 1, C + 5, device=device) * scale)[1::2, 3 : 3 + C]
    else:
        raise ValueError(layout)
    return t.to(dtype)


def tol_for(dtype, out_dtype=None):
    """The bound on a matmul of ``dtype`` inputs written as ``out_dtype`` (default: matmul's)."""
    out_dtype = out_dtype or (torch.bfloat16 if dtype in FP8 else dtype)
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return TF32_TOL
    if dtype in FP8:
        return max(TOL[out_dtype], FP8_MMA_TOL)
    return TOL[out_dtype]


def split_cfg(split, dtype=torch.float32):
    """The interpreter's config, or on the H200 a 64x64 tile with the dtype's BLOCK_K; SPLIT_K set."""
    if onegemm.INTERPRET:
        base = MATMUL_INTERPRET
    else:
        base = cfg(64, 64, {1: 128, 2: 64, 4: 32}[torch.empty(0, dtype=dtype).element_size()], 4, 3)
    return with_meta(base, SPLIT_K=split)
