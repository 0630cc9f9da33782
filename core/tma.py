"""Host side of the TMA flavour: which operands may use tensor descriptors, and their allocator.

The kernels build their tensor descriptors in-kernel (``tl.make_tensor_descriptor``, see
``tiles.make_operands``): the block shape then comes from the autotuned config's constexprs,
with no host descriptor to rebuild per config (a host ``TensorDescriptor`` needs a config
pre_hook, and Triton's autotuner does not cache results to disk for configs with pre_hooks).
In-kernel descriptors live in a small global scratch buffer that Triton asks
``triton.set_allocator``'s allocator for at launch. That allocator is a ContextVar, so a new
thread starts without one: ``ensure_allocator`` is called on every launch that may use TMA.

TMA (Hopper's Tensor Memory Accelerator) copies a box of a 2-D tensor whose last dimension is
contiguous; the base address and every other stride must be multiples of 16 bytes. A view that
breaks this (a row slice at an odd element offset, a view strided in both dimensions, a
row length that is not a multiple of 16 bytes) runs the pointer flavour instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from .runtime import INTERPRET, with_meta

_ALIGN = 16  # bytes: TMA's requirement on the base address and on every non-unit stride


class TmaLayout(NamedTuple):
    """How the TMA flavour reads A [M, K] and B [K, N] (the kernels' constexprs).

    a_k_contig: A's K stride is 1, so the descriptor covers A as [M, K]; otherwise it covers
        A's transpose as [K, M] (A is a ``.t()`` view) and the kernel transposes each tile.
    b_k_contig: B's K stride is 1 (B = W.t() of an [N, K] weight), so the descriptor covers
        W as [N, K], the K-major layout Hopper's fp8 MMA wants; otherwise B as [K, N].
    """

    a_k_contig: bool
    b_k_contig: bool


def _aligned(t: torch.Tensor, stride: int) -> bool:
    return t.data_ptr() % _ALIGN == 0 and (stride * t.element_size()) % _ALIGN == 0


def descriptor_orientation(t: torch.Tensor) -> int | None:
    """Which dimension of the 2-D tensor ``t`` a descriptor can treat as contiguous.

    1: row-major (stride(1) == 1), 0: column-major (stride(0) == 1), None: neither is
    TMA-eligible. The other stride and the base address must be 16-byte aligned.
    """
    if t.stride(1) == 1 and _aligned(t, t.stride(0)):
        return 1
    if t.stride(0) == 1 and _aligned(t, t.stride(1)):
        return 0
    return None


def tma_layout(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> TmaLayout | None:
    """The TMA flavour's layout for C = A @ B, or None when any operand must use pointers.

    C is written through a row-major descriptor, so it needs stride(1) == 1 as well.
    """
    oa, ob = descriptor_orientation(a), descriptor_orientation(b)
    if oa is None or ob is None or c.stride(1) != 1 or not _aligned(c, c.stride(0)):
        return None
    return TmaLayout(a_k_contig=oa == 1, b_k_contig=ob == 0)


def tma_hardware(device: torch.device) -> bool:
    """Whether ``device`` runs tensor descriptors: Hopper (sm_90) or newer on a GPU.

    Triton's interpreter runs them too (on CPU tensors), which lets CPU tests check the flavour.
    """
    if INTERPRET:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def choose_tma(tma: bool | None, a, b, c) -> TmaLayout | None:
    """Resolve a public op's ``tma`` argument to a layout (TMA flavour) or None (pointers).

    tma=None: automatic, TMA on a Hopper GPU when every operand allows it (the interpreter
        defaults to pointers: that is the flavour CPU users run).
    tma=False: always pointers. tma=True: TMA, or a ValueError saying which operand prevents it
        (benchmarks use it, so they measure the flavour they name).
    """
    if tma not in (None, True, False):
        raise TypeError(f"tma must be None (automatic), True or False, got {tma!r}")
    if tma is False or (tma is None and INTERPRET):
        return None
    if a.numel() == 0 or b.numel() == 0:
        return None  # K == 0: nothing to load (and TMA boxes need every dimension >= 1)
    layout = tma_layout(a, b, c) if tma_hardware(a.device) else None
    if tma is None or layout is not None:
        return layout
    if not tma_hardware(a.device):
        raise ValueError(f"tma=True needs a Hopper (sm_90) or newer GPU, got {a.device}")
    for name, t in (("a", a), ("b", b)):
        if descriptor_orientation(t) is None:
            raise ValueError(
                f"tma=True but {name} (shape {tuple(t.shape)}, strides {t.stride()}, "
                f"data_ptr % 16 = {t.data_ptr() % 16}) has no unit stride with 16-byte aligned "
                f"base and other stride; pass tma=None to fall back to pointer loads"
            )
    raise ValueError(
        f"tma=True but the output [M, N] = {tuple(c.shape)} rows are not a multiple of 16 bytes; "
        f"pass tma=None to fall back to pointer loads"
    )


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    # Descriptors are 128-byte records the kernel writes and the TMA unit reads; torch's
    # caching allocator returns 256-byte aligned blocks, above any alignment Triton asks for.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give this thread (this context) the scratch allocator in-kernel descriptors need.

    ``triton.set_allocator`` stores the allocator in a ContextVar: it is per thread, and a new
    ``threading.Thread`` starts without one ("Kernel requires a runtime memory allocation").
    An allocator the user set is kept; only the missing one is filled in.
    """
    if INTERPRET:
        return  # the interpreter builds descriptors in Python, with no scratch memory
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_alloc)


