"""onegemm.matmul and onegemm.linear: the launch-per-tile GEMM (tutorial-03 style)."""

from __future__ import annotations

import triton
import triton.language as tl

from . import checks, configs, splitk
from .launch import Launcher, Request
from .runtime import empty, interpretable, tile_grid
from .tiles import gemm_tile, grouped_tile, make_operands, program_units
from .tma import choose_tma, forced_flavour, layout_meta


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    ws_ptr, lock_ptr,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr = 1, WARP_SPECIALIZE: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
    PERSISTENT: tl.constexpr = False, FLATTEN: tl.constexpr = False, PROGRAMS_PER_SM: tl.constexpr = 1,
):
    """C = act(A @ B + bias), one program per work unit, or (PERSISTENT) each program looping
    over units pid, pid + P, ... (P programs). A unit is one output tile, or with SPLIT_K one
    K split of one.

    a_ptr [M, K], b_ptr [K, N], c_ptr [M, N]: element [i, j] at ptr + i*stride_x0 + j*stride_x1.
    bias_ptr [N] (stride_bias) or None.
    USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT: the TMA flavour and its operand layout
        (tiles.make_operands; core/tma.py says which calls may use it, the config picks). Its
        descriptors are built once per program, before the unit loop.
    WARP_SPECIALIZE: core's warp-specialised K loop (tiles.mma_k_loop; TMA flavour only).
    SPLIT_K, ws_ptr, lock_ptr: split-K (core/splitk.py): unit u is split u % SPLIT_K of tile
        u // SPLIT_K; ws_ptr fp32 [SPLIT_K * M, N] and lock_ptr int32 [tiles] are the partials
        and counters of tiles.split_k_combine (None when SPLIT_K is 1). A tile's splits are
        consecutive units, so under PERSISTENT they run on neighbouring programs of one pass;
        the last to finish sums the partials, and no program ever waits for another.
    PERSISTENT: the persistent schedule (tiles.program_units; persistent/matmul.py says why).
    FLATTEN: tl.range(flatten=True) merges the unit loop and the K loop into one software
        pipeline, so the next tile's loads overlap this tile's epilogue (PERSISTENT only).
        Measured on the H200 (bench/results/persistent.md): +3% at 4096^3, -9% at 8192^3,
        -21% on a 266-tile shape, so no tuned config sets it (``config=`` can).
    PROGRAMS_PER_SM: read by the host only (runtime.tile_grid): the default persistent grid is
        the SM count times this, so two programs of a small tile can share an SM.
    Grid: runtime.tile_grid: units = cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) * SPLIT_K programs,
        or min(P, units) with PERSISTENT; the loop stride is the launched grid size, so it can
        never disagree with the grid. Tiles in grouped (GROUP_M) order either way.
    """
    a, b, c = make_operands(
        a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT,
    )
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for i in tl.range(0, program_units(num_pid_m * num_pid_n * SPLIT_K, PERSISTENT), flatten=FLATTEN):
        unit = tl.program_id(0) + i * tl.num_programs(0)
        pid_m, pid_n = grouped_tile(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        gemm_tile(
            pid_m, pid_n, a, b, c, bias_ptr, M, N, K,
            stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
            ACTIVATION, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            USE_TMA=USE_TMA, A_K_CONTIG=A_K_CONTIG, B_K_CONTIG=B_K_CONTIG, EPI_SPLIT=EPI_SPLIT,
            WARP_SPECIALIZE=WARP_SPECIALIZE,
            split=unit % SPLIT_K, SPLIT_K=SPLIT_K, ws_ptr=ws_ptr, lock_ptr=lock_ptr,
        )


def check_matmul_inputs(a, b, bias, activation, out_dtype):
    """The checks of the matmul contract, shared by every op that offers it (matmul,
    persistent_matmul). Returns (M, N, K, out_dtype)."""
    checks.check_tensor("a", a, ndim=2)
    checks.check_tensor("b", b, ndim=2)
    checks.check_operand_dtypes(a, b)
    M, K = a.shape
    N = b.shape[1]
    if K != b.shape[0]:
        raise checks.bad_shape("b", f"[K, N] with K = {K} (a is [M, K] = {tuple(a.shape)})", b.shape)
    if activation is not None:
        checks.check_activation(activation)
    if bias is not None:
        checks.check_bias(bias, (N,))
        checks.check_same_device(a=a, b=b, bias=bias)
    elif a.get_device() != b.get_device():
        checks.check_same_device(a=a, b=b)
    return M, N, K, checks.resolve_out_dtype(out_dtype, a.dtype)


MATMUL = Launcher(matmul_kernel, configs.MATMUL)


def matmul(a, b, *, bias=None, activation=None, out_dtype=None, config: triton.Config | None = None, tma=None,
           persistent=None):
    """out = act(a @ b + bias), accumulated in fp32, cast to ``out_dtype``.

    a [M, K], b [K, N], any strides (b may be ``W.t()`` of an nn.Linear weight, or a slice).
    Dtypes: float16, bfloat16, float32, float8_e4m3fn / float8_e5m2 (fp8 defaults to a
    bfloat16 output). bias [N]. activation: None, "relu", "gelu", "gelu_tanh", "silu".
    ``config`` forces one triton.Config instead of autotuning (benchmarks and tests use it).
    ``tma``: None lets the autotuner choose between pointer loads and the TMA flavour
    (tensor-descriptor loads) on a Hopper GPU when a, b and the output allow TMA, and uses
    pointer loads otherwise; False forces pointers; True forces TMA or raises ValueError (see
    core/tma.py).
    ``persistent``: None lets the config choose the schedule (the tuned table and the
    heuristic take the persistent one for large outputs); False keeps one program per tile;
    True runs only the persistent schedule, as onegemm.persistent_matmul does. The
    interpreter runs one program per tile unless True.
    """
    M, N, K, out_dtype = check_matmul_inputs(a, b, bias, activation, out_dtype)
    return run_matmul(a, b, bias, activation, out_dtype, config, tma, persistent)


def run_matmul(a, b, bias, activation, out_dtype, config, tma, persistent, programs=None):
    """matmul's body, on inputs ``check_matmul_inputs`` (or the caller) has checked.
    ``programs``: the persistent grid size asked for (persistent_matmul's ``num_programs``;
    None: SM count x the config's PROGRAMS_PER_SM)."""
    M, K = a.shape
    N = b.shape[1]
    schedule = configs.schedule_mode(persistent)
    checks.check_config(config)
    c = empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    layout = choose_tma(tma, a, b, c)
    precision = checks.dot_precision(a.dtype)
    sa, sb = a.stride(), b.stride()
    key = (a.dtype, b.dtype, out_dtype, bias is None or bias.dtype, activation, configs.m_bucket(M), N, K,
           sa[1] == 1, sb[0] == 1, layout, tma, schedule, programs, precision, a.get_device(), config)

    def request():
        forced = config
        if forced is not None and persistent is not None:
            forced = configs.with_meta(forced, PERSISTENT=persistent)
        return Request(
            configs.MatmulKey(configs.dtype_name(a.dtype), configs.m_bucket(M), N, K, sa[1] == 1, sb[0] == 1,
                              configs.flavour_mode(tma, layout is not None), schedule, programs or 0),
            dict(ACTIVATION=activation, UPCAST=checks.upcast_flag(a.dtype), PRECISION=precision,
                 PERSISTENT=persistent is True, **layout_meta(layout)),
            a.device, forced_flavour(forced, layout), lambda plan: _launch(plan, a, b, c, bias, programs),
        )

    _launch(MATMUL.plan(key, request), a, b, c, bias, programs)
    return c


def _launch(plan, a, b, c, bias, programs):
    """One launch of matmul_kernel with ``plan``: C = act(A @ B + bias)."""
    M, K = a.shape
    N = b.shape[1]
    ws, locks = splitk.for_plan(plan.meta, a.device, M, N)
    a, b = interpretable(a), interpretable(b)
    sa, sb, sc = a.stride(), b.stride(), c.stride()
    MATMUL.launch(plan, tile_grid(M, N, plan.meta, plan.device_index, programs), (
        a, b, c, bias, M, N, K, sa[0], sa[1], sb[0], sb[1], sc[0], sc[1],
        0 if bias is None else bias.stride(0), ws, locks,
    ))


def linear(x, weight, bias=None, *, activation=None):
    """F.linear semantics with an optional fused activation: act(x @ weight.T + bias).

    x [..., K], weight [N, K] (nn.Linear layout; read through ``weight.t()``, no copy),
    bias [N]. The output has x's leading dims and x's dtype.
    """
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
    out_dtype = checks.resolve_out_dtype(None, x.dtype)
    if x.dim() == 2:
        return run_matmul(x, weight.t(), bias, activation, out_dtype, None, None, None)
    y = run_matmul(x.reshape(-1, K), weight.t(), bias, activation, out_dtype, None, None, None)
    return y.reshape(*x.shape[:-1], weight.shape[0])
