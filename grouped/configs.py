"""grouped/'s tuning policy: its kernel families' keys, candidate configs and heuristics,
registered with core's launcher (core/configs.py keeps the mechanism and the dense and
Gluon-body policy), and the rule's thresholds for the Gluon body's grouped flavour
(grouped/wgmma.py). docs/tuning.md says how the choices were measured.

Families: "ragged" (grouped_matmul's offs modes and the MoE GEMMs on core's tile body),
"list" (list mode), "sort" (the MoE routing sort), "route" (the fused router), and the
memory-light helpers "row_tiles", "gather_quantize", "combine", "swiglu_backward".
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from ..core.configs import (
    BLOCK_K, EITHER, MATMUL_CONFIGS, MATMUL_INTERPRET, TMA_ONLY, Family, PrepKey, cfg, flavoured, register, with_meta,
    with_pick)
from ..core.runtime import cdiv, next_pow2
from ..core.scaling import SCALE_BLOCK, Scaling

# ---------------------------------------------------------------------------- grouped (ragged)
# grouped/'s ragged_kernel: grouped_matmul's four offs modes and the two MoE GEMMs.


class RaggedKey(NamedTuple):
    dtype: str
    ragged: str     # "M", "N", "K" or "" (batched)
    m: int          # m_bucket of the rows per group (M / G for offs over rows)
    n: int
    k: int
    a_k: bool
    b_k: bool
    tma: int
    swiglu: bool    # MoE GEMM1: gate and up columns in one tile, SwiGLU in the epilogue
    gather: bool    # MoE GEMM1 reads token rows through an index (pointer loads)
    scaling: Scaling | None = None  # an FP8 grouped GEMM's (None: unscaled)
    w4: str = ""    # b holds 4-bit weights ("mxfp4", "int4"), dequantised in the K loop (a 16-bit a)
    w4_group: int = 0  # a 4-bit b's values along K per scale
    w4_tma: bool = False  # a 4-bit b's bytes through a descriptor (tiles.TileSpec.W4_TMA)
    w4_frag: bool = False  # an MXFP4 b in fragment order (grouped/prepack.py; tiles.TileSpec.W4_FRAG)

    def __str__(self):
        return (f"{self.dtype} ragged={self.ragged or '-'} m={self.m} n={self.n} k={self.k} a_k={int(self.a_k)} "
                f"b_k={int(self.b_k)} tma={self.tma} swiglu={int(self.swiglu)} gather={int(self.gather)}"
                + (f" scaling={self.scaling}" if self.scaling is not None else "")
                + (f" w4={self.w4}/{self.w4_group}{' tma' if self.w4_tma else ''}"
                   f"{' frag' if self.w4_frag else ''}" if self.w4 else ""))


# Core's Hopper tiles plus thin-M ones: MoE decode gives each expert a handful of rows, and a
# 64-row tile would multiply mostly padding while the weights (the real cost) stream through.
RAGGED_SMALL_M = [
    cfg(16, 64, 64, 4, 5),
    cfg(16, 128, 64, 4, 4),
    cfg(16, 256, 64, 4, 3),
    cfg(32, 128, 64, 4, 4),
    cfg(16, 64, 128, 4, 5),
    cfg(16, 128, 128, 4, 4),
    cfg(32, 128, 128, 4, 4),
    cfg(16, 64, 32, 4, 4),
    cfg(32, 64, 32, 4, 4),
]
# 128x256 with a 4th stage (196 KB of shared memory with TMA): it beat 3 stages on most prefill
# shapes (it does not fit the persistent dense kernel, which also stages its output tile).
RAGGED_LARGE_M = [cfg(128, 256, 64, 8, 4)]
RAGGED_CONFIGS = MATMUL_CONFIGS + RAGGED_LARGE_M + RAGGED_SMALL_M
# Wider than matmul's interpreter tile: the upper-bound grid adds G + 1 rows of programs, and
# each program pays a fixed Python cost under the interpreter.
RAGGED_INTERPRET = cfg(32, 64, 64, 1, 1, group_m=4)
# Block scales need BLOCK_K = the scale block.
RAGGED_SCALED_INTERPRET = cfg(32, 64, SCALE_BLOCK, 1, 1, group_m=4)


# An fp8 output quantised in the epilogue (Scaling.fp8_out): a tile's output columns are whole
# 128-column scale blocks (BLOCK_N 256 under SwiGLU, which halves it), and the scaled tiles'
# size cap holds.
RAGGED_FP8_OUT = [cfg(bm, bn, SCALE_BLOCK, w, 3) for bm in (16, 32, 64) for bn in (128, 256) for w in (4, 8)
                  if bm * bn <= 128 * 128]
# Decode streams the weights: thin fp8 tiles hold half a bf16 tile's bytes per stage, so
# deeper pipelines keep as many bytes in flight.
RAGGED_FP8_OUT += [cfg(16, bn, SCALE_BLOCK, 4, s) for bn in (128, 256) for s in (4, 5)]
RAGGED_FP8_SMALL_M = [cfg(16, 64, 128, 4, 8), cfg(16, 128, 128, 4, 6), cfg(32, 128, 128, 4, 5)]
RAGGED_FP8_OUT_INTERPRET = cfg(16, 128, SCALE_BLOCK, 1, 1, group_m=4)
# Fragment-order MXFP4 (tiles.TileSpec.W4_FRAG): 128-wide K blocks (the layout's unit); BLOCK_N
# is the weight rows, wgmma's M (64 per warpgroup), BLOCK_M the tokens, its N.
# 4 warps are one warpgroup, 64 weight rows per wgmma; a 128 x 128 tile needs two (or it spills).
RAGGED_W4_FRAG = [cfg(bm, bn, 128, w, s) for bm in (16, 32, 64, 128) for bn in (64, 128) for w in (4, 8)
                  for s in (3, 4) if w == 4 or (bn == 128 and bm >= 64)]
RAGGED_W4_FRAG_INTERPRET = cfg(32, 64, 128, 1, 1, group_m=4)


def fp8_out(key: RaggedKey) -> bool:
    """Whether the tiles quantise their own fp8 output (1x128 scales)."""
    return key.scaling is not None and key.scaling.fp8_out


def fp8_out_width(key: RaggedKey) -> int:
    """BLOCK_N of a tile that quantises its fp8 output: one scale block of output columns."""
    return 2 * SCALE_BLOCK if key.swiglu else SCALE_BLOCK


def ragged_interpret(key: RaggedKey) -> triton.Config:
    if key.w4_frag:
        return RAGGED_W4_FRAG_INTERPRET
    if fp8_out(key):
        return with_meta(RAGGED_FP8_OUT_INTERPRET, BLOCK_N=fp8_out_width(key))
    return RAGGED_SCALED_INTERPRET if key.scaling is not None else RAGGED_INTERPRET

# Rows per group -> the tile heights worth trying: a tile much taller than a group multiplies
# padding; a much shorter one re-reads each weight tile once per row block.
_BLOCK_M_BANDS = [(16, (16,)), (64, (32, 64)), (255, (64, 128)), (1 << 62, (128, 256))]


def ragged_candidates(key: RaggedKey, sms: int) -> list[triton.Config]:
    if key.w4_frag:
        heights = next(h for limit, h in _BLOCK_M_BANDS if key.m <= limit)
        kept = [c for c in RAGGED_W4_FRAG if c.kwargs["BLOCK_M"] in heights
                and (c.kwargs["BLOCK_N"] == 128 or not key.swiglu)]
        return with_pick(flavoured(kept, key.tma), ragged_heuristic(key, sms))
    if fp8_out(key):
        kept = [c for c in RAGGED_FP8_OUT if c.kwargs["BLOCK_N"] == fp8_out_width(key)]
        return with_pick(flavoured(kept, key.tma), ragged_heuristic(key, sms))
    bk = BLOCK_K[key.dtype]
    heights = next(h for limit, h in _BLOCK_M_BANDS if key.m <= limit)
    pool = RAGGED_CONFIGS + (RAGGED_FP8_SMALL_M if key.dtype == "fp8" else [])
    kept = [c for c in pool if c.kwargs["BLOCK_K"] == bk and c.kwargs["BLOCK_M"] in heights]
    if 64 < key.m < 256:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    if key.swiglu:
        # The interleaved gate/up tile halves BLOCK_N on the output; 64 would store 32 columns.
        kept = [c for c in kept if c.kwargs["BLOCK_N"] >= 128]
    if key.scaling is not None:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    if key.m <= 16 and key.ragged == "M":
        # Decode: a few experts' column tiles leave most SMs idle; K splits multiply the tiles
        # (grouped/kernels.py ragged_kernel SPLIT_K). Candidates only: the heuristic cannot see how
        # many experts a call really hits (docs/hopper.md, "MXFP4 and INT4 weights").
        kept += [with_meta(c, SPLIT_K=s) for c in kept if c.kwargs["BLOCK_M"] == 16 for s in (2, 4)]
    return with_pick(flavoured(kept, key.tma), ragged_heuristic(key, sms))


def ragged_heuristic(key: RaggedKey, sms: int) -> triton.Config:
    """Tile height from the rows per group (16 / 32-64 / 128 / 128x256 bands), as the tuned
    picks on the MoE shapes of bench_grouped went; TMA only for large groups with long K."""
    bk = BLOCK_K[key.dtype]
    m = key.m
    if fp8_out(key):
        # The promotion holds the block's partial next to the accumulator: 64x256 needs 8 warps.
        bm = min(64, max(16, next_pow2(m)))
        return with_meta(cfg(bm, fp8_out_width(key), SCALE_BLOCK, 8 if bm * fp8_out_width(key) > 64 * 128 else 4, 3),
                         USE_TMA=key.tma == TMA_ONLY)
    if key.w4_frag:
        bm = max(16, min(128, next_pow2(m)))
        return with_meta(cfg(bm, 128, 128, 8 if bm == 128 else 4, 3), USE_TMA=False)
    if key.w4_tma:
        # The decode, not the MMA, bounds a 4-bit tile: 128-wide K blocks (64-byte boxes) for the
        # thin tiles, where the weight stream is the cost; 64 for tall ones (bench/results/moe_w4.md).
        base = cfg(max(16, next_pow2(m)), 128, 128, 4, 3) if m <= 64 else cfg(128, 128, 64, 8, 3)
        return with_meta(base, USE_TMA=False)
    if m <= 16:
        base = cfg(16, 128, bk, 4, 4) if key.swiglu else cfg(16, 64, bk, 4, 5 if bk <= 64 else 4)
    elif m <= 32:
        base = cfg(32, 128, bk, 4, 4)
    elif m <= 64:
        base = cfg(64, 128, bk, 4, 4)
    elif m < 256:
        base = cfg(128, 128, bk, 4, 4)
    else:
        # The weight gradient (offs over K) ran 3 stages ahead of 4 in every layout (grouped_wgrad.md).
        base = cfg(128, 256, bk, 8, 4 if bk <= 64 and key.ragged != "K" else 3)
    if key.scaling is not None and base.kwargs["BLOCK_M"] * base.kwargs["BLOCK_N"] >= 128 * 128:
        # The per-K-block promotion converts the fp32 partial's layout through shared memory:
        # a 128x256 tile does not fit next to its pipeline, and a 128x128 one keeps its
        # partial next to the accumulator in 8 warps' registers (the block-scaled GEMM's tiles).
        base = cfg(128, 128, bk, 8, 3)
    tma = key.tma == TMA_ONLY or (key.tma == EITHER and m >= 256 and key.k >= 2048)
    return with_meta(base, USE_TMA=tma)

# ---------------------------------------------------------------------------- grouped (list mode)


class ListKey(NamedTuple):
    dtype: str
    g: int          # number of pairs
    total: int      # m_bucket of the output elements over all pairs

    def __str__(self):
        return f"{self.dtype} g={self.g} total={self.total}"


# A persistent walk over every pair's tiles: no M to prune by, so small and large tiles.
LIST_CONFIGS = [
    cfg(128, 128, 64, 8, 3),
    cfg(64, 128, 64, 4, 4),
    cfg(128, 128, 128, 8, 3),
    cfg(64, 128, 128, 4, 4),
    cfg(64, 64, 32, 4, 4),
]


def list_candidates(key: ListKey, sms: int) -> list[triton.Config]:
    kept = [c for c in LIST_CONFIGS if c.kwargs["BLOCK_K"] == BLOCK_K[key.dtype]]
    return with_pick(kept, list_heuristic(key, sms))


def list_heuristic(key: ListKey, sms: int) -> triton.Config:
    bk = BLOCK_K[key.dtype]
    if key.dtype == "fp32":
        return cfg(64, 64, 32, 4, 4)
    if key.total >= sms * 128 * 128 * 2:
        return cfg(128, 128, bk, 8, 3)
    return cfg(64, 128, bk, 4, 4)

# ---------------------------------------------------------------------------- MoE routing sort
# grouped/'s moe_prep_kernel (the routing sort, x's sorted rows, the row-tile tables): its
# block sizes follow E (moe_steps.prep_step), so a config is only its warp count.


class SortKey(NamedTuple):
    e_block: int

    def __str__(self):
        return f"e_block={self.e_block}"


SORT_CONFIG = triton.Config({}, num_warps=4, num_stages=1)
# The prep kernel serves decode-sized batches (each program counts over all pairs); above this
# many (token, slot) pairs torch.sort's multi-block radix sort is faster on the GPU.
SORT_MAX_PAIRS = 4096
# MoEFFN's routing in the prep (route fused in front of the sort): every program routes every
# token, so up to this many logits (tokens x the experts' power-of-two block) per call, and
# ROUTED_PREP_TOKENS x that block per step of a program; past it route() runs first. One step:
# past it the repeated routing cost more than route_kernel's launch (bench/results/moe_prep.md).
ROUTED_PREP_MAX_ELEMENTS = 1 << 11
ROUTED_PREP_STEP_ELEMENTS = 1 << 11


def sort_candidates(key: SortKey, sms: int) -> list[triton.Config]:
    return [triton.Config({}, num_warps=w, num_stages=1) for w in (2, 4, 8)]


def sort_heuristic(key: SortKey, sms: int) -> triton.Config:
    return SORT_CONFIG

# ---------------------------------------------------------------------------- helpers
# grouped/'s row_tiles_kernel (the Gluon body's row-tile table), gather_quantize_kernel (MoE
# GEMM1's sorted fp8 rows), combine_kernel and swiglu_backward_kernel: memory-light, so a config
# is a block height and warps from PrepKey's size (row_tiles: G_BLOCK; gather_quantize: the m
# bucket of its rows; combine: H; swiglu_backward: I).


def prep_config(key: PrepKey, sms: int = 0) -> triton.Config:
    if key.what == "row_tiles":  # CHUNK tiles per program against G_BLOCK groups: one [CHUNK, G_BLOCK] pass
        return triton.Config({"CHUNK": max(16, min(32, 8192 // key.size))}, num_warps=4, num_stages=1)
    if key.what == "combine":  # one token's row per program, in 16-byte vectors
        return triton.Config({"BLOCK_H": min(1024, max(128, 1 << (key.size - 1).bit_length()))}, num_warps=4, num_stages=1)
    if key.what == "swiglu_backward":  # one pair's row per program, in chunks of up to 1024 columns
        return triton.Config({"BLOCK_I": min(1024, max(128, 1 << (key.size - 1).bit_length()))}, num_warps=4, num_stages=1)
    return triton.Config({"BLOCK_R": 32 if key.size >= 4096 else 16}, num_warps=4, num_stages=1)


def gather_col_blocks(row_programs: int, col_blocks: int, sms: int, per_sm: int = 4) -> int:
    """128-column blocks per gather_quantize program: whole rows when the rows alone give each
    SM ``per_sm`` programs, else the rows' blocks spread over more programs (a program's blocks
    run one after another, so a decode step's few long rows in one program serialise). The
    prep kernel asks for one program per SM: each of its programs also sorts all the pairs."""
    return max(1, col_blocks // max(1, cdiv(per_sm * sms, max(row_programs, 1))))


# ---------------------------------------------------------------------------- MoE routing
# grouped/routing.py's fused kernel: one program per token, the experts in one block.


class RouteKey(NamedTuple):
    e_block: int

    def __str__(self):
        return f"e_block={self.e_block}"


# The fused kernel serves decode-sized batches (one launch instead of torch's dozen); above
# this many tokens, or this many experts in a block, route() runs its torch ops.
ROUTE_MAX_TOKENS = 256
ROUTE_MAX_E_BLOCK = 1024


def route_candidates(key: RouteKey, sms: int) -> list[triton.Config]:
    return [triton.Config({}, num_warps=w, num_stages=1) for w in (1, 2, 4, 8)]


def route_heuristic(key: RouteKey, sms: int) -> triton.Config:
    return triton.Config({}, num_warps=1 if key.e_block <= 128 else 2 if key.e_block <= 512 else 4, num_stages=1)

# ---------------------------------------------------------------------------- the Gluon body's grouped flavour
# grouped/wgmma.py's rule between core's two bodies for grouped FP8 GEMMs.

# The rule's bands over the mean rows per group (M / G), from the sweep of every body over
# 0.03-512 pairs per expert on Qwen3, Mixtral and DeepSeek-V3 EP8, uniform and skewed, and of
# grouped_matmul over 16-256 rows (bench/results/moe_decode_bodies.md): the Gluon body's
# 128/64-row tiles from WGMMA_MIN_GROUP_ROWS (below it they compute mostly padding) ...
WGMMA_MIN_GROUP_ROWS = 32
# ... and only for experts of at least this many weight elements (N * K): the stored tiny layer's
# (256 x 1024) FP8 moe_ffn ran 0.78x bf16 on it against 0.93x on the Triton body, whose
# pipeline has fewer launches around its GEMMs (bench/results/moe_fp8.md).
WGMMA_MIN_EXPERT_ELEMENTS = 1 << 20
# ... its decode form (SWAP: the weights' rows on wgmma's M side) in moe_ffn's pipeline up to
# WGMMA_DECODE_MAX_ROWS, where the step reads at least WGMMA_DECODE_MIN_ELEMENTS weights
# (min(M, G) * N * K): below that (Qwen3 up to T = 4) the form's launches cost more than it
# saves. A plain grouped GEMM (grouped_matmul, the FP8 training GEMMs) never gained from it:
# WGMMA_GEMM_DECODE_MAX_ROWS. Between the bands, and for small steps, core's Triton body. The
# rule reads M at its bucket's floor (grouped_band), so that one compiled variant serves a bucket.
WGMMA_DECODE_MAX_ROWS = 16
WGMMA_GEMM_DECODE_MAX_ROWS = 0
WGMMA_DECODE_MIN_ELEMENTS = 1 << 25


register(
    Family("ragged", ragged_candidates, ragged_heuristic, ragged_interpret),
    Family("list", list_candidates, list_heuristic, MATMUL_INTERPRET),
    Family("sort", sort_candidates, sort_heuristic, triton.Config({}, num_warps=1, num_stages=1)),
    Family("route", route_candidates, route_heuristic, triton.Config({}, num_warps=1, num_stages=1)),
    *(Family(name, lambda key, sms: [prep_config(key)], prep_config, prep_config)
      for name in ("row_tiles", "gather_quantize", "combine", "swiglu_backward")),
)
