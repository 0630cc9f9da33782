"""onegemm.blockscaled_matmul: fp8 GEMM with torch._scaled_mm's scale conventions.

On an sm_90 GPU, block scales on both operands at M >= 128 run core's Gluon body
(core/hopper_fp8.py; ``hopper_fp8.uses_gluon_body`` is the rule). Otherwise it is core's dense
kernel (core/matmul.py matmul_kernel, core/tiles.py gemm_tile) with its scales switched on:
- block scales (1x128 / 128x1 / 128x128) go to the K loop, which multiplies each K block's
  partial product by its scales and promotes it to the fp32 accumulator
  (acc += dot(a, b) * sa[:, None] * sb[None, :]); so BLOCK_K = 128 in every config;
- tensor-wise and row/column-wise scales are constant along K, so they go to the epilogue
  (one multiply per output element); the K loop then is core's plain fp8 loop, which still
  promotes to fp32 once per K block (max_num_imprecise_acc = BLOCK_K).

Granularity is read from the scale shapes (kb = ceil(K/128), mb = ceil(M/128), nb = ceil(N/128)):

    scale_a: numel 1 (tensor) | [M, 1] (row) | [M, kb] (1x128) | [mb, kb] (128x128)
    scale_b: numel 1 (tensor) | [1, N] (col) | [kb, N] (128x1) | [kb, nb] (128x128)

tried in that order, coarsest first. Two readings of one shape coincide only when the extra
dimension is 1 (M == 1, K <= 128, N == 1, or a single block), and then both give every
element the same multiplier, so the rule only picks the cheaper code path, never the result.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ..core import checks, configs, hopper_configs
from ..core.dispatch import Cached, Op, Record
from ..core.hopper_fp8 import uses_gluon_body, wgmma_launch
from ..core.launch import Launcher, Request
from ..core.matmul import dense_launch, matmul_kernel
from ..core.runtime import empty
from ..core.scaling import BLOCKS, COL, COL_BLOCKS, ROW, ROW_BLOCKS, TENSOR, Scaling, read_granularity
from ..core.tiles import Operand, Scales, Vector
from ..core.tma import choose_tma, forced_flavour, layout_meta
from .configs import BlockscaledKey


# core's dense kernel; this launcher's family (blockscaled/configs.py) tunes it for fp8 operands.
BLOCKSCALED = Launcher(matmul_kernel, "blockscaled")

# What each scale's shape may give (core.scaling.read_granularity), tried in this order:
# coarsest first (module docstring).
SCALES_A = ((TENSOR, ""), (ROW, ""), (ROW_BLOCKS, "1x128"), (BLOCKS, "128x128"))
SCALES_B = ((TENSOR, ""), (COL, ""), (COL_BLOCKS, "128x1"), (BLOCKS, "128x128"))


def blockscaled_matmul(a, b, scale_a, scale_b, *, out_dtype=torch.bfloat16, bias=None, activation=None,
                       use_fast_accum: bool = False, config: triton.Config | None = None, tma: bool | None = None):
    """out = act((a * scale_a) @ (b * scale_b) + bias), torch._scaled_mm's conventions.

    a [M, K], b [K, N]: float8_e4m3fn or float8_e5m2 (not both e5m2), any strides; b given as
        W.t() of an fp8 [N, K] weight is the fast (K-major) layout on Hopper.
    scale_a, scale_b: fp32 dequantisation multipliers, any strides (torch._scaled_mm's
        outer-dim-major scale_a and transposed scale_b included), granularity from the shape:
        scale_a scalar | [M, 1] | [M, ceil(K/128)] | [ceil(M/128), ceil(K/128)];
        scale_b scalar | [1, N] | [ceil(K/128), N] | [ceil(K/128), ceil(N/128)].
    out_dtype: bfloat16 (default), float16 or float32. bias [N]. activation as in matmul.
    use_fast_accum: as torch._scaled_mm's, a permission: with epilogue scales (tensor, row,
        column) on an sm_90 GPU the whole K is summed in the tensor core's reduced-precision
        accumulator, with no promotion to fp32 per 128-deep K block (faster, bigger tiles).
        Block scales always promote (their scales apply per block), and so does core's Triton
        body.
    ``config`` forces one triton.Config instead of the chosen one (tests and benchmarks).
    ``tma``: as in onegemm.matmul (None: tensor-descriptor loads of a and b on Hopper when
    they allow it, pointer loads otherwise; False: pointers; True: TMA or ValueError).
    Traceable by torch.compile. Not differentiable (its operands are quantised values): an
    input that requires grad is an error; Fp8Linear(trainable=True) trains through FP8 GEMMs.
    """
    if config is None:
        return BLOCKSCALED_OP.call(a, b, scale_a, scale_b, bias, out_dtype, activation, tma, use_fast_accum)
    if torch.compiler.is_compiling():
        raise checks.bad_value("config", "None under torch.compile (a forced config is a benchmarking knob)", config)
    return blockscaled_record(a, b, scale_a, scale_b, bias, out_dtype, activation, tma, use_fast_accum, config)(
        a, b, scale_a, scale_b, bias)


def _checked(a, b, scale_a, scale_b, out_dtype, bias, activation, config, tma, use_fast_accum):
    """blockscaled_matmul's checks; returns (the Scaling the scales' shapes give, out_dtype)."""
    checks.check_fp8("a", a)
    checks.check_fp8("b", b)
    checks.check_operand_dtypes(a, b)
    checks.check_inner(a, b)
    checks.check_config(config)
    checks.check_tma(tma)
    checks.check_bool("use_fast_accum", use_fast_accum)
    M, K = a.shape
    N = b.shape[1]
    checks.check_tensor("scale_a", scale_a, dtypes=(torch.float32,))
    checks.check_tensor("scale_b", scale_b, dtypes=(torch.float32,))
    scaling = Scaling(read_granularity("scale_a", scale_a, SCALES_A, "a", ("M", "K"), (M, K)),
                      read_granularity("scale_b", scale_b, SCALES_B, "b", ("K", "N"), (K, N)))
    checks.check_activation(activation)
    checks.check_bias(bias, (N,))
    checks.check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    return scaling, checks.resolve_out_dtype(out_dtype, a.dtype)


def _no_grad(a, b, scale_a, scale_b, bias, *rest) -> None:
    checks.check_not_differentiable("blockscaled_matmul", a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)


def blockscaled_record(a, b, scale_a, scale_b, bias, out_dtype, activation, tma, use_fast_accum=False,
                       config=None) -> Record:
    """blockscaled_matmul's full path: its checks and decisions, as a Record (core/dispatch.py)."""
    scaling, out_dtype = _checked(a, b, scale_a, scale_b, out_dtype, bias, activation, config, tma, use_fast_accum)
    _no_grad(a, b, scale_a, scale_b, bias)
    return scaled_record(a, b, scale_a, scale_b, scaling, out_dtype, bias, activation, config, tma, use_fast_accum)


