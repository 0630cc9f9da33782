"""onegemm.matmul and onegemm.linear: the launch-per-tile GEMM (tutorial-03 style)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks, splitk
from .runtime import Kernel, empty, next_pow2_bucket, tile_grid, with_meta
from .tiles import gemm_tile, grouped_tile, make_operands, program_units
from .tma import choose_tma, flavour_meta, keep_flavours, launch_flavoured, tuned_flavours, warp_specialized


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    M_BUCKET, LAYOUT, TMA_MODE, SCHEDULE, PROGRAMS_KEY,
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
    M_BUCKET, LAYOUT, TMA_MODE, SCHEDULE, PROGRAMS_KEY: autotune key only, unused in the body:
        the next power of two of M; which operands are K-contiguous; which load flavours and
        which schedules the tuner may pick (core/tma.py, ``schedule_mode``); the program count
        persistent_matmul was asked for (0 otherwise).
    USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT: the TMA flavour and its operand layout
        (tiles.make_operands; core/tma.py says which calls may use it, the tuner picks). Its
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


def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
        num_warps=warps, num_stages=stages,
    )


# Hopper (H200) configs. 128x256 / 256x128 tiles with 8 warps (two consumer warpgroups)
# are what wgmma needs to approach the bf16 peak; 128x128 and 64-row tiles cover small M and
# small N, where big tiles leave most of the 132 SMs idle. BLOCK_K=128 rows are for fp8
# (same bytes per stage as BLOCK_K=64 in bf16).
MATMUL_CONFIGS = [
    _cfg(128, 256, 64, 8, 3),
    _cfg(256, 128, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 4, 4),
    _cfg(64, 256, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 64, 64, 4, 5),
    _cfg(128, 256, 128, 8, 3),
    _cfg(256, 128, 128, 8, 3),
    _cfg(128, 128, 128, 8, 4),
    _cfg(64, 128, 128, 4, 4),
    _cfg(64, 64, 128, 4, 4),
    _cfg(128, 128, 32, 4, 4),
    _cfg(64, 64, 32, 4, 4),
]

# Warp-specialised (TMA only, so they carry USE_TMA): a TMA producer and two consumer
# warpgroups (core/tiles.py mma_k_loop). 4 warps, as Triton 3.6 splits a 4-warp program's
# tile between the consumers (8 gave no partitions). Measured on the H200, bf16, forced
# (bench/diagnose_blockscaled.py bf16): 128x256x64 at 0.91/0.94/0.97x cuBLAS on 4096^3 /
# 8192^3 / 8192x14336x4096, against 0.74/0.82/0.81x for the same tile with 8 warps unspecialised;
# 256x128x64 0.91/0.94/0.95x. On the persistent schedule it gained nothing (0.87-1.01x cuBLAS
# with it, 0.83-1.03x without), so no persistent config is warp-specialised.
WS_CONFIGS = [
    warp_specialized(_cfg(128, 256, 64, 4, 3), USE_TMA=True),
    warp_specialized(_cfg(256, 128, 64, 4, 3), USE_TMA=True),
]

# Split-K (core/splitk.py) for small M, where the tiles above leave most SMs idle: the
# 64-row tiles that M <= 64 tunes, each with 2, 4 and 8 splits. The tuner tries them only
# while SPLIT_K x the M bucket <= 512 (splitk.allowed). Measured on the H200, bf16
# (bench/results/matmul.md): 16x4096x14336 0.64x -> 0.92x cuBLAS (splitK4), 128x4096x14336
# 0.68x -> 0.87x (splitK2); the N = 14336 shapes have enough tiles and stay unsplit.
SPLIT_K_CONFIGS = splitk.with_splits([
    _cfg(64, 64, 64, 4, 5),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 64, 128, 4, 4),
    _cfg(64, 128, 128, 4, 4),
    _cfg(64, 64, 32, 4, 4),
])


def persistent(configs: list[triton.Config], **extra) -> list[triton.Config]:
    """Each config on the persistent schedule; ``extra`` adds constexprs."""
    return [with_meta(c, PERSISTENT=True, **extra) for c in configs]


def two_per_sm(configs: list[triton.Config]) -> list[triton.Config]:
    """The 64 x (64 or 128) tiles of ``configs``, with two programs per SM by default."""
    small = [c for c in configs if c.kwargs["BLOCK_M"] == 64 and c.kwargs["BLOCK_N"] <= 128]
    return persistent(small, PROGRAMS_PER_SM=2)


# The persistent schedule (PERSISTENT; persistent/matmul.py) over the same tiles, split ones
# included, so bench/bench_persistent.py's ratio is scheduling, not a different tile shape.
# (Without the split configs, launch-per-tile split K on 5 small-M shapes of that sweep and
# persistence lost there: 0.97x over the sweep against 1.04x on the other 16 shapes.)
# Plus the small tiles at two programs per SM: launch-per-tile keeps several 64-row programs
# resident on an SM, each hiding the others' load latency, and one persistent program per SM
# ran at 0.77-0.87x of it at M = 256 (bench/results/persistent.md). Their pipelines need 64-98
# KB of shared memory (stages x (BLOCK_M + BLOCK_N) x BLOCK_K x itemsize), so two fit in the
# H200's 227 KB; 64x256 (160 KB) does not.
PERSISTENT_CONFIGS = persistent(MATMUL_CONFIGS + SPLIT_K_CONFIGS) + two_per_sm(MATMUL_CONFIGS + SPLIT_K_CONFIGS)


def auto_persistent(cfg: triton.Config) -> bool:
    """Whether matmul's automatic schedule (persistent=None) tries ``cfg``: the persistent
    128x256 / 256x128 tiles, one program per SM, unsplit. Measured on the H200, bf16
    (bench/results/persistent.md, 93fecfd): persistent 128x256x64 w8 s3 with TMA ran 726 and
    742 TFLOP/s at 4096^3 and 8192^3, 1.09x and 1.06x the best launch-per-tile config (the
    warp-specialised 128x256 / 256x128), and it was persistent_matmul's TMA pick on all 7
    shapes of that sweep with M >= 1536. The smaller persistent tiles ran at 0.99-1.0x of
    launch-per-tile (M <= 256), so tuning them here too would only cost time."""
    kw = cfg.kwargs
    return (kw.get("PERSISTENT", False) and kw["BLOCK_M"] * kw["BLOCK_N"] == 128 * 256
            and kw.get("SPLIT_K", 1) == 1 and kw.get("PROGRAMS_PER_SM", 1) == 1)


# Under the interpreter: one small config. Cost grows with programs x K iterations, so CPU
# tests stay quick; 32 is also tl.dot's minimum for fp8 on the interpreter's fp16 emulation.
INTERPRET_CONFIG = _cfg(32, 32, 32, 1, 1, group_m=4)


def prune_configs(configs, args):
    """Keep the configs that suit the dtype and the M bucket (tuning fewer is faster)."""
    a = args["a_ptr"]
    itemsize = a.element_size()
    # One K step moves BLOCK_K * itemsize bytes per row: 64 for fp8 and 128 for 16-bit inputs
    # fill a 128-byte TMA/wgmma swizzle row; fp32 takes 32 to keep shared memory in budget.
    want_bk = {1: 128, 2: 64, 4: 32}[itemsize]
    m_bucket = args["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] == want_bk and splitk.allowed(c, m_bucket)]
    if m_bucket <= 64:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    return kept or configs


# Which schedules a call lets the tuner pick (the SCHEDULE key argument; matmul's
# ``persistent``): launch-per-tile only, persistent only, or either.
PER_TILE, PERSISTENT_ONLY, ANY_SCHEDULE = 0, 1, 2


def schedule_mode(persistent: bool | None) -> int:
    if persistent not in (None, True, False):
        raise TypeError(f"persistent must be None (automatic), True or False, got {persistent!r}")
    return ANY_SCHEDULE if persistent is None else (PERSISTENT_ONLY if persistent else PER_TILE)


def keep_schedules(configs, args):
    """The configs whose schedule the call's SCHEDULE allows (a pruner step); automatic
    scheduling adds only the ``auto_persistent`` ones to the launch-per-tile configs."""
    mode = args["SCHEDULE"]
    if mode == ANY_SCHEDULE:
        return [c for c in configs if not c.kwargs.get("PERSISTENT") or auto_persistent(c)]
    return [c for c in configs if c.kwargs.get("PERSISTENT", False) == (mode == PERSISTENT_ONLY)]


def prune_flavours(configs, args):
    """prune_configs, then keep the load flavours (TMA_MODE) and schedules (SCHEDULE) this
    call allows."""
    return keep_schedules(keep_flavours(prune_configs(configs, args), args), args)


# The tuner picks the load flavour and the schedule with the tile shape. Measured on the H200
# in GPU time (bench/diagnose_matmul.py): each program builds its TMA descriptors in-kernel
# (about 2.4 us before its first load), so pointer loads win below ~2048^3 (512^3: 3.7 vs
# 6.0 us; 16x4096x4096: 14.6 vs 20.2 us) and TMA wins by 3-8% at 4096^3 and 8192^3.
_matmul = Kernel(
    matmul_kernel,
    tuned_flavours(MATMUL_CONFIGS + SPLIT_K_CONFIGS + PERSISTENT_CONFIGS) + WS_CONFIGS,
    key=["M_BUCKET", "N", "K", "LAYOUT", "TMA_MODE", "SCHEDULE", "PROGRAMS_KEY"],
    interpret_config=INTERPRET_CONFIG,
    prune=prune_flavours,
)


def _layout(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(a.stride(1) == 1) * 2 + int(b.stride(0) == 1)


def check_matmul_inputs(a, b, bias, activation, out_dtype):
    """The checks of the matmul contract, shared by every op that offers it (matmul,
    persistent_matmul). Returns (M, N, K, out_dtype)."""
    checks.check_tensor("a", a, ndim=2)
    checks.check_tensor("b", b, ndim=2)
    checks.check_operand_dtypes(a, b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is {tuple(b.shape)}: b must be [K, N] with K = {a.shape[1]}")
    checks.check_activation(activation)
    M, K = a.shape
    N = b.shape[1]
    checks.check_bias(bias, (N,))
    checks.check_same_device(a=a, b=b, bias=bias)
    return M, N, K, checks.resolve_out_dtype(out_dtype, a.dtype)


def launch_args(a, b, c, bias, activation, tma: bool | None):
    """(args, meta) for a kernel with matmul_kernel's parameters, the flavour resolved.

    args: the positional arguments (pointers, sizes, strides, autotune key values); meta: the
    constexprs that are not part of a config. ``tma``: see core.tma.choose_tma.
    """
    M, K = a.shape
    N = b.shape[1]
    args = (
        a, b, c, bias, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0,
        next_pow2_bucket(M), _layout(a, b),
    )
    meta = dict(
        ACTIVATION=activation,
        UPCAST=checks.upcast_flag(a.dtype),
        PRECISION=checks.dot_precision(a.dtype),
        **flavour_meta(choose_tma(tma, a, b, c)),
    )
    return args, meta


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
    ``persistent``: None lets the autotuner also try the persistent schedule with its big
    tiles (``auto_persistent``); False keeps one program per tile; True runs only the
    persistent schedule, as onegemm.persistent_matmul does. The interpreter runs one program
    per tile unless True. A ``config`` from ``best_config()`` carries the flavour and the
    schedule it was tuned with.
    """
    return run_matmul(a, b, bias, activation, out_dtype, config, tma, persistent)


