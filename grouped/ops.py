"""onegemm.grouped_matmul: torch._grouped_mm semantics on core's tile body, plus list mode."""

from __future__ import annotations

from typing import Optional

import torch

from ..core import checks, configs, hopper_configs, splitk
from ..core.dispatch import Launch, Op, Record, apply_activation, begin, wants_grad
from ..core.launch import Launcher, Request
from ..core.runtime import INTERPRET, cdiv, default_programs, empty, interpretable, next_pow2, product_like, sm_count
from ..core.scaling import (BLOCKS, COL, MXFP4_PREPACKED, ROW, ROW_BLOCKS, SCALE_BLOCK, Scaling, read_granularity,
                            weight_4bit)
from ..core.tiles import NO_OPERAND, Operand, Routing, Vector

NO_ROUTING = Routing()
from ..core.tma import choose_tma, forced_flavour, layout_meta, no_tma
from .configs import ListKey, RaggedKey, gather_col_blocks
from .kernels import (NO_GROUPED_SCALES, RowTiles, Stacked, combine_kernel, gather_quantize_kernel, grouped_scales, list_kernel,
                      ragged_kernel, row_tiles_kernel, swiglu_backward_kernel)
from .prepack import PrepackedMxfp4, unwrap_prepacked
from .w4 import check_w4_operands, dequantize_w4, w4_bytes, w4_flavour, w4_scales
from .wgmma import gluon_grouped_mode, run_wgmma_grouped

RAGGED = Launcher(ragged_kernel, "ragged")
LIST = Launcher(list_kernel, "list")
ROW_TILES = Launcher(row_tiles_kernel, "row_tiles")
GATHER_QUANTIZE = Launcher(gather_quantize_kernel, "gather_quantize")
COMBINE = Launcher(combine_kernel, "combine")
SWIGLU_BACKWARD = Launcher(swiglu_backward_kernel, "swiglu_backward")


def row_tiles(offs, G: int, M: int, block_m: int, tail: bool = True, out=None):
    """The row tiles of M rows cut by offs into G groups, as core's Gluon body walks them:
    (sched int32 [cdiv(M, block_m) + G + 1, 4], count int32 [1]), built on the device
    (row_tiles_kernel), so no offs value reaches the host. ``tail`` False: no tiles for the
    rows past offs[-1] (their output is never read). ``out``: the two tensors to write."""
    units = cdiv(M, block_m) + G + 1
    if out is None:
        out = RowTiles(torch.empty((units, 4), dtype=torch.int32, device=offs.device),
                       torch.empty(1, dtype=torch.int32, device=offs.device))
    g_block = next_pow2(G + 1)
    key = configs.PrepKey("row_tiles", g_block)
    plan = ROW_TILES.plan_for(lambda: Request(key, dict(BLOCK_M=block_m, G_BLOCK=g_block, TAIL=tail), offs.device),
                              (key, block_m, tail, offs.get_device()))
    ROW_TILES.launch(plan, (cdiv(units, plan.meta["CHUNK"]),), (Vector(offs, offs.stride(0)), *out, G, M))
    return tuple(out)


def gather_quantize(x, rows, dtype=torch.float8_e4m3fn, offs=None, out=None):
    """(q [P, H] fp8, scales fp32 [P, ceil(H/128)]) of x[rows] in 1x128 blocks, rows int32 [P]
    (None: x's own rows, P = T): quantize_fp8's values and scales of the gathered rows, in one pass. The scales are a
    transposed view of [ceil(H/128), P], so a GEMM reads a K block's scales of its rows in one
    coalesced line. ``offs`` (int32 [G] group end offsets): rows past offs[-1] are left unwritten.
    ``out``: (q, scales) to write."""
    return _gather_quantize(x, rows, x.shape[0] if rows is None else rows.shape[0], x.shape[1], dtype, offs, out=out)


