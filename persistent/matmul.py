"""onegemm.persistent_matmul: the core GEMM with SM-count persistent scheduling.

The launch-per-tile schedule starts one program per output tile and lets the hardware hand
tiles to SMs as they free up. A persistent schedule starts only as many programs as can run at
once (one per SM, or two for small tiles) and each walks the tile list itself:

    for tile in range(pid, num_tiles, num_programs):   # tiles pid, pid + P, pid + 2P, ...

so per-program setup (here: building the TMA descriptors) is paid once per SM instead of
once per tile, and there is no block-scheduling gap between tiles. Both schedules are one
kernel, core's matmul_kernel, whose PERSISTENT constexpr turns the unit loop on
(core/tiles.py ``program_units``; the grid is core/runtime.py ``tile_grid``). The tile body is
the same code either way, so comparing the two (bench/bench_persistent.py) measures
scheduling alone. A config with STREAM_K walks the same tiles stream-K style (core/tiles.py
``stream_k``): where the last wave would leave SMs idle, the tail tiles are shared out by
K blocks. onegemm.matmul takes the persistent schedule itself where its config says so
(``persistent=None``: the tuned table and core/configs.py ``matmul_heuristic`` choose it for
large outputs); this op runs only the persistent schedule, with a grid the caller may size.
"""

from __future__ import annotations

import triton

from ..core.matmul import DENSE, forced


def persistent_matmul(
    a, b, *, bias=None, activation=None, out_dtype=None, num_programs=None,
    config: triton.Config | None = None, tma=None,
):
    """The same result as onegemm.matmul, computed by at most ``num_programs`` programs.

    a [M, K], b [K, N], any strides; bias [N]; activation, out_dtype: as onegemm.matmul.
    num_programs: the grid size asked for; default, the GPU's SM count times the config's
        PROGRAMS_PER_SM (2 for the tuner's small-tile configs, else 1). The grid launched is
        min(num_programs, work units: tiles, times SPLIT_K for a split-K config): a program
        past the last unit would only build its descriptors and exit, so it is not started;
        a stream-K launch that shares tiles starts all num_programs. With no more units than
        programs, each program's walk is one unit: that launch runs launch-per-tile's kernel,
        the same schedule without the unit loop. Any value >= 1 gives the same result.
    config: force one triton.Config instead of the chosen one (benchmarks and tests); its kwargs
        may add SPLIT_K (core/splitk.py), PROGRAMS_PER_SM and STREAM_K (not with SPLIT_K),
        which the tuner also tries.
    tma: as onegemm.matmul: None lets the tuner choose pointer or tensor-descriptor (TMA)
        loads on a Hopper GPU when a, b and the output allow TMA; False forces pointer loads;
        True forces TMA or raises ValueError.
    """
    if config is None:
        return DENSE.call(a, b, bias, activation, out_dtype, tma, True, num_programs)
    return forced(a, b, bias, activation, out_dtype, config, tma, True, num_programs)
