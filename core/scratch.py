"""Scratch memory for launches, cached per device and stream.

Some launches need device memory of their own beyond their inputs and output: split-K's
fp32 workspace and tile counters (core/splitk.py), and the global scratch where a TMA kernel
builds its tensor descriptors. Allocating it per call costs a torch.empty (and a memset for
counters) on every launch, so it is kept per (device, stream, kind) and grown when a launch
needs more. Launches on one stream run in order, so they can share a buffer; two streams never
do, so kernels in flight on different streams cannot meet in one. A launch during CUDA-graph
capture gets memory of its own from the graph's pool, so a graph never holds memory that
eager calls reuse.
"""

from __future__ import annotations

import threading

import torch

_held: dict = {}
_lock = threading.Lock()


def get(device: torch.device, kind: str, numel: int, dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
    """A buffer of at least ``numel`` elements of ``dtype`` for one launch on the device's
    current stream. ``zeroed``: all zero when first allocated (the kernel must leave it so)."""
    make = torch.zeros if zeroed else torch.empty
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return make(numel, dtype=dtype, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, torch._C._cuda_getCurrentRawStream(index), kind)
    else:
        key = (None, 0, kind)  # the interpreter runs one launch at a time
    buf = _held.get(key)
    if buf is None or buf.numel() < numel:
        with _lock:
            buf = _held.get(key)
            if buf is None or buf.numel() < numel:
                # At least twice the old size, so a slowly growing M re-allocates rarely.
                buf = make(max(numel, 2 * buf.numel() if buf is not None else 0), dtype=dtype, device=device)
                _held[key] = buf
    return buf


def clear() -> None:
    """Drop the cached buffers, giving their memory back (launch.reset calls it)."""
    with _lock:
        _held.clear()
