"""Where onegemm's kernels run, and how they are launched.

Two facts shape every launch in the project:

* Without a GPU, kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
  ``onegemm/__init__.py`` before any kernel is defined). The interpreter cannot autotune
  ("0 active drivers") and timing there means nothing, so a kernel runs with ONE fixed small
  config. It also stores bfloat16 as raw uint16, so bf16 tiles must be upcast before arithmetic
  (``UPCAST``; see DESIGN.md).
* On a GPU, kernels are autotuned. The grid is always a lambda of the chosen config's meta
  parameters: a grid built from a fixed BLOCK_M would leave tiles unwritten whenever the tuner
  picks another block size (the seed lesson's first pitfall; ``tests/test_core.py`` guards it).

``Kernel`` is the one place that chooses between the two.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET: bool = bool(triton.knobs.runtime.interpret)

# Debug switch: fill every output onegemm allocates with NaN (or -1 for integers) before the
# kernel runs, so a tile the kernel forgot to write shows as NaN instead of stale memory that
# happens to be right (fresh pages are often zero). The test suite turns it on.
POISON: bool = os.environ.get("ONEGEMM_POISON", "0") == "1"

# Test switch: ONEGEMM_TUNE_MS=<ms> times each autotune candidate for that many milliseconds
# instead of Triton's default 25 ms warmup + 100 ms of repetitions. The GPU test suite sets it:
# it autotunes hundreds of distinct shapes, and what it checks is that every config the tuner
# may pick computes the right answer, not which one is fastest. Results tuned this way are
# not cached on disk, so a benchmark run later on the same machine tunes for real.
TUNE_MS: float | None = float(os.environ["ONEGEMM_TUNE_MS"]) if os.environ.get("ONEGEMM_TUNE_MS") else None


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty for kernel outputs; NaN-poisoned when ``POISON`` is set."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def next_pow2_bucket(n: int, cap: int = 8192) -> int:
    """Autotune key for a token-count dimension: next power of two, capped.

    MoE and decode calls see a new M on every step; keying the tuner on the exact M would
    re-benchmark every config each time. Tiles that suit M=3000 suit M=4096 too.
    """
    return min(triton.next_power_of_2(max(int(n), 1)), cap)


def _quick_bench(fn, quantiles):
    from triton.testing import do_bench

    return do_bench(fn, warmup=1, rep=TUNE_MS, quantiles=quantiles)


def graph_bench(fn, warmup: float = 25, rep: float = 100, quantiles=None, return_mode: str = "mean"):
    """GPU time of ``fn()``: captured once in a CUDA graph, replays timed by
    triton.testing.do_bench (CUDA events, L2 flushed between replays).

    Timing eager calls measures the host instead whenever a kernel is shorter than its launch:
    a Triton launch costs 60-90 us of Python (bench/diagnose_matmul.py, H200), more than a
    decode-sized GEMM's GPU time, so every config of such a call times alike and the tuner's
    pick is noise (1024^3 fp8: 124 against 166 TFLOP/s between two runs). The autotuner
    (``Kernel``) and the benchmarks (bench/common.py) both time this way, so a tuned config is
    the fastest in the measure the results report. ``fn`` runs once uncaptured first (compile
    errors surface there, as the tuner expects); one that cannot be captured is timed eagerly.
    """
    from triton.testing import do_bench

    fn()  # compile, and let the autotuner see OutOfResources before any capture
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # the graph pool's allocations (e.g. TMA descriptor scratch) on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - an uncapturable fn (host sync): time it eagerly, say so
        print(f"[graph_bench] CUDA graph capture failed ({type(e).__name__}: {str(e)[:80]}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return do_bench(fn, warmup=warmup, rep=rep, quantiles=quantiles, return_mode=return_mode)
    return do_bench(graph.replay, warmup=warmup, rep=rep, quantiles=quantiles, return_mode=return_mode)


class Kernel:
    """A ``@triton.jit`` kernel plus its autotune configs, launched one of two ways.

    ``kernel[grid](*args, **kwargs)`` autotunes on a GPU (configs pruned by ``prune``, each
    timed in GPU time by ``graph_bench``, the result cached on disk, keyed by ``key``) and uses
    ``interpret_config`` under the interpreter. ``kernel.run(grid, config, ...)`` forces one config: benchmarks use it to
    compare GROUP_M=1 with GROUP_M=8, and tests use it to run several block sizes.

    ``prune(configs, args) -> configs`` sees every argument of the call by name in ``args``
    (Triton itself splits them: positional ones in one dict, keyword ones in **kwargs).
    """

    def __init__(self, fn, configs, key, interpret_config: triton.Config, prune=None):
        self.fn = fn
        self.configs = configs
        self.interpret_config = interpret_config
        self.prune = prune
        self.tuned = None
        if not INTERPRET:
            self.tuned = triton.autotune(
                configs=configs,
                key=key,
                prune_configs_by={"early_config_prune": self._pruned} if prune else None,
                do_bench=_quick_bench if TUNE_MS else graph_bench,
                cache_results=TUNE_MS is None,
            )(fn)

    def _pruned(self, configs, named_args, **kwargs):
        kept = self.prune(configs, {**named_args, **kwargs})
        if not kept:
            raise RuntimeError(f"{self.fn.__name__}: the pruner kept no config for this call")
        return kept

    def __getitem__(self, grid):
        if self.tuned is not None:
            return self.tuned[grid]
        return functools.partial(self._interpret, grid)

    def _interpret(self, grid, *args, **kwargs):
        # Pruners run only when tuning on a GPU; running this one here too (its answer unused)
        # makes the CPU tests catch a pruner that cannot read the call's arguments, as one
        # reading a keyword constexpr from the positional ones once did, on the H200 only.
        if self.prune is not None:
            self._pruned(self.configs, dict(zip(self.fn.arg_names, args)), **kwargs)
        return self.run(grid, self.interpret_config, *args, **kwargs)

    def run(self, grid, config: triton.Config, *args, **kwargs):
        return self.fn[grid](
            *args,
            **kwargs,
            **config.kwargs,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    def launch(self, grid, config, *args, **kwargs):
        """Autotune (``config`` None) or run the given config: what every public op does."""
        if config is None:
            return self[grid](*args, **kwargs)
        return self.run(grid, config, *args, **kwargs)

    def best_config(self):
        """The config the tuner chose on its last call (None under the interpreter)."""
        return None if self.tuned is None else self.tuned.best_config


def with_meta(cfg: triton.Config, **kwargs) -> triton.Config:
    """``cfg`` with ``kwargs`` added to (or replacing) its constexprs."""
    return triton.Config({**cfg.kwargs, **kwargs}, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Programs a persistent kernel starts under the interpreter: a few, so each program's tile loop
# runs more than once (what the persistent schedule is about) at a CPU-friendly cost.
INTERPRET_PROGRAMS = 4


def default_programs(device: torch.device) -> int:
    """The grid size of a persistent kernel: one program per SM on a GPU (all resident at
    once, each walking tiles pid, pid + P, ...); INTERPRET_PROGRAMS on the interpreter."""
    if INTERPRET:
        return INTERPRET_PROGRAMS
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def tile_grid(M: int, N: int, device: torch.device, programs: int | None = None):
    """The grid function of a kernel on core's schedules (tiles.program_units), [M, N] output.

    A config's work units are its output tiles, times SPLIT_K. Launch-per-tile: one program
    per unit. PERSISTENT: min(P, units) programs, where P is ``programs`` when given, else
    ``default_programs`` times the config's PROGRAMS_PER_SM (read by the host only). A program
    past the last unit would only build its descriptors and exit, so it is not started.
    """
    def grid(meta):
        units = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]) * meta.get("SPLIT_K", 1)
        if not meta.get("PERSISTENT"):
            return (units,)
        p = programs if programs is not None else default_programs(device) * meta.get("PROGRAMS_PER_SM", 1)
        return (min(p, units),)

    return grid
