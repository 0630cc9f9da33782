"""Split-K, host side: the workspace and tile counters a split launch needs.

A config with SPLIT_K = S deals each output tile's K blocks into S ranges and launches one
program per (tile, range): S times the programs, each 1/S of the K loop, for GEMMs whose
tiles alone leave most SMs idle (decode-sized M against a wide weight). The partial sums meet
in an fp32 workspace; the last program of a tile to finish adds them in split order and runs
the epilogue (core/tiles.py ``split_k_combine``). When to split is core/configs.py's call.

The buffers are cached per device and stream, grown when a launch needs more, and the counters
are zeroed once, when allocated: every launch leaves them at zero. Two streams never share a
buffer, so kernels in flight on different streams cannot meet in one; launches on one stream
run in order, so they can. A launch during CUDA-graph capture gets buffers of its own from the
graph's memory pool (the memset that zeroes its counters is captured with it), so a graph never
holds memory that eager calls reuse.
"""

from __future__ import annotations

import threading

import torch

_buffers: dict = {}
_lock = threading.Lock()


def buffers(device: torch.device, workspace: int, counters: int):
    """(fp32 workspace of >= ``workspace`` elements, int32 zeroed counters >= ``counters``)
    for one launch on the device's current stream."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return (torch.empty(workspace, dtype=torch.float32, device=device),
                    torch.zeros(counters, dtype=torch.int32, device=device))
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (None, 0)  # the interpreter runs one launch at a time
    held = _buffers.get(key)
    if held is None or held[0].numel() < workspace or held[1].numel() < counters:
        with _lock:
            held = _buffers.get(key)
            if held is None or held[0].numel() < workspace or held[1].numel() < counters:
                old_ws, old_counters = held if held is not None else (None, None)
                # Grown to at least twice the old size, so a slowly growing M re-allocates rarely.
                ws_size = max(workspace, 2 * old_ws.numel() if old_ws is not None else 0)
                n_counters = max(counters, 2 * old_counters.numel() if old_counters is not None else 0)
                held = (torch.empty(ws_size, dtype=torch.float32, device=device),
                        torch.zeros(n_counters, dtype=torch.int32, device=device))
                _buffers[key] = held
    return held


def clear() -> None:
    """Drop the cached buffers (tests; to give the memory back)."""
    with _lock:
        _buffers.clear()