def _blockscaled_impl(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype], activation: Optional[str],
                      tma: Optional[bool], use_fast_accum: bool = False) -> torch.Tensor:
    return BLOCKSCALED_OP.direct(a, b, scale_a, scale_b, bias, out_dtype, activation, tma, use_fast_accum)


def _blockscaled_fake(a, b, scale_a, scale_b, bias, out_dtype, activation, tma, use_fast_accum=False):
    _, out_dtype = _checked(a, b, scale_a, scale_b, out_dtype, bias, activation, None, tma, use_fast_accum)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


BLOCKSCALED_OP = Op("blockscaled_mm", _blockscaled_impl, _blockscaled_fake, record=blockscaled_record, tensors=5,
                    no_grad=_no_grad)


def run_blockscaled(a, b, scale_a, scale_b, scaling: Scaling, out_dtype, bias=None, activation=None, config=None,
                    tma=None, use_fast_accum=False):
    """blockscaled_matmul's body, on checked inputs whose scaling is known (Fp8Linear's
    GEMMs); on the signature cache unless a config is forced."""
    if config is None:
        return _SCALED(a, b, scale_a, scale_b, bias, scaling, out_dtype, activation, tma, use_fast_accum)
    return scaled_record(a, b, scale_a, scale_b, scaling, out_dtype, bias, activation, config, tma, use_fast_accum)(
        a, b, scale_a, scale_b, bias)


# (a, b, scale_a, scale_b, bias, scaling, out_dtype, activation, tma, use_fast_accum) -> the record's call
_SCALED = Cached(5, lambda args: scaled_record(*args[:4], *args[5:7], args[4], args[7], None, *args[8:]))


def _scales(scaling: Scaling):
    """scales(scale_a, scale_b) -> tiles.Scales for this scaling: block scales go to the K
    loop, the others to the epilogue (stride 0 broadcasts the scalar)."""
    a_block, b_block = scaling.a_per_k_block, scaling.b_per_k_block
    a_tensor, b_tensor = scaling.a == TENSOR, scaling.b == TENSOR

    def scales(sa, sb):
        parts = {}
        if a_block:
            parts["a"] = Operand(sa, *sa.stride())
        else:
            parts["m"] = Vector(sa, 0 if a_tensor else sa.stride(0))
        if b_block:
            parts["b"] = Operand(sb, *sb.stride())
        else:
            parts["n"] = Vector(sb, 0 if b_tensor else sb.stride(1))
        return Scales(**parts)

    return scales


def scaled_record(a, b, scale_a, scale_b, scaling: Scaling, out_dtype, bias=None, activation=None, config=None,
                  tma=None, use_fast_accum: bool = False) -> Record:
    """The launch of a checked block-scaled GEMM whose scaling is known: core's Gluon body
    where ``uses_gluon_body`` takes it, else core's dense kernel with its scales on."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return Record((M, N), out_dtype, a.device)
    c = empty((M, N), device=a.device, dtype=out_dtype)
    scales = _scales(scaling)
    if uses_gluon_body(a, b, c, scaling, tma, config):
        fast = use_fast_accum and not (scaling.a_per_k_block or scaling.b_per_k_block)
        key = hopper_configs.WgmmaKey(configs.m_bucket(M), N, K, scaling, configs.dtype_name(out_dtype), fast_accum=fast)
        return Record((M, N), out_dtype, a.device, [wgmma_launch(a, b, c, bias, activation, key, scales, config,
                                                                 scale_a, scale_b)])
    layout = choose_tma(tma, a, b, c)
    plan = BLOCKSCALED.plan_for(Request(
        BlockscaledKey(configs.m_bucket(M), N, K, a.stride(1) == 1, b.stride(0) == 1,
                               configs.flavour_mode(tma, layout is not None), scaling),
        # UPCAST off: the interpreter computes fp8 tiles right; PRECISION is unused for fp8.
        dict(ACTIVATION=activation, UPCAST=False, PRECISION="ieee", SA_ROWS=scaling.sa_rows, SB_COLS=scaling.sb_cols,
             **layout_meta(layout)),
        a.device, forced_flavour(config, layout),
        lambda plan: dense_launch(BLOCKSCALED, plan, a, b, c, scales=scales).run(c, a, b, scale_a, scale_b, bias),
    ))
    return Record((M, N), out_dtype, a.device, [dense_launch(BLOCKSCALED, plan, a, b, c, scales=scales)])
