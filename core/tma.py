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

from . import checks
from .configs import with_meta
from .runtime import INTERPRET, capability
from .triton_abi import ensure_allocator  # noqa: F401 - where the allocator is given (Triton internals)

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


def descriptor_orientation(t: torch.Tensor, strides=None) -> int | None:
    """Which dimension of the 2-D tensor ``t`` a descriptor can treat as contiguous.

    1: row-major (stride(1) == 1), 0: column-major (stride(0) == 1), None: neither is
    TMA-eligible. The other stride and the base address must be 16-byte aligned.
    ``strides``: the two strides to judge instead of t's own (a grouped kernel's per-group
    matrix inside a 3-D tensor starts at t's data pointer).
    """
    if t.data_ptr() % _ALIGN:
        return None
    s0, s1 = strides if strides is not None else t.stride()
    if s1 == 1 and (s0 * t.element_size()) % _ALIGN == 0:
        return 1
    if s0 == 1 and (s1 * t.element_size()) % _ALIGN == 0:
        return 0
    return None


_LAYOUTS = {(a, b): TmaLayout(a, b) for a in (False, True) for b in (False, True)}


def tma_layout(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, strides=(None, None, None)) -> TmaLayout | None:
    """The TMA flavour's layout for C = A @ B, or None when any operand must use pointers.

    C is written through a row-major descriptor, so it needs stride(1) == 1 as well.
    ``strides``: per operand, the 2-D strides to judge (see descriptor_orientation), or None.
    """
    oa = descriptor_orientation(a, strides[0])
    if oa is None:
        return None
    ob = descriptor_orientation(b, strides[1])
    if ob is None or descriptor_orientation(c, strides[2]) != 1:
        return None
    return _LAYOUTS[oa == 1, ob == 0]


def tma_hardware(device: torch.device) -> bool:
    """Whether ``device`` runs tensor descriptors: Hopper (sm_90) or newer on a GPU.

    Triton's interpreter runs them too (on CPU tensors), which lets CPU tests check the flavour.
    """
    if INTERPRET:
        return True
    return device.type == "cuda" and _hopper(device.index)


def _hopper(index: int) -> bool:
    return capability(index)[0] >= 9


def choose_tma(tma: bool | None, a, b, c, strides=(None, None, None)) -> TmaLayout | None:
    """Resolve a public op's ``tma`` argument to a layout (TMA flavour) or None (pointers).

    tma=None: automatic, TMA on a Hopper GPU when every operand allows it and C is not fp32
        beside 16- or 8-bit inputs (the interpreter defaults to pointers: that is the flavour
        CPU users run).
    tma=False: always pointers. tma=True: TMA, or a ValueError saying which operand prevents it
        (benchmarks use it, so they measure the flavour they name).
    """
    if tma is None:
        if INTERPRET or not a.is_cuda or not _hopper(a.get_device()) or a.numel() == 0 or b.numel() == 0:
            return None
        if c.element_size() == 4 and a.element_size() < 4:
            return None  # the TMA store's fp32 C tile does not fit in shared memory beside a 16/8-bit pipeline
        return tma_layout(a, b, c, strides)
    checks.check_tma(tma)
    if tma is False:
        return None
    if a.numel() == 0 or b.numel() == 0:
        return None  # K == 0: nothing to load (and TMA boxes need every dimension >= 1)
    layout = tma_layout(a, b, c, strides) if tma_hardware(a.device) else None
    if tma is None or layout is not None:
        return layout
    if not tma_hardware(a.device):
        raise no_tma(f"TMA needs a Hopper (sm_90) or newer GPU, the operands are on {a.device}")
    for name, t, st in (("a", a, strides[0]), ("b", b, strides[1])):
        if descriptor_orientation(t, st) is None:
            raise no_tma(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}, data_ptr % 16 = {t.data_ptr() % 16}) "
                         f"has no unit stride with a 16-byte aligned base and other stride")
    raise no_tma(f"the output's rows ([M, N] = {tuple(c.shape)}) are not a multiple of 16 bytes")


def no_tma(why: str) -> ValueError:
    """tma=True on operands TMA cannot read."""
    return checks.bad_value("tma", "None (automatic) or False for these operands", "True",
                            why + "; tma=None falls back to pointer loads")


def layout_meta(layout: TmaLayout | None) -> dict:
    """The layout constexprs of core's TMA flavour for ``layout`` (None: pointer loads, for
    which they are unused); USE_TMA itself is a config's (core/configs.py), defaulting to
    whether the operands allow TMA."""
    return dict(
        USE_TMA=layout is not None,
        A_K_CONTIG=layout is None or layout.a_k_contig,
        B_K_CONTIG=layout is None or layout.b_k_contig,
    )


def forced_flavour(config, layout: TmaLayout | None):
    """A forced config's load flavour: the one it names (TMA only where the operands allow it),
    else TMA exactly when ``layout`` (what ``choose_tma`` resolved) says so."""
    if config is None:
        return None
    if "USE_TMA" not in config.kwargs:
        return with_meta(config, USE_TMA=layout is not None)
    if config.kwargs["USE_TMA"] and layout is None:
        raise checks.bad_value("config", "free of USE_TMA=True where TMA is off (tma=False, or operands "
                               "TMA cannot read: core/tma.py)", "USE_TMA=True")
    return config