def swiglu_quantize(h_pre, dtype=torch.float8_e4m3fn):
    """(q [P, I] fp8, scales [P, ceil(I/128)]) of h = silu(gate) * up for h_pre [P, 2I] (gate |
    up), h rounded to h_pre's dtype first: quantize_fp8(h) of a 16-bit SwiGLU output, in one
    read of h_pre (gather_quantize_kernel's SWIGLU)."""
    return _gather_quantize(h_pre, None, h_pre.shape[0], h_pre.shape[1] // 2, dtype, None, swiglu=True)


def swiglu_forward(h_pre, dtype, out=None):
    """h = silu(gate) * up [P, I] in ``dtype`` of h_pre [P, 2I] (gate | up), computed in fp32
    from one read of h_pre (gather_quantize_kernel's SWIGLU without the quantisation), written
    to ``out`` (contiguous [P, I]) when given."""
    return _gather_quantize(h_pre, None, h_pre.shape[0], h_pre.shape[1] // 2, dtype, None, swiglu=True, out=(out, None))[0]


def _gather_quantize(x, rows, P: int, H: int, dtype, offs, swiglu: bool = False, out=None):
    """gather_quantize_kernel's launch: (q, scales) for an fp8 ``dtype``, (rows, None) else;
    ``out``: (q, scales) to write, else allocated."""
    quantize = dtype in checks.FP8_DTYPES
    q, s = (None, None) if out is None else out
    q = empty((P, H), dtype=dtype, device=x.device) if q is None else q
    if quantize and s is None:
        s = empty((cdiv(H, SCALE_BLOCK), P), dtype=torch.float32, device=x.device).t()
    key = configs.PrepKey("gather_quantize", configs.m_bucket(P))
    round_to = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x.dtype, "") if swiglu and quantize else ""
    plan = GATHER_QUANTIZE.plan_for(lambda: Request(key, dict(SWIGLU=swiglu, ROUND=round_to), x.device),
                                    (key, x.dtype, dtype, offs is None, rows is None, swiglu, x.get_device()))
    row_programs, col_blocks = cdiv(P, plan.meta["BLOCK_R"]), cdiv(H, SCALE_BLOCK)
    per = gather_col_blocks(row_programs, col_blocks, 1 if INTERPRET else sm_count(plan.device_index))
    GATHER_QUANTIZE.launch(plan, (row_programs, cdiv(col_blocks, per)), (
        Operand(interpretable(x), *x.stride()), rows, Operand(q, *q.stride()),
        NO_OPERAND if s is None else Operand(s, *s.stride()), P, H, offs, 0 if offs is None else offs.shape[0], per))
    return q, s


def combine(y_pairs, topk_ids, E: int, dtype):
    """[T, H] in ``dtype``: the sum over each token's k slots of y_pairs [T * k, H], in slot
    order in fp32, skipping the slots whose id is outside [0, E) (rows never written)."""
    out = empty((topk_ids.shape[0], y_pairs.shape[1]), dtype=dtype, device=y_pairs.device)
    combine_launch(y_pairs, topk_ids, E, dtype).run(out, y_pairs, topk_ids)
    return out


def combine_launch(y_pairs, topk_ids, E: int, dtype) -> Launch:
    """``combine``'s launch for tensors shaped like these: a core/dispatch.py Launch whose
    builder takes (out [T, H], y_pairs, topk_ids)."""
    T, k = topk_ids.shape
    H = y_pairs.shape[1]
    key = configs.PrepKey("combine", H)
    plan = COMBINE.plan_for(lambda: Request(key, dict(k=k), y_pairs.device),
                            (key, k, y_pairs.dtype, dtype, topk_ids.dtype, y_pairs.get_device()))
    strides = y_pairs.stride()

    def build(out, y_pairs, topk_ids):
        return Operand(y_pairs, *strides), topk_ids.contiguous(), Operand(out, H, 1), E, H

    return Launch(COMBINE, plan, (T, cdiv(H, plan.meta["BLOCK_H"])), build)


def swiglu_backward(h_pre, dh_u, weight, dtype):
    """The expert FFN's SwiGLU backward (swiglu_backward_kernel): h_pre [P, 2I] (gate | up),
    dh_u fp32 [P, I], weight fp32 [P] -> (dh_pre [P, 2I], weight * h [P, I] (dW2's operand),
    both in ``dtype``, and dweight fp32 [P])."""
    P, I = dh_u.shape
    dh_pre, h = empty((P, 2 * I), dtype=dtype, device=h_pre.device), empty((P, I), dtype=dtype, device=h_pre.device)
    dweight = empty((P,), dtype=torch.float32, device=h_pre.device)
    if P == 0:
        return dh_pre, h, dweight
    key = configs.PrepKey("swiglu_backward", I)
    plan = SWIGLU_BACKWARD.plan_for(lambda: Request(key, {}, h_pre.device),
                                    (key, h_pre.dtype, dtype, h_pre.get_device()))
    SWIGLU_BACKWARD.launch(plan, (P,), (Operand(h_pre, *h_pre.stride()), Operand(dh_u, *dh_u.stride()), weight,
                                        Operand(dh_pre, *dh_pre.stride()), Operand(h, *h.stride()), dweight, I))
    return dh_pre, h, dweight


def check_offs_tensor(offs, mode: str, over: str | None, G: int = -1) -> None:
    """grouped_matmul's ``offs`` in ``mode`` ("2D x 3D"), all but its values (check_offs_values):
    int32 [G] cumulative end offsets of the groups along ``over`` (a's rows, K, b's columns),
    1-D with G entries (G < 0: any length, 2D x 2D's offs gives G), on a device the kernels read.
    ``over`` None: the mode takes no offs (3D x 3D, batched). Metadata only: no value is read.
    """
    if offs is None:
        if over is not None:
            raise checks.bad_value("offs", f"int32 [G] cumulative end offsets for {mode} grouped_matmul", None)
        return
    checks.check_tensor("offs", offs, dtypes=(torch.int32,))
    if over is None:
        raise checks.bad_value("offs", f"None for {mode} (batched) grouped_matmul", "a tensor")
    if offs.dim() != 1 or (G >= 0 and offs.shape[0] != G):
        want = "1-D" if G < 0 else f"1-D with {G} entries (one end offset per group)"
        raise checks.bad_shape("offs", f"{want} for {over} ({mode})", offs.shape)


def check_offs_values(offs, total: int, what: str) -> None:
    """offs (checked by check_offs_tensor) non-decreasing, >= 0 and at most ``total``, the size
    of the dimension it cuts (``what``). Reads the values on the host: a device sync on a GPU,
    which the hot path and CUDA-graph capture must avoid, so grouped_matmul reads them only for
    ``check_offs=True`` or offs on the CPU (its docstring); the kernel itself turns bad offs
    into a NaN output rather than trusting them."""
    if offs.shape[0] > 0:
        o = offs.to("cpu", torch.int64)
        if (o[0] < 0) or bool((o[1:] < o[:-1]).any()):
            raise checks.bad_value("offs", "non-decreasing and >= 0 (cumulative end offsets)", o.tolist())
        if o[-1] > total:
            raise checks.bad_value("offs", f"at most {total} (the grouped dimension of {what}) at its end", f"offs[-1] = {int(o[-1])}")


def _bias_operand(bias):
    """The bias as ragged_kernel reads it: [G, N], or a [total N] vector (3D x 2D)."""
    if bias is None:
        return NO_OPERAND
    return Operand(bias, *bias.stride()) if bias.dim() == 2 else Operand(bias, 0, bias.stride(0))


def _tma_flavour(tma, a, b, c, ragged, gather, swiglu, strides3):
    """core.tma.choose_tma for one group, plus what per-group base pointers add.

    Group g's operands start at base + g * stride_g + start * stride (start read on the device),
    so every such offset must keep TMA's 16-byte alignment, i.e. move by whole rows: a ragged M
    with row-major A and C; the batched mode. A ragged K needs no such move (its descriptors
    keep the matrices' bases and are read from the group's start), so every layout of it
    takes TMA. A ragged N shifts C by single elements. A gather (MoE GEMM1) or the interleaved
    SwiGLU columns need pointer loads.
    """
    if tma is None and (INTERPRET or not a.is_cuda):
        return None  # the automatic choice on the interpreter is pointers
    reason = None
    if gather or swiglu:
        reason = "a row gather / SwiGLU tile reads through pointers"
    elif ragged == "N":
        reason = "offs over N shift the output's group bases by single elements (TMA needs 16-byte alignment)"
    elif any(st[0] % (16 // t.element_size()) for st, t in zip(strides3, (a, b, c))):
        reason = "a group stride is not a multiple of 16 bytes"
    if reason is None:
        # Group 0's matrices start at each tensor's data pointer, with the inner two strides.
        layout = choose_tma(tma, a, b, c, tuple(st[1:] for st in strides3))
        if layout is not None and ragged == "M" and not layout.a_k_contig:
            reason = "a must be row-major for offs over rows (a column-major slice starts at any element)"
        else:
            return layout
    if tma:
        raise no_tma(reason)
    return None


def ragged_launch(
    a, b, c, offs, *, ragged, G, M, N, K, strides_a, strides_b, strides_c,
    bias=None, activation=None, a_rows=None, c_rows=None, weight=None, swiglu=False,
    rows_per_group=None, config=None, tma=None, scales=NO_GROUPED_SCALES, scaling: Scaling | None = None, build=None,
    w4=None,
) -> Launch:
    """ragged_kernel's launch (see its docstring for the meaning of every argument), as a
    core/dispatch.py Launch.

    scales, scaling: an FP8 grouped GEMM's tiles.Scales (kernels.grouped_scales) and its
    core/scaling.py Scaling (scale_a 1x128 or row, scale_b 128x128 or col; ``fp8_out`` when
    C is fp8 and the tiles write its 1x128 scales, ``scales.out``); None without scales.
    w4: (format, group, frag) of a 4-bit b (grouped/w4.py; b its bytes ``w4_bytes``, ``scales.b``
    its scales), dequantised in the K loop; a and c through pointers, b as ``w4_flavour`` says;
    frag: b in fragment order (grouped/prepack.py).
    rows_per_group: what the config is chosen for (default M). tma: None (TMA on Hopper where
    every group's operands allow it and the config takes it; pointers otherwise), False
    (pointers), True (TMA or ValueError).
    build: the launch's argument builder ``build(c, *tensors)`` for a record that launches it
    again on other tensors of the same signature; default, these arguments' own (``build(c)``).
    """
    if scaling is not None and config is not None and config.kwargs.get("BLOCK_K") != SCALE_BLOCK:
        raise checks.bad_value("config", f"a config with BLOCK_K = {SCALE_BLOCK} (the scale block) for an FP8 grouped GEMM",
                               f"BLOCK_K = {config.kwargs.get('BLOCK_K')}")
    if w4 and w4[2] and config is not None and config.kwargs.get("BLOCK_K") != 128:
        raise checks.bad_value("config", "a config with BLOCK_K = 128 (the fragment-order layout's block) for a "
                               "prepacked MXFP4 b", f"BLOCK_K = {config.kwargs.get('BLOCK_K')}")
    w4_tma = w4 is not None and w4_flavour(tma, b, strides_b) == "tma"
    layout = None if w4 else _tma_flavour(tma, a, b, c, ragged, a_rows is not None, swiglu,
                                             (strides_a, strides_b, strides_c))
    m = configs.m_bucket(rows_per_group if rows_per_group is not None else M)
    routing = Routing(a_rows, c_rows, weight)
    strides = (strides_a, strides_b, strides_c)
    own = lambda c: ragged_args(a, b, c, bias, offs, strides, routing, scales, G, M, N, K)  # noqa: E731
    plan = RAGGED.plan_for(Request(
        RaggedKey(configs.dtype_name(a.dtype), ragged, m, N, K, strides_a[2] == 1, strides_b[1] == 1,
                          configs.flavour_mode(tma, layout is not None), swiglu, a_rows is not None, scaling,
                          *(w4[:2] if w4 else ("", 0)), w4_tma, bool(w4 and w4[2])),
        dict(RAGGED=ragged, SWIGLU=swiglu, ACTIVATION=activation, UPCAST=checks.upcast_flag(a.dtype),
             PRECISION=checks.dot_precision(a.dtype), G_BLOCK=next_pow2(G + 1),
             SA_ROWS=1 if scaling is None else scaling.sa_rows, SB_COLS=1 if scaling is None else scaling.sb_cols,
             B_W4=w4 and w4[0], W4_GROUP=w4[1] if w4 else 32, W4_TMA=w4_tma, W4_FRAG=bool(w4 and w4[2]),
             **layout_meta(layout)),
        a.device, forced_flavour(config, layout),
        lambda plan: _ragged_launch_of(plan, ragged, G, M, N, swiglu, a.device, own).run(c),
    ))
    return _ragged_launch_of(plan, ragged, G, M, N, swiglu, a.device, own if build is None else build)


def _ragged_launch_of(plan, ragged, G, M, N, swiglu, device, build) -> Launch:
    """ragged_kernel's Launch with ``plan`` (its grid, and split-K's buffers where it splits):
    the call's and autotuning's trials alike."""
    grid = _ragged_grid(plan, ragged, G, M, N, swiglu)
    return Launch(RAGGED, plan, grid, _with_split(plan, grid, device, build))


def _with_split(plan, grid, device, build):
    """``build`` with split-K's buffers in place of ragged_args' Nones where the plan splits:
    one [BLOCK_M * BLOCK_N] fp32 slot per (tile, split) and a counter per tile (core/splitk.py)."""
    split = plan.meta.get("SPLIT_K", 1)
    if split == 1:
        return build
    tiles = grid[0] // split
    slots = split * tiles * plan.meta["BLOCK_M"] * plan.meta["BLOCK_N"]

    def with_buffers(*tensors):
        return (*build(*tensors)[:-2], *splitk.buffers(device, slots, tiles))

    return with_buffers


def ragged_args(a, b, c, bias, offs, strides, routing, scales, G, M, N, K) -> tuple:
    """ragged_kernel's runtime arguments. strides: per operand, its (group, dim 0, dim 1)
    strides; routing: a tiles.Routing; scales: kernels.grouped_scales' Scales."""
    sa, sb, sc = strides
    b = w4_bytes(b) if weight_4bit(b) else interpretable(b)  # packed pairs, read as bytes
    return (Stacked(interpretable(a), *sa), Stacked(b, *sb), Stacked(c, *sc), _bias_operand(bias),
            None if offs is None else Vector(offs, offs.stride(0)), routing, scales, G, M, N, K, None, None)


def tile_bound(total: int, block: int, G: int) -> int:
    """kernels.tile_bound on the host: at most this many tiles of ``block`` over ``total`` rows
    (columns) in G groups and the tail, whatever the offs."""
    return cdiv(total, block) + min(G + 1, max(total, 1))


def _ragged_grid(plan, ragged, G, M, N, swiglu):
    """ragged_kernel's grid: an upper bound on the tiles that needs no offs values (times
    SPLIT_K)."""
    bm, bn = plan.meta["BLOCK_M"], plan.meta["BLOCK_N"]
    if swiglu:
        bn //= 2
    if ragged == "M":
        return (tile_bound(M, bm, G) * cdiv(N, bn) * plan.meta.get("SPLIT_K", 1),)
    if ragged == "N":
        return (cdiv(M, bm) * tile_bound(N, bn, G),)
    return (G * cdiv(M, bm) * cdiv(N, bn),)


def grouped_matmul(a, b, offs=None, *, bias=None, activation=None, out_dtype=None, check_offs=None, config=None, tma=None,
                   scale_a=None, scale_b=None):
    """out[group] = act(a[group] @ b[group] + bias[group]), torch._grouped_mm semantics.

    Modes (G groups; ``offs`` int32 [G] cumulative END offsets, read on the device):
      2D x 3D: a [sum_M, K], b [G, K, N], offs over a's rows -> [sum_M, N]  (MoE forward)
      3D x 3D: a [G, M, K], b [G, K, N], offs=None          -> [G, M, N]  (batched)
      2D x 2D: a [M, sum_K], b [sum_K, N], offs over K      -> [G, M, N]  (MoE weight grad)
      3D x 2D: a [G, M, K], b [K, sum_N], offs over b's cols -> [M, sum_N]
    Groups may be empty; output rows (columns) past offs[-1] are zero. b may be a transposed
    view of [G, N, K] expert weights (read in place). Dtypes: fp16, bf16, fp32, fp8 (fp8
    defaults to a bf16 output). bias: [G, N] ([sum_N] for 3D x 2D). activation: as matmul's.

    check_offs: read offs on the host to raise ValueError for decreasing or overrunning
    offsets. Default (None): only when offs is on the CPU, where it costs no device sync; on a
    GPU the call never syncs (CUDA-graph capturable) and bad offs give an all-NaN output.

    List mode: ``grouped_matmul([a0, a1, ...], [b0, b1, ...])`` -> [a0 @ b0, a1 @ b1, ...],
    each pair its own (M, N, K), one launch. ``config`` forces one triton.Config. ``tma``: as
    in onegemm.matmul (None: the tuner picks pointers or TMA where the layout allows TMA;
    False: pointers; True: TMA or ValueError).

    FP8 (2D x 3D): fp8 ``a [sum_M, K]`` and ``b [G, K, N]`` (e.g. ``w.transpose(1, 2)`` of
    [G, N, K] expert weights) with fp32 dequantisation scales that multiply:
    ``scale_a`` [sum_M, ceil(K/128)] (1x128 blocks, per token) or [sum_M, 1] (row-wise);
    ``scale_b`` [G, ceil(K/128), ceil(N/128)] (128x128 blocks: the transpose(1, 2) of a
    checkpoint's [G, ceil(N/128), ceil(K/128)] weight_scale_inv) or [G, 1, N] (per output
    channel). Output bf16 by default; bias and activation as above. Not differentiable.

    MXFP4 experts prepacked once (``onegemm.prepack_mxfp4``, grouped/prepack.py) come as
    ``b`` alone, a PrepackedMxfp4 of [G, N, K] weights (no scale_b): the same values in the
    order the fast 4-bit K loop reads.

    4-bit weights (2D x 3D, weight-only; grouped/w4.py): a bf16 / fp16 ``a [sum_M, K]`` and
    MXFP4 ``b [G, K / 2, N]`` of dtype torch.float4_e2m1fn_x2 (two e2m1 values per element
    along K, the first in the lower nibble) with ``scale_b [G, K / 32, N]`` of dtype
    torch.float8_e8m0fnu (2^(s - 127) per 32 values along K): the transpose(1, 2) of gpt-oss's
    ``*_blocks`` (flattened to [G, N, K / 2]) and ``*_scales``; or INT4 ``b [G, K / 8, N]`` of
    dtype torch.int32 (eight values per element along K, each stored as value + 8 in 4 bits,
    the first lowest) with ``scale_b [G, K / group, N]`` (16-bit or fp32, the group a power of
    two >= 32): the transpose(1, 2) of compressed-tensors' ``weight_packed`` and
    ``weight_scale``. No scale_a. The weights are dequantised to a's dtype in core's K loop;
    output in a's dtype. Differentiable in a and bias (the weights are frozen; a's gradient
    dequantises them).

    Differentiable in a, b and bias in every mode; each mode's backward is two other modes
    (docs/autograd.md); list mode in every a_i and b_i (each pair's backward is two list-mode
    calls). Traceable by torch.compile, list mode excepted (eager only).
    """
    if b.__class__ is PrepackedMxfp4 or (isinstance(b, torch.Tensor) and b.dtype is MXFP4_PREPACKED):
        b, scale_b = unwrap_prepacked(a, b, scale_b)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        checks.check_config(config)
        for name, value in (("offs", offs), ("bias", bias), ("tma", tma or None), ("scale_a", scale_a), ("scale_b", scale_b)):
            if value is not None:
                raise checks.bad_value(name, "None in list mode (grouped_matmul([a0, ...], [b0, ...]))", type(value).__name__)
        return _list_mode(a, b, activation, out_dtype, config)
    fp8 = scale_a is not None or scale_b is not None
    if config is None:
        if fp8:
            op = GROUPED_W4 if isinstance(b, torch.Tensor) and weight_4bit(b) else GROUPED_FP8
            return op.call(a, b, offs, scale_a, scale_b, bias, activation, out_dtype, check_offs, tma)
        return GROUPED.call(a, b, offs, bias, activation, out_dtype, check_offs, tma)
    if fp8 and not weight_4bit(b):  # (4-bit b has gradients: begin refuses them with a forced config)
        _fp8_no_grad(a, b, offs, scale_a, scale_b, bias)
    begin(config, a, b, bias)
    record = grouped_record(a, b, offs, bias, activation, out_dtype, check_offs, tma, config, scale_a, scale_b)
    return record(a, b, offs, scale_a, scale_b, bias) if fp8 else record(a, b, offs, bias)


# What offs cuts in each mode of grouped_matmul, by (a.dim(), b.dim()): from a and b, the number
# of groups (-1: offs' own length, 2D x 2D), the size of the dimension cut and its name.
# 3D x 3D (batched) takes no offs.
_OFFS_OVER = {
    (2, 3): lambda a, b: (b.shape[0], a.shape[0], "a's rows"),
    (2, 2): lambda a, b: (-1, a.shape[1], "the reduction dimension K"),
    (3, 2): lambda a, b: (a.shape[0], b.shape[1], "b's columns"),
}


def _grouped_shapes(a, b, offs, bias, activation, out_dtype, check_offs, scale_a, scale_b, fake=False):
    """The checks of grouped_matmul's tensor modes; returns (output shape, out_dtype, launch
    arguments, ``scales(scale_a, scale_b)`` -> tiles.Scales or None without scales, and
    (total, what) when offs values are checked on every call, else None). ``fake``: on fake
    tensors (no offs values to read)."""
    checks.check_tensor("a", a, ndim=(2, 3))
    checks.check_tensor("b", b, ndim=(2, 3))
    w4 = weight_4bit(b)
    if w4:
        check_w4_operands(a, b, scale_a, scale_b)
    else:
        checks.check_operand_dtypes(a, b)
    checks.check_activation(activation)
    mode, named = (a.dim(), b.dim()), f"{a.dim()}D x {b.dim()}D"
    G, total, over = _OFFS_OVER[mode](a, b) if mode in _OFFS_OVER else (-1, 0, None)
    check_offs_tensor(offs, named, over, G)
    # offs' values: read here and by the record on every call where check_offs asks (or, by
    # default, offs is on the CPU), never on fake tensors.
    bound = None
    if not fake and over is not None and (check_offs if check_offs is not None else offs.is_cpu):
        bound = (total, f"{over} ({named})")
        check_offs_values(offs, *bound)
    if bias is not None:
        checks.check_tensor("bias", bias, dtypes=checks.FLOAT_DTYPES)
    checks.check_same_device(a=a, b=b, offs=offs, bias=bias)
    out_dtype = checks.resolve_out_dtype(out_dtype, a.dtype)

    if mode == (2, 3):
        G, K, N = b.shape
        M = a.shape[0]
        if w4:
            K = a.shape[1]  # (check_w4_operands checked b's packed K)
        if a.shape[1] != K:
            raise checks.bad_shape("b", f"[G, K, N] with K = {a.shape[1]} (a is [sum_M, K] = {tuple(a.shape)})", b.shape)
        checks.check_bias(bias, (G, N), "each group's output")
        shape, ragged, rows_per_group = (M, N), "M", M // max(G, 1)
    elif mode == (3, 3):
        G, M, K = a.shape
        if b.shape[0] != G or b.shape[1] != K:
            raise checks.bad_shape("b", f"[{G}, {K}, N] (a is [G, M, K] = {tuple(a.shape)})", b.shape)
        N = b.shape[2]
        checks.check_bias(bias, (G, N), "each group's output")
        shape, ragged, rows_per_group = (G, M, N), "", M
    elif mode == (2, 2):
        M, K = a.shape
        N = b.shape[1]
        if b.shape[0] != K:
            raise checks.bad_shape("b", f"[{K}, N] (a is [M, sum_K] = {tuple(a.shape)})", b.shape)
        G = offs.shape[0]
        checks.check_bias(bias, (G, N), "each group's output")
        shape, ragged, rows_per_group = (G, M, N), "K", M
    else:  # (3, 2)
        G, M, K = a.shape
        N = b.shape[1]
        if b.shape[0] != K:
            raise checks.bad_shape("b", f"[{K}, sum_N] (a is [G, M, K] = {tuple(a.shape)})", b.shape)
        checks.check_bias(bias, (N,), "the output (one value per column of [M, sum_N])")
        shape, ragged, rows_per_group = (M, N), "N", M
    args = dict(ragged=ragged, G=G, M=M, N=N, K=K, rows_per_group=rows_per_group)
    scales = None
    if w4:
        frag = b.dtype == MXFP4_PREPACKED
        scales, group = w4_scales(w4, scale_b, G, N, K, frag)
        args["w4"] = (w4, group, frag)
    elif scale_a is not None or scale_b is not None:
        scales, args["scaling"] = _fp8_scales(a, b, scale_a, scale_b, mode, G, M, N, K)
    return shape, out_dtype, args, scales, bound


# What each scale's shape may give (core.scaling.read_granularity), tried in this order: the
# block scales first (unlike blockscaled_matmul's coarsest first). Where both fit (K <= 128 for
# scale_a; K <= 128 with N == 1 for scale_b) both readings give every element the same
# multiplier; the order picks the K loop's code path.
SCALES_A = ((ROW_BLOCKS, "1x128 per token"), (ROW, "row-wise"))
SCALES_B = ((BLOCKS, "128x128"), (COL, "per output channel"))


def _fp8_scales(a, b, scale_a, scale_b, mode, G, M, N, K):
    """The FP8 grouped GEMM's scales as ragged_kernel takes them, and their Scaling."""
    for name, t, other in (("scale_a", scale_a, "scale_b"), ("scale_b", scale_b, "scale_a")):
        if t is None:
            raise checks.bad_value(name, f"an fp32 tensor given with {other}", None)
        checks.check_tensor(name, t, dtypes=(torch.float32,))
    if mode != (2, 3):
        raise checks.bad_value("scale_a", "None except in the 2D x 3D mode (a [sum_M, K], b [G, K, N], offs over rows)",
                               f"scales with a {a.dim()}D x {b.dim()}D call")
    checks.check_fp8("a", a)
    checks.check_fp8("b", b, ndim=3)
    checks.check_same_device(a=a, scale_a=scale_a, scale_b=scale_b)
    scaling = Scaling(read_granularity("scale_a", scale_a, SCALES_A, "a", ("sum_M", "K"), (M, K)),
                      read_granularity("scale_b", scale_b, SCALES_B, "b", ("G", "K", "N"), (G, K, N)))
    a_block, b_block = scaling.a_per_k_block, scaling.b_per_k_block

    def scales(sa, sb):
        return grouped_scales(a=sa if a_block else None, m=None if a_block else sa[:, 0],
                              b=sb if b_block else None, n=None if b_block else sb[:, 0])

    return scales, scaling


def _fp8_no_grad(a, b, offs, scale_a, scale_b, bias) -> None:
    checks.check_not_differentiable("grouped_matmul with scales (fp8)", a=a, b=b, scale_a=scale_a, scale_b=scale_b,
                                    bias=bias)


def grouped_record(a, b, offs, bias, activation, out_dtype, check_offs, tma, config=None, scale_a=None,
                   scale_b=None) -> Record:
    """grouped_matmul's tensor modes: the full path (checks and decisions) as a Record
    (core/dispatch.py), called with (a, b, offs, bias), or (a, b, offs, scale_a, scale_b, bias)
    with scales."""
    checks.check_config(config)
    checks.check_tma(tma)
    if check_offs is not None:
        checks.check_bool("check_offs", check_offs)
    shape, out_dtype, args, scales, bound = _grouped_shapes(a, b, offs, bias, activation, out_dtype, check_offs,
                                                            scale_a, scale_b)
    fp8 = scales is not None
    if fp8 and not args.get("w4"):  # (a 4-bit b's op has a gradient for a: GROUPED_W4)
        _fp8_no_grad(a, b, offs, scale_a, scale_b, bias)
    # offs values are read on every call (check_offs, or offs on the CPU); the rest is metadata.
    check = None if bound is None else (lambda a, b, offs, *rest: check_offs_values(offs, *bound))
    device = a.device
    c = empty(shape, dtype=out_dtype, device=device)
    if c.numel() == 0 or args["G"] == 0:
        return Record(shape, out_dtype, device, finish=torch.Tensor.zero_, check=check)
    G, M, N, K = args["G"], args["M"], args["N"], args["K"]
    if fp8 and not args.get("w4"):
        w = b.transpose(1, 2)  # the experts [G, N, K], K-major: what the Gluon body reads
        mode = gluon_grouped_mode(w, M, G, args["scaling"], a=a, tma=tma, config=config)
        if mode is not None:
            key = hopper_configs.WgmmaKey(configs.m_bucket(M // G), N, K, args["scaling"], configs.dtype_name(out_dtype), mode)

            def run(a, b, offs, scale_a, scale_b, bias):  # row tiles from offs, then the Gluon body
                if check is not None:
                    check(a, b, offs, scale_a, scale_b, bias)
                c = empty(shape, dtype=out_dtype, device=a.device)
                run_wgmma_grouped(a, b.transpose(1, 2), c, lambda block_m: row_tiles(offs, G, M, block_m), scale_a,
                                  scale_b, N=N, key=key, bias=bias, activation=activation)
                return c

            return run
    # The group stride of a 2-D operand is 0: offs cuts it instead.
    bytes_b = w4_bytes(b) if args.get("w4") else b  # a 4-bit b's strides as the kernel reads it: in bytes
    strides = tuple((0, *t.stride()) if t.dim() == 2 else tuple(t.stride()) for t in (a, bytes_b, c))
    if fp8:
        def build(c, a, b, offs, sa, sb, bias):
            return ragged_args(a, b, c, bias, offs, strides, NO_ROUTING, scales(sa, sb), G, M, N, K)
        args["scales"] = scales(scale_a, scale_b)
    else:
        def build(c, a, b, offs, bias):
            return ragged_args(a, b, c, bias, offs, strides, NO_ROUTING, NO_GROUPED_SCALES, G, M, N, K)
    launch = ragged_launch(a, bytes_b, c, offs, strides_a=strides[0], strides_b=strides[1], strides_c=strides[2],
                           bias=bias, activation=activation, config=config, tma=tma, build=build, **args)
    return Record(shape, out_dtype, device, [launch], check=check)


def _grouped_impl(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  activation: Optional[str], out_dtype: Optional[torch.dtype], check_offs: Optional[bool],
                  tma: Optional[bool]) -> torch.Tensor:
    return GROUPED.direct(a, b, offs, bias, activation, out_dtype, check_offs, tma)


def _grouped_fake(a, b, offs, bias, activation, out_dtype, check_offs, tma):
    shape, out_dtype, *_ = _grouped_shapes(a, b, offs, bias, activation, out_dtype, check_offs, None, None, fake=True)
    return a.new_empty(shape, dtype=out_dtype)


def _grouped_fp8_impl(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
                      scale_b: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                      out_dtype: Optional[torch.dtype], check_offs: Optional[bool], tma: Optional[bool]) -> torch.Tensor:
    return GROUPED_FP8.direct(a, b, offs, scale_a, scale_b, bias, activation, out_dtype, check_offs, tma)


def _grouped_fp8_fake(a, b, offs, scale_a, scale_b, bias, activation, out_dtype, check_offs, tma):
    shape, out_dtype, *_ = _grouped_shapes(a, b, offs, bias, activation, out_dtype, check_offs, scale_a, scale_b, fake=True)
    return a.new_empty(shape, dtype=out_dtype)


def _grouped_setup(ctx, inputs, output):
    a, b, offs, bias = inputs[:4]
    ctx.save_for_backward(a, b, offs)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _grouped_backward(ctx, grad):
    """Each mode's gradients are two other modes (torch._grouped_mm's scheme), in onegemm's
    kernels; the bias gradient sums each group's rows of grad (deterministically)."""
    a, b, offs = ctx.saved_tensors
    need_a, need_b, _, need_bias = ctx.needs_input_grad[:4]
    dz_a, dz_b = grad.to(b.dtype), grad.to(a.dtype)
    da = db = dbias = None
    mode = (a.dim(), b.dim())

    def like(t, x, y):  # t's gradient x @ y (a grouped mode; offs is None in 3D x 3D), in t's layout
        return product_like(t, lambda p, q: grouped_matmul(p, q, offs, out_dtype=t.dtype), x, y)

    if mode == (2, 3):  # z [sum_M, N] = a_g [M_g, K] @ b[g] [K, N]
        if need_a:
            da = like(a, dz_a, b.transpose(1, 2))
        if need_b:
            db = like(b, a.t(), dz_b)  # 2D x 2D over sum_M
        if need_bias:
            # 1 x rows of each group: the group sums of grad's rows, in onegemm's (fixed order) K loop.
            ones = torch.ones(1, grad.shape[0], device=grad.device, dtype=torch.float32)
            dbias = grouped_matmul(ones, grad.float(), offs)[:, 0].to(ctx.bias_dtype)
    elif mode == (3, 3):  # z [G, M, N] = a[g] @ b[g]
        if need_a:
            da = like(a, dz_a, b.transpose(1, 2))
        if need_b:
            db = like(b, a.transpose(1, 2), dz_b)
        if need_bias:
            dbias = grad.sum(1, dtype=torch.float32).to(ctx.bias_dtype)
    elif mode == (2, 2):  # z [G, M, N] = a[:, K_g] @ b[K_g, :]
        if need_a:
            da = like(a, dz_a, b.t())  # 3D x 2D: [M, sum_K]
        if need_b:
            db = like(b, a.t(), dz_b)  # 2D x 3D: [sum_K, N]
        if need_bias:
            dbias = grad.sum(1, dtype=torch.float32).to(ctx.bias_dtype)
    else:  # (3, 2): z [M, sum_N] = a[g] @ b[:, N_g]
        if need_a:
            da = like(a, dz_a, b.t())  # 2D x 2D over sum_N: [G, M, K]
        if need_b:
            db = like(b, a.transpose(1, 2), dz_b)  # 3D x 2D: [K, sum_N]
        if need_bias:
            # Columns past offs[-1] are written as zero, bias or not: they get no bias gradient.
            # (No group at all: no column is live. offs[-1:] stays on the device: no sync.)
            end = offs[-1:] if offs.numel() else torch.zeros(1, dtype=offs.dtype, device=offs.device)
            live = torch.arange(grad.shape[1], device=grad.device) < end
            dbias = torch.where(live, grad.sum(0, dtype=torch.float32), 0.0).to(ctx.bias_dtype)
    return da, db, None, dbias, None, None, None, None


GROUPED = Op("grouped_mm", _grouped_impl, _grouped_fake, _grouped_setup, _grouped_backward, tensors=4, activation=4,
             differentiable=("a", "b"), record=grouped_record)
# The FP8 (scaled) 2D x 3D call: its own registered op, without a gradient.
GROUPED_FP8 = Op("grouped_mm_fp8", _grouped_fp8_impl, _grouped_fp8_fake, tensors=6,
                 record=lambda a, b, offs, sa, sb, bias, *rest: grouped_record(a, b, offs, bias, *rest, None, sa, sb),
                 no_grad=lambda a, b, offs, sa, sb, bias, *rest: _fp8_no_grad(a, b, offs, sa, sb, bias))


def _grouped_w4_impl(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor], scale_a: Optional[torch.Tensor],
                        scale_b: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                        out_dtype: Optional[torch.dtype], check_offs: Optional[bool], tma: Optional[bool]) -> torch.Tensor:
    return GROUPED_W4.direct(a, b, offs, scale_a, scale_b, bias, activation, out_dtype, check_offs, tma)


def _grouped_w4_setup(ctx, inputs, output):
    a, b, offs, _, scale_b, bias = inputs[:6]
    ctx.save_for_backward(b, offs, scale_b)
    ctx.dtypes = (a.dtype, None if bias is None else bias.dtype, a.shape[1])


def _grouped_w4_backward(ctx, grad):
    """The weights are frozen (4-bit): da = grad @ W_g per group, W dequantised to a's dtype
    for it (dx for adapters trained on a 4-bit base), and the bias's group sums."""
    b, offs, scale_b = ctx.saved_tensors
    a_dtype, bias_dtype, K = ctx.dtypes
    da = dbias = None
    if ctx.needs_input_grad[0]:
        w = dequantize_w4(b, scale_b, a_dtype)[:, :, :K]  # [G, N, K] (prepacked: padded K)
        da = grouped_matmul(grad.to(a_dtype), w, offs, out_dtype=a_dtype)
    if ctx.needs_input_grad[5]:
        ones = torch.ones(1, grad.shape[0], device=grad.device, dtype=torch.float32)
        dbias = grouped_matmul(ones, grad.float(), offs)[:, 0].to(bias_dtype)
    return da, None, None, None, None, dbias, None, None, None, None


# The 4-bit (weight-only) 2D x 3D call: differentiable in a and bias, the weights frozen.
GROUPED_W4 = Op("grouped_mm_w4", _grouped_w4_impl, _grouped_fp8_fake, _grouped_w4_setup,
                   _grouped_w4_backward, tensors=6, activation=6, differentiable=("a",),
                   record=lambda a, b, offs, sa, sb, bias, *rest: grouped_record(a, b, offs, bias, *rest, None, sa, sb))


def _list_mode(As, Bs, activation, out_dtype, config):
    """List mode's entry: the kernel directly, or with gradients through _ListGrad (eager
    only: a list of tensors is no op schema type, so list mode has no registered op). With
    gradients an activation follows the GEMM as a torch op, as in core.dispatch.fused."""
    for name, value in (("a", As), ("b", Bs)):
        if not isinstance(value, (list, tuple)):
            raise checks.bad_type(name, "a list of tensors in list mode (a and b both lists)", value)
    if not wants_grad(*As, *Bs):
        return grouped_list(As, Bs, activation, out_dtype, config)
    checks.check_differentiable(**{f"a[{i}]": x for i, x in enumerate(As)}, **{f"b[{i}]": w for i, w in enumerate(Bs)})
    begin(config, next(t for t in (*As, *Bs) if t.requires_grad), None, None)  # config's rule under gradients
    checks.check_activation(activation)
    if len(As) != len(Bs):
        raise checks.bad_value("b", f"a list of as many b's as a's ({len(As)})", len(Bs))
    return [apply_activation(z, activation) for z in _ListGrad.apply(len(As), out_dtype, *As, *Bs)]


class _ListGrad(torch.autograd.Function):
    """List mode with gradients: pair i is the plain product z_i = a_i @ b_i, so
    da_i = dz_i @ b_i^T and db_i = a_i^T @ dz_i, each set one list-mode call over the pairs
    that need it (grouped_matmul itself, so the backward is differentiable in turn)."""

    @staticmethod
    def forward(ctx, n: int, out_dtype, *tensors):
        As, Bs = list(tensors[:n]), list(tensors[n:])
        ctx.save_for_backward(*tensors)
        ctx.n = n
        return tuple(grouped_list(As, Bs, None, out_dtype))

    @staticmethod
    def backward(ctx, *grads):
        n, saved = ctx.n, ctx.saved_tensors
        As, Bs = saved[:n], saved[n:]
        need = ctx.needs_input_grad[2:]
        out = [None] * (2 * n)
        pick_a = [i for i in range(n) if need[i]]
        pick_b = [i for i in range(n) if need[n + i]]
        if pick_a:
            das = grouped_matmul([grads[i].to(Bs[i].dtype) for i in pick_a], [Bs[i].t() for i in pick_a],
                                 out_dtype=As[0].dtype)
            for i, da in zip(pick_a, das):
                out[i] = da
        if pick_b:
            dbs = grouped_matmul([As[i].t() for i in pick_b], [grads[i].to(As[i].dtype) for i in pick_b],
                                 out_dtype=Bs[0].dtype)
            for i, db in zip(pick_b, dbs):
                out[n + i] = db
        return (None, None, *out)


def grouped_list(As, Bs, activation=None, out_dtype=None, config=None):
    """List mode (see grouped_matmul): one launch of list_kernel over every pair's tiles."""
    if len(As) != len(Bs):
        raise checks.bad_value("b", f"a list of as many b's as a's ({len(As)})", len(Bs))
    checks.check_activation(activation)
    if len(As) == 0:
        return []
    for i, (x, w) in enumerate(zip(As, Bs)):
        checks.check_tensor(f"a[{i}]", x, ndim=2)
        checks.check_tensor(f"b[{i}]", w, ndim=2)
        checks.check_operand_dtypes(x, w, f"a[{i}]", f"b[{i}]")
        if x.dtype != As[0].dtype or w.dtype != Bs[0].dtype:
            raise checks.bad_dtype(f"a[{i}] and b[{i}]", f"of a[0] and b[0]'s dtypes ({As[0].dtype}, {Bs[0].dtype}): every "
                                   "pair must share one dtype", f"{x.dtype} and {w.dtype}")
        checks.check_inner(x, w, f"a[{i}]", f"b[{i}]")
        checks.check_same_device(**{"a[0]": As[0], f"a[{i}]": x, f"b[{i}]": w})
    out_dtype = checks.resolve_out_dtype(out_dtype, As[0].dtype)
    As, Bs = [interpretable(x) for x in As], [interpretable(w) for w in Bs]
    device = As[0].device
    Cs = [empty((x.shape[0], w.shape[1]), dtype=out_dtype, device=device) for x, w in zip(As, Bs)]
    G = len(As)
    # The tables travel to the device once per call (one small host->device copy, no sync).
    ptrs = torch.tensor([[x.data_ptr(), w.data_ptr(), c.data_ptr()] for x, w, c in zip(As, Bs, Cs)], dtype=torch.int64)
    sizes = torch.tensor([[x.shape[0], w.shape[1], x.shape[1]] for x, w in zip(As, Bs)], dtype=torch.int32)
    strides = torch.tensor(
        [[x.stride(0), x.stride(1), w.stride(0), w.stride(1), c.stride(0), c.stride(1)] for x, w, c in zip(As, Bs, Cs)],
        dtype=torch.int64,
    )
    ptrs = ptrs.t().contiguous().to(device, non_blocking=True)
    sizes = sizes.to(device, non_blocking=True)
    strides = strides.to(device, non_blocking=True)
    shapes = [(x.shape[0], w.shape[1]) for x, w in zip(As, Bs)]
    total = sum(m * n for m, n in shapes)
    dtype = As[0].dtype
    key = (dtype, Bs[0].dtype, out_dtype, activation, G, configs.m_bucket(total, cap=1 << 26),
           checks.dot_precision(dtype), device.index, config)
    args = (ptrs[0], ptrs[1], ptrs[2], sizes, strides, G, As[0], Bs[0], Cs[0])

    def request():
        return Request(
            ListKey(configs.dtype_name(dtype), G, configs.m_bucket(total, cap=1 << 26)),
            dict(ACTIVATION=activation, UPCAST=checks.upcast_flag(dtype), PRECISION=checks.dot_precision(dtype),
                 G_BLOCK=next_pow2(G)),
            device, config, lambda plan: _launch_list(plan, args, shapes, device),
        )

    _launch_list(LIST.plan_for(request, key), args, shapes, device)
    return Cs


def _launch_list(plan, args, shapes, device):
    """list_kernel's grid: min(SM count, every pair's tiles), one persistent walk."""
    bm, bn = plan.meta["BLOCK_M"], plan.meta["BLOCK_N"]
    tiles = sum(cdiv(m, bm) * cdiv(n, bn) for m, n in shapes)
    LIST.launch(plan, (max(1, min(default_programs(plan.device_index), tiles)),), args)
