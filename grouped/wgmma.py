"""The grouped flavour of core's Gluon FP8 body (core/hopper_fp8.py, GROUPED): its dispatch
rule for grouped_matmul 2D x 3D with scales and the FP8 moe_ffn's GEMMs, the expert layouts it
reads, and its launch. core's kernel takes a row-tile table (``Groups.sched``, which
``ops.row_tiles`` builds from offs on the device) and knows nothing of experts; this module
says which calls take it and with what. docs/hopper.md, "The grouped flavour".
"""

from __future__ import annotations

import torch

from ..core import configs, hopper_configs
from ..core.hopper_fp8 import BLOCKSCALED_WGMMA, Groups, k_loop_meta, on_sm90
from ..core.dispatch import Launch
from ..core.launch import Request
from ..core.runtime import cdiv, sm_count
from ..core.scaling import BLOCKWISE, ROWWISE, SCALE_BLOCK, Scaling
from ..core.tiles import NO_OPERAND, NO_VECTOR, Operand, Scales, Vector
from . import configs as grouped_configs


def rows_layout(a: torch.Tensor) -> bool:
    """Whether TMA can read a [M, K] by rows: K-major, 16-byte aligned rows and base, K > 0."""
    return (a.shape[1] > 0 and a.stride(1) == 1 and (a.stride(0) * a.element_size()) % 16 == 0
            and a.data_ptr() % 16 == 0)


def experts_layout(w: torch.Tensor) -> bool:
    """Whether TMA can read experts w [G, rows, K] as one [G * rows, K] matrix: K-major rows,
    evenly spaced across experts, 16-byte aligned rows and base."""
    return (w.stride(2) == 1 and w.stride(0) == w.shape[1] * w.stride(1) and (w.stride(1) * w.element_size()) % 16 == 0
            and w.data_ptr() % 16 == 0)


