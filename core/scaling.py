"""How a block-scaled FP8 GEMM's operands are scaled: one ``Scaling``, built once by the checks.

An op reads each scale's granularity from its shape once, into a ``Scaling``
(``read_granularity``, given the op's table of what it accepts: blockscaled/matmul.py,
grouped/ops.py); the tuning keys (core/configs.py), the kernels' SA_ROWS / SB_COLS constexprs
and the choice between core's two FP8 bodies (core/hopper_fp8.py) read that object, never a
string. Its ``str`` is how the tuned tables (core/tuned/*.json) name it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .checks import bad_shape
from .runtime import cdiv

# The scale block of the DeepSeek-V3 recipe and of torch._scaled_mm's blockwise mode: a block
# scale covers 128 elements along K (and 128 rows or columns for 128x128 blocks).
SCALE_BLOCK = 128
# MXFP4 weights (OCP MX, as gpt-oss stores its experts): two e2m1 values per element along K
# (the first in the lower nibble), one e8m0 power-of-two scale per MXFP4_BLOCK values
# (core/tiles.py's _w4_k_block decodes them).
MXFP4 = torch.float4_e2m1fn_x2
MXFP4_SCALE = torch.float8_e8m0fnu
MXFP4_BLOCK = 32
# MXFP4 in fragment order (grouped/prepack.py): its codes as bytes, read only as prepack_mxfp4 made them.
MXFP4_PREPACKED = torch.uint8
# INT4 weights (W4A16, compressed-tensors' symmetric "pack-quantized" format): eight values per
# int32 along K, the first in the lowest 4 bits, each stored as value + 8 (0..15 for -8..7), so
# the int32's bytes hold two values each, the first in the lower nibble, as MXFP4's do. One
# 16-bit or fp32 scale per group of G values along K, G a power of two from INT4_MIN_GROUP.
INT4 = torch.int32
INT4_MIN_GROUP = 32
# Asymmetric INT4 (GPTQ / AWQ / compressed-tensors with zero points): a value is
# (code - zero) * scale, code and zero in 0..15. Each group's 16-bit scale and its zero point
# travel as one int32 word: the scale as fp32 (a 16-bit float's fp32 form leaves its low 13
# bits zero) with the zero point in the low byte (blockscaled.pack_int4_zeros).
INT4_ZERO = torch.int32
INT4_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, INT4_ZERO)  # the group scales' dtypes


def weight_4bit(w: torch.Tensor) -> str:
    """The 4-bit weight format a packed tensor's dtype names: "mxfp4" (also prepacked, uint8),
    "int4", or ""."""
    return "mxfp4" if w.dtype in (MXFP4, MXFP4_PREPACKED) else "int4" if w.dtype == INT4 else ""


class Granularity(NamedTuple):
    """The elements of an operand (A [M, K] or B [K, N], as the GEMM reads it) one scale
    covers: ``rows`` x ``cols`` of them, None for a whole dimension."""

    rows: int | None
    cols: int | None

    def __str__(self):
        if self.rows is None:
            return "tensor" if self.cols is None else "col"
        if self.cols is None:
            return "row"
        return f"{self.rows}x{self.cols}"

    @classmethod
    def parse(cls, text: str) -> "Granularity":
        """The granularity whose str() is ``text``."""
        named = {"tensor": TENSOR, "row": ROW, "col": COL}
        if text in named:
            return named[text]
        rows, cols = text.split("x")
        return cls(int(rows), int(cols))


TENSOR = Granularity(None, None)                 # one scale for the whole operand
ROW = Granularity(1, None)                       # A: one per row (per token)
COL = Granularity(None, 1)                       # B: one per column (per output channel)
ROW_BLOCKS = Granularity(1, SCALE_BLOCK)         # A: 1x128, per token and K block
COL_BLOCKS = Granularity(SCALE_BLOCK, 1)         # B: 128x1, per K block and column
BLOCKS = Granularity(SCALE_BLOCK, SCALE_BLOCK)   # 128x128 (a checkpoint's weight_scale_inv)


def read_granularity(name: str, scale: torch.Tensor, accepts: Sequence[tuple[Granularity, str]], operand: str,
                     dims: Sequence[str], sizes: Sequence[int]) -> Granularity:
    """The granularity ``scale``'s shape gives: the first of ``accepts`` it fits, in that order.

    The operand it scales is ``operand`` (its public name) of shape ``sizes``, whose dimensions
    are named ``dims``, as the GEMM reads it: [..., M, K] for A, [..., K, N] for B, leading
    (group) dimensions taken as they are. A granularity (rows, cols) wants one scale per
    rows x cols block of the last two dimensions (None: the whole dimension), e.g.
    [ceil(M/128), ceil(K/128)] for A's 128x128; TENSOR wants one element (numel 1, at most as
    many dimensions as the operand). ``accepts``: (granularity, its label in the message, or
    "") pairs. None fits: ValueError '<name> must be <each accepted shape> for <operand>
    [dims] = [sizes], got shape (...): it fits no granularity'.
    """
    shape = tuple(scale.shape)
    for kind, _ in accepts:
        if kind == TENSOR:
            if scale.dim() <= len(sizes) and scale.numel() == 1:
                return kind
        elif shape == _scale_shape(kind, sizes, cdiv):
            return kind
    shown = [_shown(kind, label, dims, sizes) for kind, label in accepts]
    listed = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]
    raise bad_shape(name, f"{listed} for {operand} {_dims(dims)} = {_dims(sizes)}", shape, "it fits no granularity")


def _shown(kind: Granularity, label: str, dims, sizes) -> str:
    """'[M, ceil(K/128)] = [200, 3] (1x128)': ``kind``'s scale shape in the message."""
    if kind == TENSOR:
        return "a scalar"
    shown = f"{_dims(_scale_shape(kind, dims, _ceil_of))} = {_dims(_scale_shape(kind, sizes, cdiv))}"
    return f"{shown} ({label})" if label else shown


