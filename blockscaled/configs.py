"""blockscaled/'s tuning policy: each of its kernel families' keys, candidate configs and
heuristic, registered with core's launcher (core/configs.py keeps the mechanism: ``cfg``,
``flavoured``, split-K, ``Family``; docs/tuning.md says how the choices were measured).

Families: "blockscaled" (core's dense kernel tuned for fp8 operands with scales, the Triton
body of blockscaled_matmul), "quantize" and "quantize_pair" (quantize_fp8's kernels),
"transpose" (the fp8 transposed copy).
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from ..core.configs import (
    EITHER, POINTERS_ONLY, TMA_ONLY, Family, PrepKey, cfg, fill_split, flavoured, register, split_allowed, tile_count,
    warp_specialized, with_meta, with_pick, with_splits)
from ..core.runtime import cdiv
from ..core.scaling import BLOCKS, ROW, SCALE_BLOCK, Granularity, Scaling

# ---------------------------------------------------------------------------- blockscaled_matmul on core's Triton body
# core's matmul_kernel with its scales on (blockscaled/matmul.py): BLOCK_K = 128, the scale block.


class BlockscaledKey(NamedTuple):
    m: int
    n: int
    k: int
    a_k: bool
    b_k: bool
    tma: int
    scaling: Scaling

    def __str__(self):
        return f"m={self.m} n={self.n} k={self.k} a_k={int(self.a_k)} b_k={int(self.b_k)} tma={self.tma} {self.scaling}"


def blockscaled_cfg(bm, bn, warps, stages, group_m=8, **extra):
    return cfg(bm, bn, SCALE_BLOCK, warps, stages, group_m, **extra)


# Triton 3.6 waits for each K block's wgmma before promoting it (acc += part * scale), so what
# hides the promotion is other warpgroups on the SM: two per program (8 warps, or warp
# specialisation's two consumers) or several programs per SM (64x128 w4 s3). Warp-specialised
# configs need TMA loads of K-major a and b; 5 stages with warp specialisation gave NaN.
BLOCKSCALED_LARGE_M = [
    blockscaled_cfg(128, 128, 8, 3),
    blockscaled_cfg(128, 128, 8, 4),
    blockscaled_cfg(128, 128, 4, 3),
    blockscaled_cfg(256, 128, 8, 3),
    blockscaled_cfg(64, 128, 4, 3),
    blockscaled_cfg(64, 128, 4, 4),
    warp_specialized(blockscaled_cfg(128, 128, 4, 4)),
    blockscaled_cfg(128, 128, 8, 4, PERSISTENT=True),
    warp_specialized(blockscaled_cfg(128, 128, 4, 4), PERSISTENT=True),
]
# M <= 64 is bound by reading B: 64-row tiles, narrow ones for more programs.
BLOCKSCALED_SMALL_M = [
    blockscaled_cfg(64, 128, 4, 3),
    blockscaled_cfg(64, 128, 4, 4),
    blockscaled_cfg(64, 256, 4, 3),
    blockscaled_cfg(64, 64, 4, 4),
    blockscaled_cfg(64, 32, 4, 5),
]
BLOCKSCALED_SPLIT_K = with_splits([blockscaled_cfg(64, 128, 4, 4), blockscaled_cfg(64, 64, 4, 4), blockscaled_cfg(64, 32, 4, 5)])
BLOCKSCALED_CONFIGS = (BLOCKSCALED_LARGE_M + [c for c in BLOCKSCALED_SMALL_M if c not in BLOCKSCALED_LARGE_M]
                       + BLOCKSCALED_SPLIT_K)
BLOCKSCALED_INTERPRET = blockscaled_cfg(32, 32, 1, 1, group_m=4)


def _ws_ok(key) -> bool:
    return key.tma != POINTERS_ONLY and key.a_k and key.b_k


def blockscaled_candidates(key: BlockscaledKey, sms: int) -> list[triton.Config]:
    family = (BLOCKSCALED_SMALL_M if key.m <= 64 else BLOCKSCALED_LARGE_M) + BLOCKSCALED_SPLIT_K
    kept = [c for c in family if split_allowed(c, key.m) and (_ws_ok(key) or not c.kwargs.get("WARP_SPECIALIZE"))]
    kept = [with_meta(c, USE_TMA=True) if c.kwargs.get("WARP_SPECIALIZE") else c for c in kept]
    return with_pick(flavoured(kept, key.tma), blockscaled_heuristic(key, sms))


def blockscaled_heuristic(key: BlockscaledKey, sms: int) -> triton.Config:
    """M >= 2048 with enough 128x128 tiles: the persistent 128x128 tile, warp-specialised where
    the operands allow it; otherwise 64-row tiles, split-K until the SMs are busy."""
    M, N, K = key.m, key.n, key.k
    tma = key.tma == TMA_ONLY or (key.tma == EITHER and M >= 1024)
    if M >= 2048 and tile_count(M, N, 128, 128) >= sms:
        if _ws_ok(key):
            return warp_specialized(blockscaled_cfg(128, 128, 4, 4), PERSISTENT=True, USE_TMA=True)
        return blockscaled_cfg(128, 128, 8, 4, PERSISTENT=True, USE_TMA=tma)
    bn = 128 if tile_count(M, N, 64, 128) >= sms else 64
    split = fill_split(tile_count(M, N, 64, bn), K, SCALE_BLOCK, sms)
    extra = {"SPLIT_K": split} if split > 1 else {}
    return blockscaled_cfg(64, bn, 4, 4, USE_TMA=key.tma == TMA_ONLY, **extra)

# ---------------------------------------------------------------------------- quantize_fp8


class QuantKey(NamedTuple):
    m: int
    k: int
    block: Granularity  # ROW_BLOCKS (1x128), BLOCKS (128x128) or ROW; str() as the tables name it

    def __str__(self):
        return f"m={self.m} k={self.k} {self.block}"


def _qcfg(bm, warps):
    return triton.Config({"BLOCK_M": bm, "BLOCK_K": SCALE_BLOCK}, num_warps=warps, num_stages=2)


# Memory-bound: a few tile heights are enough; 128x128 blocks need BLOCK_M = 128.
QUANT_CONFIGS = [_qcfg(16, 4), _qcfg(32, 4), _qcfg(64, 4), _qcfg(128, 8), _qcfg(128, 4)]
QUANT_INTERPRET = _qcfg(SCALE_BLOCK, 1)


def quant_candidates(key: QuantKey, sms: int) -> list[triton.Config]:
    if key.block == BLOCKS:
        return [c for c in QUANT_CONFIGS if c.kwargs["BLOCK_M"] == SCALE_BLOCK]
    return list(QUANT_CONFIGS)


def quant_heuristic(key: QuantKey, sms: int) -> triton.Config:
    if key.block == BLOCKS:
        return _qcfg(SCALE_BLOCK, 8)  # one 128x128 block per program; 8 warps keep more loads in flight
    # Enough programs for every SM (one per BLOCK_M rows and 128 columns), tall tiles otherwise.
    columns = 1 if key.block == ROW else cdiv(key.k, SCALE_BLOCK)
    return _qcfg(32 if cdiv(key.m, 32) * columns >= 2 * sms else 16, 4)


# quantize_fp8(x, (1, 128), transposed=True): blockscaled/'s quantize_pair_kernel walks a 128x128
# block of x BLOCK_M rows at a time (the whole block in registers spilled: 255 registers, 12.5%
# occupancy), so a config is the chunk's height and the warps.
def _pair_cfg(bm, warps):
    return triton.Config({"BLOCK_M": bm}, num_warps=warps, num_stages=1)


PAIR_CONFIGS = [_pair_cfg(bm, w) for bm in (16, 32, 64) for w in (4, 8)]


def pair_candidates(key: QuantKey, sms: int) -> list[triton.Config]:
    return list(PAIR_CONFIGS)


def pair_heuristic(key: QuantKey, sms: int) -> triton.Config:
    return _pair_cfg(32, 4)


# ---------------------------------------------------------------------------- transpose
# blockscaled/'s transpose_kernel (quantize_fp8's transposed fp8 copy): PrepKey("transpose",
# the bucket of its element count, to 2^24).


def _transpose_cfg(br, bc, warps):
    return triton.Config({"BLOCK_R": br, "BLOCK_C": bc}, num_warps=warps, num_stages=1)


TRANSPOSE_CONFIGS = [_transpose_cfg(br, bc, w) for br, bc in ((32, 32), (64, 64), (64, 128), (128, 64), (128, 128))
                     for w in (4, 8)]


def transpose_config(key: PrepKey, sms: int = 0) -> triton.Config:
    """128 x 128 bytes a program (64 x 64 ran at 0.7x the speed)."""
    return _transpose_cfg(128, 128, 8)


register(
    Family("blockscaled", blockscaled_candidates, blockscaled_heuristic, BLOCKSCALED_INTERPRET),
    Family("quantize", quant_candidates, quant_heuristic, QUANT_INTERPRET),
    Family("quantize_pair", pair_candidates, pair_heuristic, _pair_cfg(32, 1)),  # interpreter: 4 chunks a block
    Family("transpose", lambda key, sms: list(TRANSPOSE_CONFIGS), transpose_config, transpose_config),
)