def flavour_meta(layout: TmaLayout | None) -> dict:
    """The flavour constexprs every kernel built on core's helpers takes, for ``layout``
    (None: pointer loads). Sets this thread's descriptor allocator when TMA is on."""
    if layout is not None:
        ensure_allocator()
    return dict(
        USE_TMA=layout is not None,
        A_K_CONTIG=layout is None or layout.a_k_contig,
        B_K_CONTIG=layout is None or layout.b_k_contig,
    )


# Tuning the flavour. Whether TMA pays depends on the shape: each program builds its
# descriptors in-kernel (about 2.4 us on the H200 before its first load), which pointer loads
# skip. A kernel that lets the tuner choose takes USE_TMA from its configs (``tuned_flavours``
# doubles a config list) and a TMA_MODE argument in its autotune key saying which flavours
# this call allows (``keep_flavours`` prunes to them); ``launch_flavoured`` launches it.
POINTERS_ONLY, TMA_ONLY, EITHER = 0, 1, 2


def tuned_flavours(configs: list[triton.Config]) -> list[triton.Config]:
    """Each config twice: with pointer loads (USE_TMA False) and with TMA (True)."""
    return [
        with_meta(c, USE_TMA=t)
        for c in configs
        for t in (False, True)
    ]


def warp_specialized(cfg: triton.Config, **extra) -> triton.Config:
    """``cfg`` with core's warp-specialised K loop on (tiles.mma_k_loop WARP_SPECIALIZE, which
    only the TMA flavour honours); ``extra`` adds constexprs, e.g. USE_TMA=True for a kernel
    whose tuner picks the flavour."""
    return with_meta(cfg, WARP_SPECIALIZE=True, **extra)


def keep_flavours(configs, args):
    """The configs whose flavour the call's TMA_MODE allows (a pruner step)."""
    mode = args["TMA_MODE"]
    if mode == EITHER:
        return configs
    return [c for c in configs if c.kwargs["USE_TMA"] == (mode == TMA_ONLY)]


def launch_flavoured(kernel, grid, config, tma, args, meta) -> None:
    """Launch a ``Kernel`` whose configs carry USE_TMA (see above).

    meta: the call's constexprs, with ``flavour_meta``'s USE_TMA saying whether the operands
    allow TMA. tma=None lets the tuner choose among the flavours allowed; True / False pin
    one. A forced ``config`` may name its flavour (one taken from ``best_config()`` does).
    """
    eligible = meta.pop("USE_TMA")
    if config is None:
        mode = EITHER if tma is None and eligible else (TMA_ONLY if eligible else POINTERS_ONLY)
        if kernel.tuned is None:  # interpreter: one fixed config, the flavour choose_tma gave
            meta["USE_TMA"] = eligible
        kernel[grid](*args, TMA_MODE=mode, **meta)
        return
    if "USE_TMA" in config.kwargs:
        if config.kwargs["USE_TMA"] and not eligible:
            raise ValueError("config has USE_TMA=True but these operands cannot use TMA (see core/tma.py)")
        eligible = config.kwargs["USE_TMA"]
        config = triton.Config({k: v for k, v in config.kwargs.items() if k != "USE_TMA"},
                               num_warps=config.num_warps, num_stages=config.num_stages)
    kernel.run(grid, config, *args, TMA_MODE=int(eligible), USE_TMA=eligible, **meta)