def _dims(dims) -> str:
    return f"[{', '.join(map(str, dims))}]"


def _scale_shape(kind: Granularity, dims: Sequence, per) -> tuple:
    """The shape of ``kind``'s scales for an operand of dimensions ``dims`` (sizes, or names):
    the leading ones as they are, then ``per(dim, block)`` blocks of each of the last two (1 for a
    block of None, the dimension itself for a block of 1)."""
    *lead, rows, cols = dims
    return (*lead, *(1 if step is None else dim if step == 1 else per(dim, step)
                     for dim, step in ((rows, kind.rows), (cols, kind.cols))))


def _ceil_of(dim: str, step: int) -> str:
    return f"ceil({dim}/{step})"


class Scaling(NamedTuple):
    """A scaled GEMM's scales: A's and B's granularity and whether C is fp8 with its own
    1x128 scales, written by the tiles (``tiles.Scales.out``).

    A scale that varies along K (a block scale) goes to the K loop, which promotes each K
    block's partial product with it; one constant along K (tensor, row, column) goes to the
    epilogue.
    """

    a: Granularity
    b: Granularity
    fp8_out: bool = False

    @property
    def a_per_k_block(self) -> bool:
        """scale_a changes every K block (1x128, 128x128): the K loop reads it."""
        return self.a.cols == SCALE_BLOCK

    @property
    def b_per_k_block(self) -> bool:
        """scale_b changes every K block (128x1, 128x128): the K loop reads it."""
        return self.b.rows == SCALE_BLOCK

    @property
    def sa_rows(self) -> int:
        """The kernels' SA_ROWS: rows of A per K-block scale (1, or 128 for 128x128)."""
        return SCALE_BLOCK if self.a == BLOCKS else 1

    @property
    def sb_cols(self) -> int:
        """The kernels' SB_COLS: columns of B per K-block scale (1, or 128 for 128x128)."""
        return SCALE_BLOCK if self.b == BLOCKS else 1

    def __str__(self):
        return f"{self.a},{self.b}" + (",fp8out" if self.fp8_out else "")

    @classmethod
    def parse(cls, text: str) -> "Scaling":
        """The Scaling whose str() is ``text`` (a tuned table's key)."""
        a, b, *out = text.split(",")
        if out not in ([], ["fp8out"]):
            raise ValueError(f"not a scaling: {text!r}")
        return cls(Granularity.parse(a), Granularity.parse(b), bool(out))


# 1x128 activations x 128x128 weights: DeepSeek-V3's recipe, Fp8Linear's forward and the FP8
# MoE's GEMMs.
BLOCKWISE = Scaling(ROW_BLOCKS, BLOCKS)

# Row-wise A x per-column B (torch._scaled_mm's row-wise mode): both constant along K, applied
# in the epilogue.
ROWWISE = Scaling(ROW, COL)
