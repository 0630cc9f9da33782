"""The Gluon FP8 body's tuning policy (core/hopper_fp8.py): its key, candidate configs and
heuristic, registered as the "blockscaled_wgmma" family with core/configs.py's mechanism.
docs/tuning.md says how the choices were measured.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from .configs import Family, register, tile_count, with_pick
from .runtime import cdiv
from .scaling import COL_BLOCKS, ROW_BLOCKS, SCALE_BLOCK, Scaling

# The sm_90 Gluon body (core/hopper_fp8.py; its options: hopper_fp8.Tiling). A per-column scale
# (128x1, the weight gradient's) costs BLOCK_N / 4 registers per K block: 128-wide tiles then
# spill unless K_GROUP = 1.


class WgmmaKey(NamedTuple):
    m: int          # rows (dense); rows per group (grouped modes)
    n: int
    k: int
    scaling: Scaling
    out: str        # the output dtype: its staging tile in shared memory bounds STAGES
    mode: str = "dense"  # "dense", "grouped" (2D x 3D over offs), "swiglu" (MoE GEMM1), or their
    #                      decode forms "decode" / "decode_swiglu" (tiles computed transposed)
    fast_accum: bool = False  # epilogue scales, the whole K summed in the tensor core (FAST_ACC)

    def __str__(self):
        return f"m={self.m} n={self.n} k={self.k} {self.scaling} out={self.out}" + (
            "" if self.mode == "dense" else f" {self.mode}") + (" fast" if self.fast_accum else "")

    @property
    def epilogue_scaled(self) -> bool:
        """No K-block scales: the K loop only promotes (or, fast_accum, only accumulates)."""
        return not (self.scaling.a_per_k_block or self.scaling.b_per_k_block)


def wgmma_cfg(bn, stages, k_group, regs=232, bm=128, pingpong=False, loader_regs=None):
    """A Gluon-body config. pingpong: each consumer warpgroup owns whole bm-row tiles, in turn
    (one's epilogue runs under the other's K loop); else the two share each 128-row tile.
    regs / loader_regs: registers per thread of the worker consumer and of the loader warp
    (None: the kernel's LOADER_REGS default)."""
    extra = {"PINGPONG": True} if pingpong else {}
    if loader_regs is not None:
        extra["LOADER_REGS"] = loader_regs
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": SCALE_BLOCK, "GROUP_M": 8, "STAGES": stages,
                          "K_GROUP": k_group, "CONSUMER_REGS": regs, **extra}, num_warps=4, num_stages=1)


def tall_cfg(stages: int = 3) -> triton.Config:
    """The 256 x 128 tile (SPLIT_M: each consumer's 128 rows as two promoted 64-row halves), with
    224 registers per consumer thread and 56 for the loader: the split that compiles spill-free
    with 1x128 scale_a too (232 / 40 spilled there; tools/wgmma_ptxas.py)."""
    return wgmma_cfg(128, stages, 1, bm=256, regs=224, loader_regs=56)


def is_wgmma(c: triton.Config) -> bool:
    """Whether ``c`` is a config of the Gluon body (K_GROUP is its alone)."""
    return "K_GROUP" in c.kwargs


# Below this many rows the Triton body's 64-row and split-K tiles are used: a 128-row tile
# multiplies padding on half its tensor-core time, and too few tiles fill the SMs
# (bench/results/blockscaled.md).
WGMMA_MIN_M = 128
_SMEM = 232448  # bytes of shared memory a program may use on sm_90


def _wgmma_fits(c: triton.Config, out: str, mode: str = "dense") -> bool:
    k = c.kwargs
    bm, bn = k["BLOCK_M"], k["BLOCK_N"]
    b_rows = bn * (1 if mode in ("dense", "grouped") else 2)  # SwiGLU's gate and up rows; SWAP's two consumers'
    ring = k["STAGES"] * (bm + b_rows) * k["BLOCK_K"]  # fp8 A and W tiles
    out_bytes = 4 if out == "fp32" else 1 if out == "fp8" else 2
    if mode == "dense":
        staging = (2 if k.get("PINGPONG") else 1) * bm * bn * out_bytes  # the two consumers' C tiles
    elif mode.endswith("swiglu"):  # the up tile handed over in fp32, one consumer's fp8 store
        staging = (64 if mode == "swiglu" else bm) * bn * 5
    else:  # each consumer's layout change before its pointer stores
        staging = 2 * (64 if mode == "grouped" and not k.get("PINGPONG") else bm) * bn * out_bytes
    return ring + staging + 1024 <= _SMEM


def decode_tokens(m: int, swiglu: bool = False) -> int:
    """Tokens per SWAP tile (wgmma's N side) for m rows per group; SwiGLU's two 128-feature
    accumulators spill past 32."""
    return 16 if m <= 16 else 32 if m <= 32 or swiglu else 64