def side_by_side_layout(w: torch.Tensor) -> bool:
    """Whether TMA can read experts w [G, rows, K] as one [rows, G * K] matrix, the experts side
    by side along K (the transposed copy quantize_fp8(..., transposed=True) makes of experts
    stacked by rows): K a multiple of 128, so that no K block reaches into the next expert,
    16-byte aligned rows and base."""
    G, rows, K = w.shape
    return (w.stride(2) == 1 and w.stride(0) == K and K % SCALE_BLOCK == 0 and w.stride(1) >= G * K
            and (w.stride(1) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0)


def grouped_band(N: int, K: int, M: int, G: int, moe: bool = False) -> str | None:
    """The band of ``gluon_grouped_mode`` for M rows over G experts of N x K weights, read at
    the fewest rows of M's bucket (configs.bucket_floor), so that the answer holds for every M
    of a compiled variant's key (the counts a warmup meets): "grouped" from
    grouped_configs.WGMMA_MIN_GROUP_ROWS rows per group on average, "decode" (tiles computed
    transposed, SWAP) up to grouped_configs.WGMMA_DECODE_MAX_ROWS (``moe``: moe_ffn's pipeline;
    WGMMA_GEMM_DECODE_MAX_ROWS for a plain grouped GEMM) where the call reads
    grouped_configs.WGMMA_DECODE_MIN_ELEMENTS weights; None between them, for no rows, and for
    experts under grouped_configs.WGMMA_MIN_EXPERT_ELEMENTS weights."""
    if M == 0 or N * K < grouped_configs.WGMMA_MIN_EXPERT_ELEMENTS:
        return None
    M = configs.bucket_floor(M)
    rows = M / max(G, 1)
    read = min(M, G) * N * K  # weights the call reads at most: a group's experts without rows are skipped
    decode_rows = grouped_configs.WGMMA_DECODE_MAX_ROWS if moe else grouped_configs.WGMMA_GEMM_DECODE_MAX_ROWS
    if rows >= grouped_configs.WGMMA_MIN_GROUP_ROWS:
        return "grouped"
    return "decode" if rows <= decode_rows and read >= grouped_configs.WGMMA_DECODE_MIN_ELEMENTS else None


def gluon_grouped_mode(w, M: int, G: int, scaling: Scaling = BLOCKWISE, a=None, tma: bool | None = None,
                  config=None, moe: bool = False) -> str | None:
    """The dispatch rule of the grouped flavour (grouped_matmul 2D x 3D with scales, and the
    FP8 moe_ffn's GEMMs): on an sm_90 GPU, e4m3 operands with 1x128 scale_a and 128x128
    scale_b (or row-wise scale_a and per-column scale_b, applied in the epilogue), the experts
    w [G, N, K] TMA-readable (``experts_layout``, or side by side along K:
    ``side_by_side_layout``) and a [M, K] too (``rows_layout``; ``a`` None: a row-major copy
    the caller writes, whose rows are K bytes), the band ``grouped_band`` gives. None (core's
    Triton body): anything else, a forced config (the Triton body's family) or tma=False."""
    if config is not None or tma is False:
        return None
    mode = grouped_band(w.shape[1], w.shape[2], M, G, moe)
    if mode is None or not (on_sm90(w) and scaling[:2] in (BLOCKWISE[:2], ROWWISE[:2]) and w.dtype == torch.float8_e4m3fn):
        return None
    a_ok = w.shape[2] % 16 == 0 if a is None else (a.dtype == w.dtype and rows_layout(a))
    return mode if a_ok and (experts_layout(w) or side_by_side_layout(w)) else None


def run_wgmma_grouped(a, w, c, schedule, scale_a, scale_b, *, N: int, key: hopper_configs.WgmmaKey, bias=None,
                      activation=None, scatter=None, weight=None, out_scale=None, config=None):
    """The grouped flavour: C rows of group g = epilogue((a rows of g * scale_a) @ (W_g * scale_b_g)^T).

    a fp8 [M, K] row-major; w fp8 [G, rows, K], stacked or side by side along K
    (``gluon_grouped_mode``; rows = N, or 2N gate then
    up rows when ``key.mode`` is "swiglu" or "decode_swiglu"; the "decode" modes compute each
    tile transposed, SWAP); c [M or scattered rows, N]; schedule(block_m) -> (sched, count):
    the groups' row tiles of the plan's BLOCK_M (grouped/ builds them from offs on the device);
    scale_a [M, ceil(K/128)] (1x128); scale_b [G, ceil(K/128), ceil(rows/128)] (128x128 of W^T,
    any strides); or, row-wise (``key.epilogue_scaled``), scale_a [M, 1] and scale_b [G, 1, N],
    applied in the epilogue; bias [G, N]; scatter int32 [M]: c row of each row; weight fp32 per c row;
    out_scale: c's own 1x128 scales [M, ceil(N/128)] when c is fp8 (written).
    """
    launch = wgmma_grouped_launch(a, w, c, schedule, scale_a, scale_b, N=N, key=key, bias=bias, activation=activation,
                                  scatter=scatter, weight=weight, out_scale=out_scale, config=config)
    launch.run(a, w, c, schedule(launch.plan.meta["BLOCK_M"]), scale_a, scale_b, bias, scatter, weight, out_scale)


def wgmma_grouped_launch(a, w, c, schedule, scale_a, scale_b, *, N: int, key: hopper_configs.WgmmaKey, bias=None,
                         activation=None, scatter=None, weight=None, out_scale=None, config=None) -> Launch:
    """``run_wgmma_grouped``'s launch for tensors shaped like these (its plan chosen, tuned on
    these tensors where autotuning is on): a core/dispatch.py Launch whose builder takes
    (a, w, c, (sched, count), scale_a, scale_b, bias, scatter, weight, out_scale), the table
    of the plan's BLOCK_M."""
    M, K = a.shape
    G = w.shape[0]
    swiglu, swap = key.mode.endswith("swiglu"), key.mode.startswith("decode")
    b_cols = None if experts_layout(w) else K  # else side by side (gluon_grouped_mode checked one of the two)

    def build(a, w, c, tiles, scale_a, scale_b, bias=None, scatter=None, weight=None, out_scale=None):
        groups = Groups(tiles[0], tiles[1], G, w.shape[1], scale_b.stride(0), 0 if bias is None else bias.stride(0), scatter,
                        weight, b_cols)
        out = NO_OPERAND if out_scale is None else Operand(out_scale, *out_scale.stride())
        if key.epilogue_scaled:
            scales = Scales(m=Vector(scale_a, scale_a.stride(0)), n=Vector(scale_b, scale_b.stride(2)), out=out)
        else:
            scales = Scales(a=Operand(scale_a, *scale_a.stride()), b=Operand(scale_b, scale_b.stride(1),
                                                                              scale_b.stride(2)), out=out)
        return (Operand(a, *a.stride()), Operand(w, 1, w.stride(1)), Operand(c, *c.stride()), M, N, K, scales,
                NO_VECTOR if bias is None else Vector(bias, bias.stride(1)), groups)

    def grid(plan):
        # an upper bound on the tiles (the table's count is on the device): persistent programs
        tile_n = plan.meta["BLOCK_N"] * (2 if swap and not swiglu else 1)
        return (min((cdiv(M, plan.meta["BLOCK_M"]) + G + 1) * cdiv(N, tile_n), sm_count(plan.device_index)),)

    def trial(plan):  # an autotuning trial: these tensors, the table of the trial's tile height
        BLOCKSCALED_WGMMA.launch(plan, grid(plan), build(a, w, c, schedule(plan.meta["BLOCK_M"]), scale_a, scale_b, bias,
                                                         scatter, weight, out_scale))

    def request():
        return Request(key, dict(ACTIVATION=activation, **k_loop_meta(key.scaling, key.fast_accum), GROUPED=True,
                                 SWIGLU=swiglu, SWAP=swap), a.device, config, trial)

    call_key = (key, a.dtype, c.dtype, bias is None or bias.dtype, activation, scatter is None, weight is None,
                out_scale is None, b_cols is None, a.get_device(), config)
    plan = BLOCKSCALED_WGMMA.plan_for(request, call_key)
    return Launch(BLOCKSCALED_WGMMA, plan, grid(plan), build)
