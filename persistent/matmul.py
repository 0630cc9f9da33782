"""onegemm.persistent_matmul: the core GEMM with SM-count persistent scheduling.

The launch-per-tile kernel (core/matmul.py) starts one program per output tile and lets the
hardware hand tiles to SMs as they free up. A persistent kernel starts only as many programs
as can run at once (one per SM) and each walks the tile list itself:

    for tile in range(pid, num_tiles, num_programs):   # tiles pid, pid + P, pid + 2P, ...

so per-program setup (here: building the TMA descriptors) is paid once per SM instead of
once per tile, and there is no block-scheduling gap between tiles. The tile body is core's
``grouped_tile`` + ``gemm_tile``, the very code the launch-per-tile kernel runs, so comparing
the two (bench/bench_persistent.py) measures scheduling alone.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..core import splitk
from ..core.matmul import (
    INTERPRET_CONFIG, MATMUL_CONFIGS, SPLIT_K_CONFIGS, check_matmul_inputs, launch_args, prune_configs,
)
from ..core.runtime import Kernel, default_programs, empty, next_pow2_bucket
from ..core.tiles import gemm_tile, grouped_tile, make_operands


@triton.jit
def persistent_matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    M_BUCKET, LAYOUT, PROGRAMS_KEY,
    ws_ptr, lock_ptr,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, A_K_CONTIG: tl.constexpr, B_K_CONTIG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SPLIT: tl.constexpr = 1, FLATTEN: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, PROGRAMS_PER_SM: tl.constexpr = 1,
):
    """C = act(A @ B + bias), each program looping over work units pid, pid + P, ... (P
    programs); a unit is one output tile, or with SPLIT_K one K split of one.

    a_ptr [M, K], b_ptr [K, N], c_ptr [M, N]: element [i, j] at ptr + i*stride_x0 + j*stride_x1.
    bias_ptr [N] (stride_bias) or None.
    M_BUCKET, LAYOUT, PROGRAMS_KEY: autotune key only (next power of two of M; which operands
        are K-contiguous; the program count asked for), unused in the body.
    USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT: the TMA flavour (tiles.make_operands); its
        descriptors are built once per program, before the tile loop.
    FLATTEN: tl.range(flatten=True) merges the tile loop and the K loop into one software
        pipeline, so the next tile's loads overlap this tile's epilogue. Measured on the H200
        (bench/results/persistent.md): +3% at 4096^3, -9% at 8192^3, -21% on a 266-tile shape,
        so it is off in the autotuned configs (available through ``config=``).
    WARP_SPECIALIZE: core's warp-specialised K loop (tiles.mma_k_loop; TMA flavour only).
        Measured on the H200, bf16, forced (bench/diagnose_blockscaled.py bf16): 0.87-1.01x
        cuBLAS with it against 0.83-1.03x without, no consistent gain, so only ``config=``
        turns it on here (launch-per-tile matmul does tune it).
    SPLIT_K, ws_ptr, lock_ptr: split-K (core/splitk.py), as in core/matmul.py: unit u is split
        u % SPLIT_K of tile u // SPLIT_K, so a tile's splits are consecutive units and run on
        neighbouring programs of the same pass; the last to finish sums the partials
        (tiles.split_k_combine), and no program ever waits for another.
    PROGRAMS_PER_SM: read by the host only: the default grid is SM count x PROGRAMS_PER_SM
        (persistent_matmul's ``num_programs``), so two programs of a small tile can share an SM.
    Grid: (P,), P = min(programs asked for, tiles * SPLIT_K); the loop stride is the launched
        grid size, so it can never disagree with the grid.
    """
    a, b, c = make_operands(
        a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_K_CONTIG, B_K_CONTIG, EPI_SPLIT,
    )
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for unit in tl.range(tl.program_id(0), num_pid_m * num_pid_n * SPLIT_K, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(unit // SPLIT_K, num_pid_m, num_pid_n, GROUP_M)
        gemm_tile(
            pid_m, pid_n, a, b, c, bias_ptr, M, N, K,
            stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
            ACTIVATION, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            USE_TMA=USE_TMA, A_K_CONTIG=A_K_CONTIG, B_K_CONTIG=B_K_CONTIG, EPI_SPLIT=EPI_SPLIT,
            WARP_SPECIALIZE=WARP_SPECIALIZE,
            split=unit % SPLIT_K, SPLIT_K=SPLIT_K, ws_ptr=ws_ptr, lock_ptr=lock_ptr,
        )


def two_per_sm(configs: list[triton.Config]) -> list[triton.Config]:
    """The 64 x (64 or 128) tiles of ``configs`` again, with two programs per SM by default."""
    return [
        triton.Config({**c.kwargs, "PROGRAMS_PER_SM": 2}, num_warps=c.num_warps, num_stages=c.num_stages)
        for c in configs
        if c.kwargs["BLOCK_M"] == 64 and c.kwargs["BLOCK_N"] <= 128
    ]


# The launch-per-tile kernel's configs, split-K ones included, and its pruning: both schedulers
# choose among the same tiles, so the benchmark's ratio is scheduling, not a different tile
# shape. (Without the split configs, launch-per-tile split K on 5 small-M shapes of
# bench_persistent's sweep and persistence lost there: 0.97x over the sweep against 1.04x on
# the other 16 shapes; bench/results/persistent.md.)
# Plus the small tiles at two programs per SM: launch-per-tile keeps several 64-row programs
# resident on an SM, each hiding the others' load latency, and one persistent program per SM
# ran at 0.77-0.87x of it at M = 256 (bench/results/persistent.md). Their pipelines need 64-98
# KB of shared memory (stages x (BLOCK_M + BLOCK_N) x BLOCK_K x itemsize), so two fit in the
# H200's 227 KB; 64x256 (160 KB) does not.
PERSISTENT_CONFIGS = MATMUL_CONFIGS + SPLIT_K_CONFIGS + two_per_sm(MATMUL_CONFIGS + SPLIT_K_CONFIGS)
_persistent = Kernel(
    persistent_matmul_kernel,
    PERSISTENT_CONFIGS,
    key=["M_BUCKET", "N", "K", "LAYOUT", "PROGRAMS_KEY", "USE_TMA"],
    interpret_config=INTERPRET_CONFIG,
    prune=prune_configs,
)


def persistent_matmul(
    a, b, *, bias=None, activation=None, out_dtype=None, num_programs=None,
    config: triton.Config | None = None, tma=None,
):
    """The same result as onegemm.matmul, computed by at most ``num_programs`` programs.

    a [M, K], b [K, N], any strides; bias [N]; activation, out_dtype: as onegemm.matmul.
    num_programs: the grid size asked for; default, the GPU's SM count times the config's
        PROGRAMS_PER_SM (2 for the tuner's small-tile configs, else 1). The grid launched is
        min(num_programs, work units: tiles, times SPLIT_K for a split-K config): a program
        past the last unit would only build its descriptors and exit, so it is not started.
        Any value >= 1 gives the same result.
    config: force one triton.Config instead of autotuning (benchmarks and tests); its kwargs
        may add EPI_SPLIT (1 or 2) and FLATTEN (bool), the options the benchmark sweeps, and
        SPLIT_K (core/splitk.py) and PROGRAMS_PER_SM, which the tuner also tries.
    tma: None picks tensor-descriptor (TMA) loads on a Hopper GPU when a, b and the output
        allow it; False forces pointer loads; True forces TMA or raises ValueError.
    """
    M, N, K, out_dtype = check_matmul_inputs(a, b, bias, activation, out_dtype)
    per_sm = num_programs is None  # the default grid follows the config's PROGRAMS_PER_SM
    if num_programs is None:
        num_programs = default_programs(a.device)
    elif isinstance(num_programs, bool) or not isinstance(num_programs, int):
        raise TypeError(f"num_programs must be an int >= 1 or None, got {type(num_programs).__name__}")
    elif num_programs < 1:
        raise ValueError(f"num_programs must be >= 1 (the number of programs to launch), got {num_programs}")

    c = empty((M, N), device=a.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c

    def grid(meta):
        programs = num_programs * (meta.get("PROGRAMS_PER_SM", 1) if per_sm else 1)
        return (min(programs, splitk.units(meta, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]))),)

    args, meta = launch_args(a, b, c, bias, activation, tma)
    args = args + (num_programs,)  # PROGRAMS_KEY, after matmul_kernel's M_BUCKET and LAYOUT
    ws, locks = splitk.launch_buffers(_persistent, config, M, N, next_pow2_bucket(M), a.device)
    _persistent.launch(grid, config, *args, ws_ptr=ws, lock_ptr=locks, **meta)
    return c