def wgmma_candidates(key: WgmmaKey, sms: int) -> list[triton.Config]:
    if key.mode.startswith("decode"):
        bn = 128 if key.mode == "decode_swiglu" else 64
        found = [wgmma_cfg(bn, st, kg, bm=bt) for bt in ((16, 32) if bn == 128 else (16, 32, 64)) for st in (4, 6, 8)
                 for kg in (1, 2, 4)]
    elif key.mode == "swiglu":
        found = [wgmma_cfg(128, st, kg, bm=64) for st in (3, 4) for kg in (1, 2, 3)]
    elif key.fast_accum:  # one fp32 accumulator per consumer: up to 64 x 256 (or 128 x 128 whole tiles)
        found = [wgmma_cfg(256, 3, 1)] + [wgmma_cfg(128, st, 1) for st in (4, 5, 6)]
        if key.mode == "dense":
            found += [wgmma_cfg(128, st, 1, bm=128, pingpong=True) for st in (4, 5)] + [wgmma_cfg(256, 4, 1, bm=64, pingpong=True)]
    elif key.scaling.b == COL_BLOCKS:
        found = [wgmma_cfg(64, st, kg) for st in (4, 6) for kg in (2, 4)] + [wgmma_cfg(128, st, 1) for st in (4, 6)]
    else:
        found = [wgmma_cfg(bn, st, kg) for bn in (128, 64) for st in (4, 5, 6) for kg in (2, 3, 4)]
        # 128 x 256 tiles, each consumer's 64 x 256 as two promoted 128-column halves (SPLIT);
        # with per-row (1x128) block scales of A they spill (tools/wgmma_ptxas.py)
        if key.mode == "dense" and key.scaling.a != ROW_BLOCKS:
            found += [wgmma_cfg(256, 3, 1)]
        if _tall_tiles(key):
            found += [wgmma_cfg(128, 3, 1, bm=256)]
        # grouped 256-row tiles where groups hold that many rows: from 0.92x to 1.1x the 128 x 128
        # tile by shape (bench/results/wgmma_modes.md), so autotuning's to choose, not the heuristic
        if key.mode == "grouped" and key.m >= 256:
            found += [tall_cfg(3), tall_cfg(4)]
    return with_pick([c for c in found if _wgmma_fits(c, key.out, key.mode)], wgmma_heuristic(key, sms))


def _tall_tiles(key: WgmmaKey) -> bool:
    """Whether 256 x 128 tiles (each consumer's 128 rows as two promoted 64-row halves,
    SPLIT_M: a quarter fewer operand bytes per product than 128 x 128) serve this key: dense
    promoting loops, not per-row (1x128) block scales of A, whose 64-row scale vectors spill
    there (tools/wgmma_ptxas.py) and ran 25-40% slower (bench/results/wgmma_modes.md)."""
    return key.mode == "dense" and not key.fast_accum and key.scaling.a != ROW_BLOCKS and key.scaling.b != COL_BLOCKS


def wave_efficiency(tiles: int, sms: int) -> float:
    """The share of the SMs' tile slots that ``tiles`` fill over their waves (1.0: no partial last wave)."""
    return tiles / (cdiv(tiles, sms) * sms) if tiles else 1.0


def wgmma_heuristic(key: WgmmaKey, sms: int) -> triton.Config:
    """The deepest ring that fits, three K blocks per unrolled group; 64-wide tiles when
    128-wide ones would leave SMs idle, and for per-column weight scales (128x1); 256 x 128
    tiles (``_tall_tiles``) where two or more waves of them fill the SMs to 90% or more. SwiGLU
    tiles are 64 rows by 128 output columns (the 1x128 blocks of its fp8 output). Decode
    (SWAP) tiles hold the group's tokens on wgmma's N side and keep many weight bytes in
    flight: a deep ring of thin slots."""
    if key.mode.startswith("decode"):
        bn = 128 if key.mode == "decode_swiglu" else 64
        bt = decode_tokens(key.m, key.mode == "decode_swiglu")
        return next(c for c in (wgmma_cfg(bn, st, 2, bm=bt) for st in (8, 6, 4)) if _wgmma_fits(c, key.out, key.mode))
    if key.mode == "swiglu":
        return wgmma_cfg(128, 4, 2, bm=64)
    if key.fast_accum:
        wide = key.mode == "dense" and tile_count(key.m, key.n, 128, 256) >= sms
        return wgmma_cfg(256, 3, 1) if wide and _wgmma_fits(wgmma_cfg(256, 3, 1), key.out) else wgmma_cfg(128, 4, 1)
    if key.scaling.b == COL_BLOCKS or (key.mode == "dense" and tile_count(key.m, key.n, 128, 128) < sms):
        return wgmma_cfg(64, 6, 4)  # narrow: 128-wide tiles would leave SMs idle, or spill with 128x1 scales
    tall, tall_tiles = wgmma_cfg(128, 3, 1, bm=256), tile_count(key.m, key.n, 256, 128)
    if _tall_tiles(key) and _wgmma_fits(tall, key.out) and tall_tiles >= 2 * sms and wave_efficiency(tall_tiles, sms) >= 0.9:
        return tall  # fewer operand bytes per product, over two waves or more with a nearly full last one
    return next(c for c in (wgmma_cfg(128, st, 3) for st in (6, 5, 4)) if _wgmma_fits(c, key.out, key.mode))


# never under the interpreter (Gluon has no interpreter): its "interpret" config is unused
register(Family("blockscaled_wgmma", wgmma_candidates, wgmma_heuristic, wgmma_cfg(128, 4, 3)))
