"""Split-K, host side: more programs for GEMMs with few output tiles and a long K loop.

A decode-sized GEMM, 16 to 128 tokens against a 4096-wide weight, has 32 to 64 output tiles of
64x64 or 64x128 for the H200's 132 SMs, each tile a serial loop over all of K. Most SMs idle,
and the busy ones stream the weight at a fraction of the memory bandwidth (before split-K:
0.64-0.77x cuBLAS for bf16 at M = 16-128, N = 4096; bench/results/matmul.md).

A config with SPLIT_K = S deals each tile's K blocks into S consecutive ranges and launches
one program per (tile, range): S times the programs, each 1/S of the loop. The partial sums
meet in an fp32 workspace; the last program of a tile to finish adds them up in a fixed order
and runs the epilogue (core/tiles.py ``split_k_combine``; the kernel side is there). Split-K
configs are tuned next to the others, so the tuner keeps them only where they pay.

This module sizes the buffers a launch needs and keeps the rule of when split configs are
tried, for every kernel that offers them (core/matmul.py, persistent/matmul.py, blockscaled/matmul.py).
"""

from __future__ import annotations

import functools

import torch
import triton

from .runtime import empty, with_meta

SPLITS = (2, 4, 8)

# The workspace is [SPLIT_K * M, N] fp32, so a split config is tried only where SPLIT_K times the
# M bucket is at most WORKSPACE_ROWS: the workspace then stays at or below 512 rows of fp32
# (29 MB for N = 14336, M = 64). Larger M has enough tiles to fill the SMs without splitting.
WORKSPACE_ROWS = 512


def with_splits(configs: list[triton.Config], splits=SPLITS) -> list[triton.Config]:
    """Each config once per split count, SPLIT_K set."""
    return [
        with_meta(c, SPLIT_K=s)
        for c in configs
        for s in splits
    ]


def split_of(config: triton.Config) -> int:
    return config.kwargs.get("SPLIT_K", 1)


def allowed(config: triton.Config, m_bucket: int) -> bool:
    """Whether ``config`` may be tuned for an M in this power-of-two bucket (a pruner step)."""
    return split_of(config) == 1 or split_of(config) * m_bucket <= WORKSPACE_ROWS


def _shapes(configs) -> tuple[tuple[int, int, int], ...]:
    """(SPLIT_K, BLOCK_M, BLOCK_N) of each config that splits."""
    return tuple((split_of(c), c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in configs if split_of(c) > 1)


@functools.lru_cache(maxsize=None)
def _tuned_shapes(kernel, m_bucket: int) -> tuple[tuple[int, int, int], ...]:
    # Once per (kernel, M bucket): scanning the config list cost ~130 us of Python per call,
    # more than the rest of a launch's host time.
    return _shapes([c for c in kernel.configs if allowed(c, m_bucket)])


def _buffers(shapes, M: int, N: int, device):
    if not shapes:
        return None, None
    most = max(s for s, _, _ in shapes)
    tiles = max(triton.cdiv(M, bm) * triton.cdiv(N, bn) for _, bm, bn in shapes)
    workspace = empty((most * M, N), dtype=torch.float32, device=device)
    return workspace, torch.zeros(tiles, dtype=torch.int32, device=device)


def buffers(configs: list[triton.Config], M: int, N: int, device):
    """(workspace, counters) for the split configs among ``configs`` (a forced config, or every
    config the tuner may try for this M), sized for the largest of them; (None, None) if none
    splits. The counters start at zero, and each launch leaves them at zero."""
    return _buffers(_shapes(configs), M, N, device)


def launch_buffers(kernel, config: triton.Config | None, M: int, N: int, m_bucket: int, device):
    """``buffers`` for one launch of a ``runtime.Kernel`` whose configs may split: the forced
    ``config``, or under autotuning every config ``allowed`` for ``m_bucket``. The interpreter
    runs its one fixed config (``kernel.interpret_config``) unless a config is forced."""
    if config is not None:
        return buffers([config], M, N, device)
    if kernel.tuned is None:
        return buffers([kernel.interpret_config], M, N, device)
    return _buffers(_tuned_shapes(kernel, m_bucket), M, N, device)
