"""Split-K, host side: the workspace and tile counters a split launch needs.

A config with SPLIT_K = S deals each output tile's K blocks into S ranges and launches one
program per (tile, range): S times the programs, each 1/S of the K loop, for GEMMs whose
tiles alone leave most SMs idle (decode-sized M against a wide weight). The partial sums meet
in an fp32 workspace; the last program of a tile to finish adds them in split order and runs
the epilogue (core/tiles.py ``split_k_combine``). When to split is core/configs.py's call.

The buffers come from core/scratch.py (cached per device and stream, grown when needed); the
counters are zeroed once, when allocated: every launch leaves them at zero.
"""

from __future__ import annotations

import torch

from . import scratch
from .runtime import cdiv


def buffers(device: torch.device, workspace: int, counters: int):
    """(fp32 workspace of >= ``workspace`` elements, int32 zeroed counters >= ``counters``)
    for one launch on the device's current stream."""
    return (scratch.get(device, "split_k_workspace", workspace, torch.float32),
            scratch.get(device, "split_k_counters", counters, torch.int32, zeroed=True))


def for_plan(meta: dict, device: torch.device, M: int, N: int, programs: int):
    """(workspace, counters) for a launch of an [M, N] output with a plan's constexprs ``meta``
    on ``programs`` programs, or (None, None) when its config does not split. Stream-K
    (STREAM_K): two tile-sized partial slots per program, a counter per shared tile (at most
    2 * programs of them, configs.stream_k_tiles)."""
    if meta.get("STREAM_K"):
        return buffers(device, 2 * programs * meta["BLOCK_M"] * meta["BLOCK_N"], 2 * programs)
    split = meta.get("SPLIT_K", 1)
    if split == 1:
        return None, None
    return buffers(device, split * M * N, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]))
