"""Where onegemm's kernels run: the interpreter switch, output allocation, grids, GPU timing.

Without a GPU, kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``onegemm/__init__.py`` before any kernel is defined). The interpreter cannot autotune and
timing there means nothing, so each kernel family runs one small config (core/configs.py); it
also stores bfloat16 as raw uint16, so bf16 tiles are upcast before arithmetic (``UPCAST``;
docs/interpreter.md). Launches go through core/launch.py either way.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET: bool = bool(triton.knobs.runtime.interpret)

# Debug switch, read once at import: fill every output onegemm allocates with NaN (or -1 for
# integers) before the kernel runs, so a tile the kernel forgot to write shows as NaN instead
# of stale memory that happens to be right (fresh pages are often zero). The test suite sets
# ONEGEMM_POISON=1 before importing onegemm; without it ``empty`` is torch.empty itself.
POISON: bool = os.environ.get("ONEGEMM_POISON", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints on the host (triton.cdiv goes through Triton's constexpr wrapper,
    which a launch's host path cannot afford several times)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1), on the host (triton.next_power_of_2 is slower)."""
    return 1 << (max(n, 1) - 1).bit_length()


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def interpretable(t):
    """``t`` as a kernel operand may be read under Triton's interpreter: an fp8 tensor becomes
    an fp16 copy with the same strides (exact: fp16 holds every e4m3 and e5m2 value), because
    the interpreter reads an e4m3fn NaN as +-480 and e5m2 subnormals below 2^-14 as zero. On a
    GPU, and for other dtypes, ``t`` itself."""
    if not INTERPRET or t is None or t.dtype not in _FP8:
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=torch.float16, device=t.device)
    out.copy_(t)
    return out


def _poisoned_empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan") if out.is_floating_point() else -1)


def _poisoned_empty_strided(shape, stride, *, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return out.fill_(float("nan") if out.is_floating_point() else -1)


# empty(shape, *, dtype, device): torch.empty for kernel outputs, NaN-poisoned under POISON.
empty = _poisoned_empty if POISON else torch.empty
# empty_strided(shape, stride, *, dtype, device): the same with the strides given, what a
# record's hot path allocates with (cheaper on the host than torch.empty: bench/results/overhead.md).
empty_strided = _poisoned_empty_strided if POISON else torch.empty_strided


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def product_like(like: torch.Tensor, mm, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """mm(x, y) (a matmul-like op: x @ y over the last two dims) laid out like ``like``, the
    tensor it is the gradient of. Autograd copies a gradient whose strides differ from its
    input's (a weight passed as W.t() gets a contiguous W^T-shaped gradient: a transposing
    copy of the whole weight), so for a column-major ``like`` it is computed as (y^T x^T)^T."""
    if like.dim() >= 2 and like.stride(-2) == 1 and like.stride(-1) != 1 and min(like.shape[-2:]) > 1:
        return mm(y.transpose(-2, -1), x.transpose(-2, -1)).transpose(-2, -1)
    return mm(x, y)


def graph_bench(fn, warmup: float = 25, rep: float = 100, quantiles=None, return_mode: str = "mean"):
    """GPU time of ``fn()``: captured once in a CUDA graph, replays timed by
    triton.testing.do_bench (CUDA events, L2 flushed between replays).

    Timing eager calls measures the host instead whenever a kernel is shorter than its
    launch, so autotuning (core/launch.py) and the benchmarks time this way. ``fn`` runs once
    uncaptured first (compile errors surface there); one that cannot be captured is timed
    eagerly, and graph_bench says so.
    """
    from triton.testing import do_bench

    fn()
    # A capture that fails (fn syncs with the host) leaves the CUDA generator marked as
    # capturing, and every later random op on the device raises; a clone of its state taken
    # before puts it back.
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    saved = generator.clone_state()
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
        generator.graphsafe_set_state(saved)
        print(f"[graph_bench] CUDA graph capture failed ({type(e).__name__}: {str(e)[:80]}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return do_bench(fn, warmup=warmup, rep=rep, quantiles=quantiles, return_mode=return_mode)
    return do_bench(graph.replay, warmup=warmup, rep=rep, quantiles=quantiles, return_mode=return_mode)


@functools.cache
def capability(device_index: int | None) -> tuple:
    """The GPU's compute capability, e.g. (9, 0) for Hopper (the one probe TMA's and the Gluon
    body's rules read)."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def sm_count(device_index: int | None) -> int:
    if INTERPRET or device_index is None:
        return INTERPRET_PROGRAMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Programs a persistent kernel starts under the interpreter: a few, so each program's tile loop
# runs more than once (what the persistent schedule is about) at a CPU-friendly cost.
INTERPRET_PROGRAMS = 4


def default_programs(device_index: int | None) -> int:
    """The grid size of a persistent kernel: one program per SM on a GPU (all resident at
    once, each walking tiles pid, pid + P, ...); INTERPRET_PROGRAMS on the interpreter."""
    return INTERPRET_PROGRAMS if INTERPRET else sm_count(device_index)


def tile_grid(M: int, N: int, meta: dict, device_index: int | None, programs: int | None = None) -> tuple:
    """The grid of a kernel on core's schedules (tiles.program_units) for an [M, N] output.

    ``meta``: the plan's constexprs. Work units are output tiles, times SPLIT_K.
    Launch-per-tile: one program per unit. PERSISTENT: min(P, units) programs, where P is
    ``programs`` when given, else ``default_programs`` times PROGRAMS_PER_SM. A program past
    the last unit would only build its descriptors and exit, so it is not started. STREAM_K:
    all P programs, which share the shared tiles' K blocks (tiles.stream_k).
    """
    units = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]) * meta.get("SPLIT_K", 1)
    if not meta.get("PERSISTENT"):
        return (units,)
    p = programs or default_programs(device_index) * meta.get("PROGRAMS_PER_SM", 1)
    if meta.get("STREAM_K"):  # its programs share K blocks too: all P start
        return (p,)
    return (min(p, units),)
