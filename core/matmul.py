"""onegemm.matmul and onegemm.linear: the launch-per-tile GEMM (tutorial-03 style)."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import triton
import triton.language as tl

from . import checks, configs, splitk
from .dispatch import Cached, Launch, Op, Record, begin
from .launch import Launcher, Request
from .runtime import INTERPRET, cdiv, empty, interpretable, product_like, tile_grid
from .tiles import (NO_SCALES, NO_VECTOR, Operand, Routing, SplitK, TileSpec, Vector, gemm_tile, make_operands, program_units,
                    stream_k, swizzle_tile)
from .tma import choose_tma, forced_flavour, layout_meta


@triton.jit
def matmul_kernel(
    A, B, C, bias, scales, M, N, K, ws_ptr, lock_ptr, sk_tiles,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
    PERSISTENT: tl.constexpr = False, PROGRAMS_PER_SM: tl.constexpr = 1,
    SA_ROWS: tl.constexpr = 1, SB_COLS: tl.constexpr = 1, STREAM_K: tl.constexpr = False,
):
    """C = act(A @ B + bias), with optional dequantisation scales: every dense GEMM in onegemm
    (matmul, linear, persistent_matmul, blockscaled_matmul). One program per work unit, or
    (PERSISTENT) each program looping over units pid, pid + P, ... (P programs). A unit is one
    output tile, or with SPLIT_K one K split of one.

    A [M, K], B [K, N], C [M, N]: tiles.Operand (pointer, stride of dim 0, stride of dim 1).
    bias: tiles.Vector over [N] (tiles.NO_VECTOR: none).
    scales: tiles.Scales (blockscaled/matmul.py; all None for matmul): per-K-block scales of A
        (sa[i // SA_ROWS, k // BLOCK_K]) and of B (sb[k // BLOCK_K, j // SB_COLS]), row-wise
        and column-wise (or tensor-wise, stride 0) scales applied in the epilogue.
    USE_TMA, A_K_CONTIG, B_K_CONTIG: the TMA flavour and its operand layout
        (tiles.make_operands; core/tma.py says which calls may use it, the config picks). Its
        descriptors are built once per program, before the unit loop.
    WARP_SPECIALIZE: core's warp-specialised K loop (tiles.mma_k_loop; TMA flavour only).
    SPLIT_K, ws_ptr, lock_ptr: split-K (core/splitk.py): unit u is split u % SPLIT_K of tile
        u // SPLIT_K; ws_ptr fp32 [SPLIT_K * M, N] and lock_ptr int32 [tiles] are the partials
        and counters of tiles.split_k_combine (None when SPLIT_K is 1). A tile's splits are
        consecutive units, so under PERSISTENT they run on neighbouring programs of one pass;
        the last to finish sums the partials, and no program ever waits for another.
    PERSISTENT: the persistent schedule (tiles.program_units; persistent/matmul.py says why).
    STREAM_K (with PERSISTENT): tiles.stream_k, the first ``sk_tiles`` tiles shared out by K
        blocks, the rest walked whole; ws_ptr fp32 [2 * P, BLOCK_M * BLOCK_N] and lock_ptr
        int32 [2 * P] (one counter per shared tile) hold their partials and tickets
        (core/splitk.py).
        sk_tiles: None unless STREAM_K.
    PROGRAMS_PER_SM: read by the host only (runtime.tile_grid): the default persistent grid is
        the SM count times this, so two programs of a small tile can share an SM.
    Grid: runtime.tile_grid: units = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K programs,
        or min(P, units) with PERSISTENT (P with STREAM_K); the loop stride is the launched grid
        size, so it can never disagree with the grid. Tiles in grouped (GROUP_M) order either way.
    """
    spec: tl.constexpr = TileSpec(BLOCK_M, BLOCK_N, BLOCK_K, ACTIVATION, UPCAST, PRECISION, USE_TMA, A_K_CONTIG, B_K_CONTIG,
                    WARP_SPECIALIZE, SPLIT_K, SA_ROWS, SB_COLS)
    a, b, c = make_operands(A, B, C, M, N, K, spec)
    if STREAM_K:
        tl.static_assert(PERSISTENT and SPLIT_K == 1)
        stream_k(a, b, c, M, N, K, spec, scales, bias, ws_ptr, lock_ptr, sk_tiles, GROUP_M)
    else:
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for i in tl.range(0, program_units(num_pid_m * num_pid_n * SPLIT_K, PERSISTENT)):
            unit = tl.program_id(0) + i * tl.num_programs(0)
            pid_m, pid_n = swizzle_tile(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
            gemm_tile(pid_m, pid_n, a, b, c, M, N, K, spec, scales, Routing(), bias,
                      SplitK(unit % SPLIT_K, ws_ptr, lock_ptr))


MATMUL = Launcher(matmul_kernel, "matmul")


def matmul(a, b, *, bias=None, activation=None, out_dtype=None, config: triton.Config | None = None, tma=None,
           persistent=None):
    """out = act(a @ b + bias), accumulated in fp32, cast to ``out_dtype``.

    a [M, K], b [K, N], any strides (b may be ``W.t()`` of an nn.Linear weight, or a slice).
    Dtypes: float16, bfloat16, float32, float8_e4m3fn / float8_e5m2 (fp8 defaults to a
    bfloat16 output). bias [N]. activation: None, "relu", "gelu", "gelu_tanh", "silu".
    ``config`` forces one triton.Config instead of the chosen one (benchmarks and tests use it).
    ``tma``: None lets the config (the tuned table's, the heuristic's or, opted in, the
    autotuner's) choose between pointer loads and the TMA flavour (tensor-descriptor loads) on
    a Hopper GPU when a, b and the output allow TMA, and uses pointer loads otherwise; False
    forces pointers; True forces TMA or raises ValueError (see core/tma.py).
    ``persistent``: None lets the config choose the schedule (the tuned table and the
    heuristic take the persistent one for large outputs); False keeps one program per tile;
    True runs only the persistent schedule, as onegemm.persistent_matmul does. The
    interpreter runs one program per tile unless True.
    Differentiable in a, b and bias (docs/autograd.md), and traceable by torch.compile.
    """
    if config is None:
        return DENSE.call(a, b, bias, activation, out_dtype, tma, persistent, None)
    return forced(a, b, bias, activation, out_dtype, config, tma, persistent, None)


def forced(a, b, bias, activation, out_dtype, config, tma, persistent, programs):
    """A dense call with a forced ``config`` (a benchmarking knob: never with gradients or
    under torch.compile), off the signature cache."""
    begin(config, a, b, bias)
    return dense_record(a, b, bias, activation, out_dtype, tma, persistent, programs, config)(a, b, bias)


def dense_record(a, b, bias, activation, out_dtype, tma, persistent, programs, config=None) -> Record:
    """The full path of every dense op (matmul, persistent_matmul, linear): its checks and
    decisions for these arguments, as a Record of the launch (core/dispatch.py).
    ``programs``: the persistent grid size asked for (persistent_matmul's ``num_programs``;
    None: SM count x the config's PROGRAMS_PER_SM)."""
    M, N, K, out_dtype = check_matmul_inputs(a, b, bias, activation, out_dtype)
    schedule = configs.schedule_mode(persistent)
    checks.check_tma(tma)
    checks.check_config(config)
    if programs is not None:
        checks.check_int("num_programs", programs, 1, what="(the number of programs to launch) or None")
    if M == 0 or N == 0:
        return Record((M, N), out_dtype, a.device)
    c = empty((M, N), device=a.device, dtype=out_dtype)
    layout = choose_tma(tma, a, b, c)
    if config is not None and persistent is not None:
        config = configs.with_meta(config, PERSISTENT=persistent)
    if config is not None and config.kwargs.get("STREAM_K") and (
            not config.kwargs.get("PERSISTENT") or config.kwargs.get("SPLIT_K", 1) != 1):
        raise checks.bad_value("config", "persistent and unsplit with STREAM_K (stream-K is a persistent schedule of "
                               "whole K ranges; persistent=False or SPLIT_K asks for another)", configs.label(config))
    plan = MATMUL.plan_for(Request(
        configs.MatmulKey(configs.dtype_name(a.dtype), configs.m_bucket(M), N, K, a.stride(1) == 1, b.stride(0) == 1,
                          configs.flavour_mode(tma, layout is not None), schedule, programs or 0),
        dict(ACTIVATION=activation, UPCAST=checks.upcast_flag(a.dtype), PRECISION=checks.dot_precision(a.dtype),
             PERSISTENT=persistent is True, **layout_meta(layout)),
        a.device, forced_flavour(config, layout),
        lambda plan: dense_launch(MATMUL, plan, a, b, c, programs).run(c, a, b, bias),
    ))
    return Record((M, N), out_dtype, a.device, [dense_launch(MATMUL, plan, a, b, c, programs)])


def dense_launch(launcher, plan, a, b, c, programs=None, scales=None) -> Launch:
    """matmul_kernel's launch with ``plan`` for operands shaped like a, b, c: C = act(A @ B +
    bias), scaled by ``scales(*scale tensors)`` (a tiles.Scales; blockscaled/ passes its own
    launcher, whose family tunes fp8 configs, and its scales). Its builder takes
    ``(c, a, b, bias)``, or ``(c, a, b, scale_a, scale_b, bias)`` with scales."""
    M, K = a.shape
    N = b.shape[1]
    (sa0, sa1), (sb0, sb1), (sc0, sc1) = a.stride(), b.stride(), c.stride()
    grid = tile_grid(M, N, plan.meta, plan.device_index, programs)
    sk_tiles = None
    if plan.meta.get("STREAM_K"):
        sk_tiles = configs.stream_k_tiles(cdiv(M, plan.meta["BLOCK_M"]) * cdiv(N, plan.meta["BLOCK_N"]), grid[0],
                                          cdiv(K, plan.meta["BLOCK_K"]))
        if not sk_tiles:  # no tile to share: the plain persistent walk, which runs faster
            # (bench/results/persistent_default.md)
            plan, sk_tiles = launcher.variant(plan, STREAM_K=False), None
            grid = tile_grid(M, N, plan.meta, plan.device_index, programs)
    elif plan.meta.get("PERSISTENT") and grid[0] == tile_grid(M, N, {**plan.meta, "PERSISTENT": False}, None)[0]:
        # One unit per program: launch-per-tile's kernel runs the same schedule without the
        # unit loop, which ran slower (bench/results/persistent_default.md).
        plan = launcher.variant(plan, PERSISTENT=False)
    meta = plan.meta
    split = meta.get("SPLIT_K", 1) != 1 or meta.get("STREAM_K", False)
    fp8 = INTERPRET and a.dtype in checks.FP8_DTYPES

    def args(c, a, b, bias, scales):
        ws, locks = splitk.for_plan(meta, c.device, M, N, grid[0]) if split else (None, None)
        if fp8:
            a, b = interpretable(a), interpretable(b)
        return (Operand(a, sa0, sa1), Operand(b, sb0, sb1), Operand(c, sc0, sc1),
                NO_VECTOR if bias is None else Vector(bias, bias.stride(0)), scales, M, N, K, ws, locks, sk_tiles)

    if scales is None:
        build = lambda c, a, b, bias: args(c, a, b, bias, NO_SCALES)  # noqa: E731
    else:
        build = lambda c, a, b, sa, sb, bias: args(c, a, b, bias, scales(sa, sb))  # noqa: E731
    return Launch(launcher, plan, grid, build)


def _dense_impl(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                out_dtype: Optional[torch.dtype], tma: Optional[bool], persistent: Optional[bool],
                programs: Optional[int]) -> torch.Tensor:
    return DENSE.direct(a, b, bias, activation, out_dtype, tma, persistent, programs)


def _dense_fake(a, b, bias, activation, out_dtype, tma, persistent, programs):
    M, N, K, out_dtype = check_matmul_inputs(a, b, bias, activation, out_dtype)
    return a.new_empty((M, N), dtype=out_dtype)


def _dense_setup(ctx, inputs, output):
    a, b, bias = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _dense_backward(ctx, grad):
    """z = a @ b + bias: da = dz @ b^T, db = a^T @ dz (onegemm's GEMMs), dbias = sum of dz's rows."""
    a, b = ctx.saved_tensors
    da = db = dbias = None
    if ctx.needs_input_grad[0]:
        da = product_like(a, partial(matmul, out_dtype=a.dtype), grad.to(b.dtype), b.t())
    if ctx.needs_input_grad[1]:
        db = product_like(b, partial(matmul, out_dtype=b.dtype), a.t(), grad.to(a.dtype))
    if ctx.needs_input_grad[2]:
        dbias = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return da, db, dbias, None, None, None, None, None


DENSE = Op("matmul", _dense_impl, _dense_fake, _dense_setup, _dense_backward, record=dense_record, tensors=3,
           activation=3, differentiable=("a", "b"))


def check_matmul_inputs(a, b, bias, activation, out_dtype):
    """The checks of the matmul contract, shared by every op that offers it (matmul,
    persistent_matmul). Returns (M, N, K, out_dtype)."""
    checks.check_tensor("a", a, ndim=2)
    checks.check_tensor("b", b, ndim=2)
    checks.check_operand_dtypes(a, b)
    M, K = a.shape
    N = b.shape[1]
    checks.check_inner(a, b)
    if activation is not None:
        checks.check_activation(activation)
    if bias is not None:
        checks.check_bias(bias, (N,))
        checks.check_same_device(a=a, b=b, bias=bias)
    elif a.get_device() != b.get_device():
        checks.check_same_device(a=a, b=b)
    return M, N, K, checks.resolve_out_dtype(out_dtype, a.dtype)


def linear(x, weight, bias=None, *, activation=None):
    """F.linear semantics with an optional fused activation: act(x @ weight.T + bias).

    x [..., K], weight [N, K] (nn.Linear layout; read through ``weight.t()``, no copy),
    bias [N]. The output has x's leading dims and x's dtype. Differentiable in x, weight and
    bias.
    """
    return LINEAR(x, weight, bias, activation)


def _linear_route(args):
    """linear's checks, then matmul's route for x as [M, K] and weight.t() (which checks
    nothing linear has not: on a miss only)."""
    x, weight, bias, activation = args
    checks.check_tensor("x", x)
    checks.check_tensor("weight", weight, ndim=2)
    checks.check_operand_dtypes(x, weight, "x", "weight")
    if x.dim() == 0:
        raise checks.bad_shape("x", "[..., K] (at least 1-D)", x.shape)
    K = x.shape[-1]
    if K != weight.shape[1]:
        raise checks.bad_shape("weight", f"[out_features, {K}] (x has {K} features in its last dim)", weight.shape)
    if activation is not None:
        checks.check_activation(activation)
    checks.check_bias(bias, (weight.shape[0],))
    checks.check_same_device(x=x, weight=weight, bias=bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    inner = DENSE.route((x2, weight.t(), bias, activation, None, None, None, None))
    if x.dim() == 2:
        return lambda x, weight, bias: inner(x, weight.t(), bias)
    shape = (*x.shape[:-1], weight.shape[0])
    return lambda x, weight, bias: inner(x.reshape(-1, K), weight.t(), bias).reshape(shape)


LINEAR = Cached(3, _linear_route)