def run_matmul(a, b, bias, activation, out_dtype, config, tma, persistent, programs=None):
    """matmul's body; ``programs``: the persistent grid size asked for (persistent_matmul's
    ``num_programs``; None: SM count x the config's PROGRAMS_PER_SM)."""
    M, N, K, out_dtype = check_matmul_inputs(a, b, bias, activation, out_dtype)
    schedule = schedule_mode(persistent)
    c = empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    args, meta = launch_args(a, b, c, bias, activation, tma)
    if config is not None and persistent is not None:
        config = with_meta(config, PERSISTENT=persistent)
    elif config is None and _matmul.tuned is None:
        meta["PERSISTENT"] = persistent is True  # the interpreter's one config, on the schedule asked for
    ws, locks = splitk.launch_buffers(_matmul, config, M, N, next_pow2_bucket(M), a.device)
    meta.update(SCHEDULE=schedule, PROGRAMS_KEY=programs or 0, ws_ptr=ws, lock_ptr=locks)
    launch_flavoured(_matmul, tile_grid(M, N, a.device, programs), config, tma, args, meta)
    return c


def linear(x, weight, bias=None, *, activation=None):
    """F.linear semantics with an optional fused activation: act(x @ weight.T + bias).

    x [..., K], weight [N, K] (nn.Linear layout; read through ``weight.t()``, no copy),
    bias [N]. The output has x's leading dims and x's dtype.
    """
    checks.check_tensor("x", x)
    checks.check_tensor("weight", weight, ndim=2)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension [..., K], got a 0-D tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has {x.shape[-1]} features (last dim) but weight is {tuple(weight.shape)}: "
            f"weight must be [out_features, {x.shape[-1]}]"
        )
    lead = x.shape[:-1]
    out_dtype = torch.bfloat16 if x.dtype in checks.FP8_DTYPES else x.dtype
    y = matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias=bias, activation=activation, out_dtype=out_dtype)
    return y.reshape(*lead, weight.shape[0])
