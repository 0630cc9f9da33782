"""The sm_90 body of the scaled FP8 tile, written in Gluon (docs/hopper.md, "Two K-loop bodies").

Block-scaled FP8 promotes each K block's product to the fp32 accumulator with its scales:
``acc += dot(a_k, b_k) * sa_k[:, None] * sb_k``. In Triton's language the promotion of block k
waits for block k's wgmma, so the tensor cores idle while it runs. This body issues block k's
wgmma asynchronously and promotes block k-1 while it runs, which Triton 3.6 can only express
in Gluon (``triton.experimental.gluon``). Scales that are constant along K (tensor, row,
column: SA_ROWS = SB_COLS = 0) go to the epilogue; the K loop then promotes each block
unscaled, or with FAST_ACC chains the whole K in the tensor core's accumulator.

What it shares with core's Triton body (core/tiles.py): the tile order (``swizzle_tile``, the
persistent walk of ``program_units``), the scale conventions (``Scales``: SA_ROWS / SB_COLS
rows and columns per scale, 1 or 128), and the epilogue (``tiles.epilogue``: epilogue scales,
bias, activation; then the out dtype's store). Only the K loop and the store path differ.

Structure (one program per SM, persistent over 128 x BLOCK_N output tiles):
- a loader warp streams A [128, 128] and W [BLOCK_N, 128] K blocks through a ring of STAGES
  shared-memory slots with TMA, with a ``ready`` barrier (TMA bytes landed) and an ``empty``
  barrier (both consumers have finished reading) per slot;
- two consumer warpgroups, independent partitions with their own schedule, each own 64 rows
  of the tile: the default partition rows 0-63, a worker partition rows 64-127;
- each consumer runs the K loop in groups of K_GROUP blocks, unrolled: issue block j's wgmma,
  wait until only it is in flight, promote block j-1. A group ends drained (wait for none in
  flight): a loop-carried in-flight accumulator made ptxas serialise every wgmma (C7515).
Options of the same body: PINGPONG (each consumer owns whole tiles in turns), SPLIT (a
promoting 256-column tile as two accumulators), GROUPED / SWIGLU / SWAP (grouped/'s uses).
Aggregates carry what the partitions share: ``Tiling`` (the options), ``Ring``, ``Handoff``,
``Staging``, ``TileAt`` (a tile's place) and ``ScaleIndex`` (where its K blocks' scales are read).
"""

from typing import Any, NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import checks, configs, hopper_configs
from .dispatch import Launch
from .launch import Launcher, Request
from .runtime import INTERPRET, capability, cdiv, sm_count
from .fp8 import amax_input, fp8_cast, fp8_scale
from .scaling import SCALE_BLOCK, Scaling
from .tiles import NO_VECTOR, Operand, Scales, Vector, activate, epilogue, swizzle_tile
from .tma import tma_layout

ROWS = gl.constexpr(64)  # rows per consumer warpgroup: the M of one warpgroup's wgmma
_SCALE_BLOCK = gl.constexpr(SCALE_BLOCK)


class Groups(NamedTuple):
    """The grouped flavour's per-call data (GROUPED); a dense call passes ``DENSE``.

    sched: int32 [units, 4], one row per row-tile of the grouped dimension (core never reads
       ``offs`` itself; grouped/ builds the table on the device): (group g, first row, end row
       of the group, fill), fill 0 for a product, 1 for a tile of zeros (rows past the last
       offset), 2 for NaN (bad offs). count: int32 [1], how many rows of ``sched`` are used.
    G, b_rows: B's descriptor spans G * b_rows rows of W; group g's rows start at g * b_rows.
    b_cols: None, or the experts side by side along K (a weight gradient's transposed copy,
       W^T of [G * K, rows] stored [rows, G * K]): W is [b_rows, G * b_cols] and group g's
       K columns start at g * b_cols (b_cols = K).
    scale_b_g, bias_g: element strides of scale_b and bias between groups.
    scatter: int32 [rows], the C row of each row (MoE GEMM2), or None (C row = row).
    weight: fp32 multiplier per C row (the routing weight), or None.
    """

    sched: Any
    count: Any
    G: Any
    b_rows: Any
    scale_b_g: Any
    bias_g: Any
    scatter: Any = None
    weight: Any = None
    b_cols: Any = None


@triton.constexpr_function
def _acc_layout(block_n):
    # one warpgroup ([4, 1] warps) over [ROWS, block_n]; fp8 wgmma takes K = 32 per instruction
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 32])


@triton.constexpr_function
def _tile_n(block_n, swiglu, swap):
    """Output columns per tile: BLOCK_N, or both consumers' BLOCK_N features side by side
    when SWAP (without SWIGLU) splits a tile's features between them."""
    return 2 * block_n if swap and not swiglu else block_n


@triton.constexpr_function
def _split(block_m, block_n, fast_acc):
    """Whether a consumer holds its share of the tile as two accumulators: 128-column halves
    of a promoting 256-column tile (a 64 x 256 raw tile next to its accumulator would not fit
    in registers), or 64-row halves of a 256-row tile (each consumer 128 rows)."""
    return block_m > 2 * ROWS.value or (block_n > 128 and not fast_acc)


@triton.constexpr_function
def _consumer_rows(block_m, swiglu, pingpong):
    """Rows of A one consumer multiplies per tile: all BLOCK_M when it owns whole tiles
    (PINGPONG) or shares them by product (SWIGLU), else its 64-row half."""
    return block_m if swiglu or pingpong else ROWS.value


@aggregate
class Tiling:
    """The body's tile options (the kernel's constexprs) and what follows from them: what each
    partition reads instead of fifteen flat arguments.

    SWIGLU (GROUPED): W holds each group's gate rows then its up rows (b_rows = 2N); C gets
       silu(gate) * up. The two consumers compute the gate and the up product of the same 64
       rows, and the up one hands its tile over through shared memory (``xchg``).
    SWAP (GROUPED, decode): each tile is computed transposed, C^T = W_g @ A^T, so that W's
       rows fill wgmma's 64-row M side and the few tokens of a group its N side (BLOCK_M =
       16, 32 or 64 tokens per tile); each consumer takes BLOCK_N of the tile's features (with
       SWIGLU: the gate's or the up's BLOCK_N = 128).
    FAST_ACC (SA_ROWS = 0 only): no promotion, each consumer's K loop chains its wgmmas into
       one fp32 accumulator (torch._scaled_mm's use_fast_accum), up to 64 x 256 per consumer.
    PINGPONG (dense or GROUPED): each consumer computes every other tile whole (BLOCK_M = 64
       or 128 rows), their K loops in turns (mbarriers ``turn``), one's epilogue under the
       other's wgmmas.
    SPLIT: each consumer's share as two accumulators, each K block's halves issued and
       promoted in turn: BLOCK_N = 256 with a promoting loop (SB_COLS != 1), 64 x 256 as two
       128-column halves; or SPLIT_M, BLOCK_M = 256 (dense, promoting), 128 x BLOCK_N as two
       64-row halves. Both read fewer operand bytes per product than a 128 x 128 tile.
    K_GROUP: K blocks per unrolled group of the promoting K loop; STAGES: ring slots.
    """

    ACTIVATION: gl.constexpr
    SA_ROWS: gl.constexpr   # rows of A per K-block scale: 1, 128, or 0 (epilogue scales)
    SB_COLS: gl.constexpr   # columns of B per K-block scale: 1, 128, or 0
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    BLOCK_K: gl.constexpr
    GROUP_M: gl.constexpr
    STAGES: gl.constexpr
    K_GROUP: gl.constexpr
    GROUPED: gl.constexpr
    SWIGLU: gl.constexpr
    SWAP: gl.constexpr
    PINGPONG: gl.constexpr
    FAST_ACC: gl.constexpr
    TILE_N: gl.constexpr    # output columns per tile (both consumers' features with SWAP alone)
    SPLIT: gl.constexpr     # two accumulators per consumer
    SPLIT_M: gl.constexpr   # ... of 64 rows each (BLOCK_M = 256), else of 128 columns
    PART_N: gl.constexpr    # columns per accumulator (BLOCK_N, or half of it when split along N)
    ACC_ROWS: gl.constexpr  # rows of A one accumulator multiplies per tile (not SWAP)
    SHARE_M: gl.constexpr   # rows of the tile one consumer owns (not SWIGLU, PINGPONG, SWAP)

    @gluon.constexpr_function
    def __init__(self, ACTIVATION, SA_ROWS, SB_COLS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, K_GROUP, GROUPED,
                 SWIGLU, SWAP, PINGPONG, FAST_ACC):
        self.ACTIVATION = gl.constexpr(ACTIVATION)
        self.SA_ROWS = gl.constexpr(SA_ROWS)
        self.SB_COLS = gl.constexpr(SB_COLS)
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.BLOCK_K = gl.constexpr(BLOCK_K)
        self.GROUP_M = gl.constexpr(GROUP_M)
        self.STAGES = gl.constexpr(STAGES)
        self.K_GROUP = gl.constexpr(K_GROUP)
        self.GROUPED = gl.constexpr(GROUPED)
        self.SWIGLU = gl.constexpr(SWIGLU)
        self.SWAP = gl.constexpr(SWAP)
        self.PINGPONG = gl.constexpr(PINGPONG)
        self.FAST_ACC = gl.constexpr(FAST_ACC)
        self.TILE_N = gl.constexpr(_tile_n(self.BLOCK_N, self.SWIGLU, self.SWAP))
        self.SPLIT = gl.constexpr(_split(self.BLOCK_M, self.BLOCK_N, self.FAST_ACC))
        self.SPLIT_M = gl.constexpr(self.BLOCK_M.value > 2 * ROWS.value)
        self.PART_N = gl.constexpr(self.BLOCK_N.value // 2 if self.SPLIT.value and not self.SPLIT_M.value
                                   else self.BLOCK_N.value)
        self.ACC_ROWS = gl.constexpr(_consumer_rows(self.BLOCK_M, self.SWIGLU, self.PINGPONG))
        self.SHARE_M = gl.constexpr(2 * ROWS.value if self.SPLIT_M.value else ROWS.value)


@aggregate
class Ring:
    """The shared-memory ring the loader fills and the consumers read: STAGES slots of A
    [BLOCK_M, BLOCK_K] and W [B_TILE, BLOCK_K] K blocks, a ``ready`` mbarrier per slot (its TMA
    bytes landed) and an ``empty`` one (its readers are done). K block ``it`` of the program's
    walk sits in slot it % STAGES, filled for the (it // STAGES)-th time: one helper for a slot's
    index and phase."""

    a: gl.shared_memory_descriptor
    b: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, a, b, ready, empty, STAGES):
        self.a = a
        self.b = b
        self.ready = ready
        self.empty = empty
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def slot(self, it):
        """(slot, phase parity) of K block ``it``."""
        return it % self.STAGES, (it // self.STAGES) & 1

    @gluon.jit
    def wait_ready(self, it):
        """Wait until K block ``it`` has landed; returns its slot."""
        s, phase = self.slot(it)
        mbarrier.wait(self.ready.index(s), phase)
        return s

    @gluon.jit
    def wait_empty(self, it):
        """(the loader) Wait until K block ``it``'s slot is free; returns it. A fresh barrier has
        completed no phase, so a wait for parity 1 passes at once on the first round."""
        s, phase = self.slot(it)
        mbarrier.wait(self.empty.index(s), phase ^ 1)
        return s

    @gluon.jit
    def release(self, it):
        """This consumer is done reading K block ``it``."""
        mbarrier.arrive(self.empty.index(it % self.STAGES))


@aggregate
class Handoff:
    """What the two consumers hand each other: PINGPONG's K-loop turns (``turn``, one mbarrier
    per consumer) and SWIGLU's up product (``xchg``, an fp32 tile, with ``full`` / ``free``
    mbarriers; an 8 x 8 placeholder otherwise)."""

    turn: gl.shared_memory_descriptor
    xchg: gl.shared_memory_descriptor
    full: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, turn, xchg, full, free):
        self.turn = turn
        self.xchg = xchg
        self.full = full
        self.free = free

    @gluon.jit
    def take_turn(self, HALF: gl.constexpr, turns):
        """Wait for this consumer's turn to run a K loop (its ``turns``-th); HALF 0 goes first."""
        mbarrier.wait(self.turn.index(HALF), (turns & 1) ^ (1 - HALF))

    @gluon.jit
    def give_turn(self, HALF: gl.constexpr):
        mbarrier.arrive(self.turn.index(1 - HALF))

    @gluon.jit
    def send(self, acc, count):
        """(the up consumer) Hand its ``count``-th tile over."""
        mbarrier.wait(self.free, (count & 1) ^ 1)
        self.xchg.store(acc)
        mbarrier.arrive(self.full)

    @gluon.jit
    def receive(self, count, layout: gl.constexpr):
        """(the gate consumer) The up consumer's ``count``-th tile, in ``layout``."""
        mbarrier.wait(self.full, count & 1)
        up = self.xchg.load(layout)
        mbarrier.arrive(self.free)
        return up


@aggregate
class Staging:
    """A dense consumer's way out: C's TMA descriptor over [M, N] and its staging buffer
    [PARTS, rows, PART_N] in shared memory (0 and 0 for grouped tiles, which store through
    pointers)."""

    desc: tma.tensor_descriptor | gl.constexpr
    smem: gl.shared_memory_descriptor | gl.constexpr

    @gluon.constexpr_function
    def __init__(self, desc, smem):
        # (a constexpr_function receives the grouped placeholders as plain ints)
        self.desc = desc if isinstance(desc, tma.tensor_descriptor) else gl.constexpr(desc)
        self.smem = smem if isinstance(smem, gl.shared_memory_descriptor) else gl.constexpr(smem)


@aggregate
class TileAt:
    """Where a consumer's tile (with SPLIT: one of its two parts) sits: the group ``g``, the
    first row, the end of the group's rows (M for a dense tile), ``fill`` (``Groups.sched``'s:
    0 a product, 1 zeros, 2 NaN) and the first column."""

    g: gl.tensor | gl.constexpr
    off_m: gl.tensor | gl.constexpr
    row_end: gl.tensor | gl.constexpr
    fill: gl.tensor | gl.constexpr
    off_n: gl.tensor | gl.constexpr

    @gluon.constexpr_function
    def __init__(self, g, off_m, row_end, fill, off_n):
        # (a constexpr_function receives a dense tile's constant g and fill as plain ints)
        self.g = g if isinstance(g, gl.tensor) else gl.constexpr(g)
        self.off_m = off_m if isinstance(off_m, gl.tensor) else gl.constexpr(off_m)
        self.row_end = row_end if isinstance(row_end, gl.tensor) else gl.constexpr(row_end)
        self.fill = fill if isinstance(fill, gl.tensor) else gl.constexpr(fill)
        self.off_n = off_n if isinstance(off_n, gl.tensor) else gl.constexpr(off_n)


@aggregate
class ScaleIndex:
    """What ``_block_scales`` reads a K block's scales at: scale_b at the tile's group and first
    column block (``sb_ptr``), the accumulator's rows and columns with their masks, and its
    first row (a 128x128 scale_a's block)."""

    sb_ptr: gl.tensor | gl.constexpr
    rows: gl.tensor
    mask_m: gl.tensor
    off_m: gl.tensor | gl.constexpr
    cols: gl.tensor
    mask_n: gl.tensor

    @gluon.constexpr_function
    def __init__(self, sb_ptr, rows, mask_m, off_m, cols, mask_n):
        self.sb_ptr = sb_ptr if isinstance(sb_ptr, gl.tensor) else gl.constexpr(sb_ptr)  # None: no scale_b
        self.rows = rows
        self.mask_m = mask_m
        self.off_m = off_m if isinstance(off_m, gl.tensor) else gl.constexpr(off_m)
        self.cols = cols
        self.mask_n = mask_n


@gluon.jit
def _tile(tile, M, N, groups, t):
    """Output tile ``tile`` -> its ``TileAt``."""
    if t.GROUPED:
        pid_m, pid_n = swizzle_tile(tile, gl.load(groups.count), gl.cdiv(N, t.TILE_N), t.GROUP_M)
        entry = groups.sched + pid_m * 4
        return TileAt(gl.load(entry), gl.load(entry + 1), gl.load(entry + 2), gl.load(entry + 3), pid_n * t.TILE_N)
    else:
        pid_m, pid_n = swizzle_tile(tile, gl.cdiv(M, t.BLOCK_M), gl.cdiv(N, t.TILE_N), t.GROUP_M)
        return TileAt(0, pid_m * t.BLOCK_M, M, 0, pid_n * t.TILE_N)


@gluon.jit
def _num_tiles(M, N, groups, t):
    if t.GROUPED:
        return gl.load(groups.count) * gl.cdiv(N, t.TILE_N)
    else:
        return gl.cdiv(M, t.BLOCK_M) * gl.cdiv(N, t.TILE_N)


@gluon.jit
def _load_partition(a_desc, b_desc, ring, M, N, K, groups, t):
    """The TMA loader: every K block of every tile this program owns, in the consumers' order.
    SWIGLU: a slot holds the tile's gate rows of W, then its up rows (N further on); SWAP
    alone: the tile's 2 * BLOCK_N rows of W, one consumer's BLOCK_N after the other's."""
    num_tiles = _num_tiles(M, N, groups, t)
    k_blocks = gl.cdiv(K, t.BLOCK_K)
    TWO: gl.constexpr = t.SWIGLU or t.SWAP
    nbytes: gl.constexpr = a_desc.block_type.nbytes + (2 if TWO else 1) * b_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        at = _tile(tile, M, N, groups, t)
        g, off_m, fill, off_n = at.g, at.off_m, at.fill, at.off_n
        if groups.b_cols is None:
            w_row = g * groups.b_rows + off_n
            w_col = 0
        else:
            w_row = off_n
            w_col = g * groups.b_cols
        if fill == 0:
            for kb in range(k_blocks):
                s = ring.wait_empty(it)
                ready = ring.ready.index(s)
                mbarrier.expect(ready, nbytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, kb * t.BLOCK_K], ready, ring.a.index(s))
                if TWO:
                    b = ring.b.index(s)
                    tma.async_copy_global_to_shared(b_desc, [w_row, w_col + kb * t.BLOCK_K], ready,
                                                    b.slice(0, t.BLOCK_N, dim=0))
                    tma.async_copy_global_to_shared(b_desc, [w_row + (N if t.SWIGLU else t.BLOCK_N),
                                                             w_col + kb * t.BLOCK_K], ready,
                                                    b.slice(t.BLOCK_N, t.BLOCK_N, dim=0))
                else:
                    tma.async_copy_global_to_shared(b_desc, [w_row, w_col + kb * t.BLOCK_K], ready, ring.b.index(s))
                it += 1


@gluon.jit
def _block_scales(scales, at: ScaleIndex, kb, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr):
    """K block kb's scales of ``at``'s rows and columns: a vector for 1x128 / 128x1 blocks, a
    scalar where one 128-wide block covers the tile (128x128: BLOCK_M and BLOCK_N <= 128).
    SA_ROWS = 0 (epilogue scales): nothing is read, and ``_promote`` adds the block unscaled."""
    if SA_ROWS == 0:
        sa = 1.0
        sb = 1.0
    else:
        if SA_ROWS == 1:
            sa = gl.load(scales.a.ptr + at.rows.to(gl.int64) * scales.a.stride0 + kb * scales.a.stride1,
                         mask=at.mask_m, other=0.0)
        else:
            sa = gl.load(scales.a.ptr + (at.off_m // SA_ROWS) * scales.a.stride0 + kb * scales.a.stride1)
        if SB_COLS == 1:
            sb = gl.load(at.sb_ptr + kb * scales.b.stride0 + at.cols.to(gl.int64) * scales.b.stride1,
                         mask=at.mask_n, other=0.0)
        else:
            sb = gl.load(at.sb_ptr + kb * scales.b.stride0)
    return sa, sb


@gluon.jit
def _promote(acc, raw, sa, sb, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr, SWAP: gl.constexpr = False):
    """acc + raw * sa[rows] * sb[cols], with the two scale factors folded first where one is a
    scalar (one multiply-add per element). SWAP: the tile is transposed (W's rows by the
    tokens), so A's per-token scales run along its columns. SA_ROWS = 0: no K-block scales,
    the block is added as it is (promotion to fp32 alone)."""
    if SA_ROWS == 0:
        out = acc + raw
    elif SWAP:
        out = acc + raw * (sa * sb)[None, :]
    elif SB_COLS == 1:
        if SA_ROWS == 1:
            out = acc + raw * sa[:, None] * sb[None, :]
        else:
            out = acc + raw * (sb * sa)[None, :]
    else:
        if SA_ROWS == 1:
            out = acc + raw * (sa * sb)[:, None]
        else:
            out = acc + raw * (sa * sb)
    return out


@gluon.jit
def _operands(ring, it, HALF: gl.constexpr, t):
    """Wait for K block ``it`` and return this consumer's wgmma operands in its slot,
    (a [rows, BLOCK_K], b [BLOCK_K, cols]): its 64 rows of A (PINGPONG: all of them; SWIGLU:
    all 64, and the gate (HALF 0) or up (HALF 1) rows of W). SWAP: W's rows are the wgmma's M
    side and the tile's tokens its N side."""
    s = ring.wait_ready(it)
    if t.SWAP:
        a = ring.b.index(s).slice(HALF * t.BLOCK_N, t.BLOCK_N, dim=0)
        b = ring.a.index(s)
    elif t.SWIGLU:
        a = ring.a.index(s)
        b = ring.b.index(s).slice(HALF * t.BLOCK_N, t.BLOCK_N, dim=0)
    elif t.PINGPONG:
        a = ring.a.index(s)
        b = ring.b.index(s)
    else:
        a = ring.a.index(s).slice(HALF * ROWS, ROWS, dim=0)
        b = ring.b.index(s)
    return a, b.permute((1, 0))


@gluon.jit
def _issue(ring, it, HALF: gl.constexpr, t):
    """Start the wgmma of K block ``it`` on this consumer's part of the tile (``_operands``)
    into a fresh accumulator, to be promoted."""
    a, b = _operands(ring, it, HALF, t)
    # use_acc=False ignores the accumulator's value; a zeros tensor kept live across the loop
    # would hold 64 more registers per thread
    if t.SWAP:
        zero = gl.zeros([t.BLOCK_N, t.BLOCK_M], gl.float32, _acc_layout(t.BLOCK_M))
    else:
        zero = gl.zeros([t.ACC_ROWS, t.BLOCK_N], gl.float32, _acc_layout(t.BLOCK_N))
    return warpgroup_mma(a, b, zero, use_acc=False, is_async=True)


@gluon.jit
def _k_loop(acc, ring, it, k_blocks, scales, at: ScaleIndex, HALF: gl.constexpr, t):
    """One consumer's K loop over a tile: groups of K_GROUP blocks, unrolled: issue block j's
    wgmma, wait until only it is in flight, promote block j-1. Returns (acc, it)."""
    K_GROUP: gl.constexpr = t.K_GROUP
    groups = k_blocks // K_GROUP
    # Scales are loaded one K block ahead of their wgmma's issue (two ahead of their
    # promotion): an L2 round trip is about as long as one block's wgmma.
    last = k_blocks - 1
    sa_n, sb_n = _block_scales(scales, at, 0, t.SA_ROWS, t.SB_COLS)
    for g in range(groups):
        kb = g * K_GROUP
        sa, sb = sa_n, sb_n
        sa_n, sb_n = _block_scales(scales, at, gl.minimum(kb + 1, last), t.SA_ROWS, t.SB_COLS)
        raw = _issue(ring, it, HALF, t)
        for j in gl.static_range(1, K_GROUP):
            next_sa, next_sb = sa_n, sb_n
            sa_n, sb_n = _block_scales(scales, at, gl.minimum(kb + j + 1, last), t.SA_ROWS, t.SB_COLS)
            next_raw = _issue(ring, it + j, HALF, t)
            # block j - 1 is done once at most one wgmma (block j's) is in flight
            raw = warpgroup_mma_wait(num_outstanding=1, deps=(raw, ))
            ring.release(it + j - 1)
            acc = _promote(acc, raw, sa, sb, t.SA_ROWS, t.SB_COLS, t.SWAP)
            # Pass acc through a wait that lets block j run on: the promotion cannot then
            # sink below the next block's issue, where three raw tiles would be live (spills).
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            raw, sa, sb = next_raw, next_sa, next_sb
        raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw, ))
        ring.release(it + K_GROUP - 1)
        acc = _promote(acc, raw, sa, sb, t.SA_ROWS, t.SB_COLS, t.SWAP)
        it += K_GROUP
    for kb in range(groups * K_GROUP, k_blocks):  # the K blocks left over, one at a time
        sa, sb = sa_n, sb_n
        sa_n, sb_n = _block_scales(scales, at, gl.minimum(kb + 1, last), t.SA_ROWS, t.SB_COLS)
        raw = _issue(ring, it, HALF, t)
        raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw, ))
        ring.release(it)
        acc = _promote(acc, raw, sa, sb, t.SA_ROWS, t.SB_COLS, t.SWAP)
        it += 1
    return acc, it


@gluon.jit
def _k_loop_chained(acc, ring, it, k_blocks, HALF: gl.constexpr, t):
    """One consumer's K loop without promotion (FAST_ACC: no K-block scales, the whole K summed
    in the tensor core's accumulator): each block's wgmma adds into ``acc`` and runs while the
    next block's is issued; a slot is released once the wgmma after it has started."""
    a, b = _operands(ring, it, HALF, t)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # a loop-carried tensor, still in flight
    for kb in range(1, k_blocks):
        a, b = _operands(ring, it + kb, HALF, t)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # block kb - 1 is done once at most one wgmma (block kb's) is in flight
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        ring.release(it + kb - 1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    ring.release(it + k_blocks - 1)
    return acc, it + k_blocks


@gluon.jit
def _part_scales(scales, sb_ptr, kb, p: gl.constexpr, at: TileAt, N, t):
    """K block kb's scales (``_block_scales``) of accumulator ``p``, at (at.off_m, at.off_n)."""
    if t.SB_COLS > 1 and not t.SPLIT_M:  # 128x128 scale_b: the second half's column block is the next one
        sb_ptr += p * scales.b.stride1
    layout: gl.constexpr = _acc_layout(t.PART_N)
    rows = at.off_m + gl.arange(0, t.ACC_ROWS, layout=gl.SliceLayout(1, layout))
    cols = at.off_n + gl.arange(0, t.PART_N, layout=gl.SliceLayout(0, layout))
    index = ScaleIndex(sb_ptr, rows, rows < at.row_end, at.off_m, cols, cols < N)
    return _block_scales(scales, index, kb, t.SA_ROWS, t.SB_COLS)


@gluon.jit
def _issue_part(ring, s, p: gl.constexpr, HALF: gl.constexpr, t):
    """Start the wgmma of accumulator ``p``'s product in ring slot ``s`` into a fresh
    accumulator: rows HALF * 128 + p * 64 of A (SPLIT_M), or W's p-th 128 rows."""
    if t.SPLIT_M:
        a = ring.a.index(s).slice((2 * HALF + p) * ROWS, ROWS, dim=0)
        b = ring.b.index(s)
    else:
        a = ring.a.index(s).slice(HALF * ROWS, ROWS, dim=0)
        b = ring.b.index(s).slice(p * t.PART_N, t.PART_N, dim=0)
    zero = gl.zeros([t.ACC_ROWS, t.PART_N], gl.float32, _acc_layout(t.PART_N))
    return warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _part_at(at: TileAt, p: gl.constexpr, t):
    """``at`` moved to accumulator ``p`` (0 or 1) of a SPLIT consumer: 64 rows down (SPLIT_M)
    or PART_N columns along."""
    if t.SPLIT_M:
        return TileAt(at.g, at.off_m + p * ROWS, at.row_end, at.fill, at.off_n)
    else:
        return TileAt(at.g, at.off_m, at.row_end, at.fill, at.off_n + p * t.PART_N)


@gluon.jit
def _k_loop_split(acc0, acc1, ring, it, k_blocks, scales, sb_ptr, at: TileAt, N, HALF: gl.constexpr, t):
    """One consumer's promoting K loop over its share held as two accumulators (SPLIT; at:
    the consumer's first row): per K block, each half's wgmma, then its promotion. A
    warpgroup keeps one raw half live, not two, so it waits for each wgmma before promoting:
    the other consumer's wgmmas keep the tensor cores busy meanwhile. Each half's scales are
    read while its wgmma runs (a K block ahead they held registers that spilled). Returns
    (acc0, acc1, it)."""
    at1 = _part_at(at, 1, t)
    for kb in range(k_blocks):
        s = ring.wait_ready(it)
        raw = _issue_part(ring, s, 0, HALF, t)
        sa, sb = _part_scales(scales, sb_ptr, kb, 0, at, N, t)  # read under the wgmma
        raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw, ))
        acc0 = _promote(acc0, raw, sa, sb, t.SA_ROWS, t.SB_COLS)
        # pinned here: promoted below the next issue, two raw halves would be live (spills)
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, ))
        raw = _issue_part(ring, s, 1, HALF, t)
        sa, sb = _part_scales(scales, sb_ptr, kb, 1, at1, N, t)
        raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw, ))
        ring.release(it)
        acc1 = _promote(acc1, raw, sa, sb, t.SA_ROWS, t.SB_COLS)
        acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, ))
        it += 1
    return acc0, acc1, it


@triton.constexpr_function
def _store_layout(block_n, dtype):
    # 16 bytes per thread along a row: the accumulator's layout holds 2 adjacent elements
    vec = 128 // dtype.primitive_bitwidth
    tn = min(32, block_n // vec)
    return gl.BlockedLayout([1, vec], [32 // tn, tn], [4, 1], [1, 0])


@gluon.jit
def _store_rows(C, acc, off_m, off_n, row_end, N, scatter):
    """C[row, off_n:] = acc for the tile's rows off_m.. below ``row_end`` (C row scatter[row]
    when scattered), through pointers: a grouped tile's rows past its group belong to the
    next group (or to another C row), which TMA's clipping cannot see. The tile is moved to
    a layout of 16-byte stores first."""
    BLOCK_N: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = _store_layout(BLOCK_N, C.ptr.dtype.element_ty)
    val = gl.convert_layout(acc.to(C.ptr.dtype.element_ty), layout)
    rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    mask_m = rows < row_end
    out_rows = rows
    if scatter is not None:
        out_rows = gl.load(scatter + rows, mask=mask_m, other=0)
    ptrs = C.ptr + out_rows.to(gl.int64)[:, None] * C.stride0 + cols.to(gl.int64)[None, :] * C.stride1
    gl.store(ptrs, val, mask=mask_m[:, None] & (cols < N)[None, :])


# tiles.quantize_tile's 1x128 rule for one block per row: its reshape and arange take no Gluon
# layouts, and a row form shared with it changed the Triton body's SASS (tools/ptx_snapshot.py).
@gluon.jit
def _quantize_rows(h, S, out_rows, off_n, N, mask_m, mask_n, dtype: gl.constexpr):
    """h [rows, 128] -> its fp8 values (core/fp8.py ``fp8_cast``) with one scale per row
    (core/fp8.py's rule, quantize_fp8's 1x128 blocks), stored at S[out_rows, off_n / 128].
    Columns past N are zeroed first: they must not set an amax."""
    h = gl.where(mask_n[None, :], h, 0.0)
    scale = fp8_scale(gl.max(amax_input(h), axis=1), dtype)
    gl.store(S.ptr + out_rows.to(gl.int64) * S.stride0 + (off_n // _SCALE_BLOCK) * S.stride1, scale, mask=mask_m)
    return fp8_cast(h, scale[:, None], dtype)


@gluon.jit
def _consume_partition(ring, handoff, out, C, M, N, K, scales, bias, groups, HALF: gl.constexpr, t):
    """One consumer warpgroup: its part of every tile, K loop and epilogue. Its part: rows
    HALF * 64 .. HALF * 64 + 63; with SWIGLU all 64 rows, HALF 0 the gate and HALF 1 the up
    product; with SWAP all BLOCK_M rows (tokens) and BLOCK_N features (the HALF-th BLOCK_N of
    the tile's; with SWIGLU the gate's or the up's), computed transposed. PINGPONG: every
    other tile whole (HALF 0 the program's even tiles), the other consumer's K blocks passed
    over in the ring's count; the two K loops take turns (``handoff.turn``), so that one's
    epilogue runs under the other's wgmmas and neither waits for a slot's fill more than one
    phase ahead (an mbarrier's parity cannot tell two phases apart)."""
    # What the epilogue reads, one argument below here. Built inside the partition: a tuple
    # captured by warp_specialize turns its constant elements (a stride of 1) into runtime ones.
    io = (C, scales, bias, groups)
    num_tiles = _num_tiles(M, N, groups, t)
    k_blocks = gl.cdiv(K, t.BLOCK_K)
    it = 0
    swaps = 0  # SWIGLU: tiles whose up product went through ``handoff.xchg``
    local = 0  # PINGPONG: this program's tiles so far
    turns = 0  # PINGPONG: this consumer's tiles so far
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        at = _tile(tile, M, N, groups, t)
        owner = local % 2 if t.PINGPONG else HALF
        local += 1
        if owner != HALF:
            if at.fill == 0:
                it += k_blocks  # the other consumer's tile: its K blocks go by in the ring
        else:
            it, swaps, turns = _consume_tile(ring, handoff, out, io, N, at, k_blocks, it, swaps, turns, HALF, t)
    if not t.GROUPED:
        tma.store_wait(pendings=0)


@gluon.jit
def _consume_tile(ring, handoff, out, io, N, at: TileAt, k_blocks, it, swaps, turns, HALF: gl.constexpr, t):
    """This consumer's part of one tile (``_tile``'s ``at``): its K loop from ring block ``it``,
    the SwiGLU hand-over, the epilogue and store. ``io``: (C, scales, bias, groups), the
    kernel's arguments. Returns the ring count, SWIGLU's hand-overs and PINGPONG's turns after it."""
    scales, groups = io[1], io[3]
    g, off_m, row_end, fill, off_n = at.g, at.off_m, at.row_end, at.fill, at.off_n
    if t.SWAP:  # the accumulator is [features, tokens]
        layout: gl.constexpr = _acc_layout(t.BLOCK_M)
        ACC_M: gl.constexpr = t.BLOCK_N
        ACC_N: gl.constexpr = t.BLOCK_M
        if not t.SWIGLU:
            off_n = off_n + HALF * t.BLOCK_N  # this consumer's features
        # the scales' index vectors follow the tokens, the accumulator's columns
        rows = off_m + gl.arange(0, t.BLOCK_M, layout=gl.SliceLayout(0, layout))
        cols = off_n + gl.arange(0, t.BLOCK_N, layout=gl.SliceLayout(1, layout))
    else:
        layout: gl.constexpr = _acc_layout(t.PART_N)
        ACC_M: gl.constexpr = t.ACC_ROWS
        ACC_N: gl.constexpr = t.PART_N
        if not (t.SWIGLU or t.PINGPONG):
            off_m = off_m + HALF * t.SHARE_M
        rows = off_m + gl.arange(0, ACC_M, layout=gl.SliceLayout(1, layout))
        cols = off_n + gl.arange(0, t.PART_N, layout=gl.SliceLayout(0, layout))
    mask_m = rows < row_end
    mask_n = cols < N
    acc = gl.zeros([ACC_M, ACC_N], gl.float32, layout)
    if t.SPLIT:  # the tile's second 128 columns
        acc1 = gl.zeros([ACC_M, ACC_N], gl.float32, layout)
    if t.PINGPONG:
        handoff.take_turn(HALF, turns)
    if fill == 0:
        if t.FAST_ACC:
            acc, it = _k_loop_chained(acc, ring, it, k_blocks, HALF, t)
        else:
            # the tile's scale_b: its group's, and with SWIGLU the up rows' blocks after the gate's
            sb_ptr = scales.b.ptr
            if t.SB_COLS > 1:
                sb_col = off_n // t.SB_COLS
                if t.SWIGLU:
                    sb_col += HALF * gl.cdiv(N, t.SB_COLS)
                sb_ptr += sb_col * scales.b.stride1
            if t.GROUPED and t.SB_COLS > 0:
                sb_ptr += g.to(gl.int64) * groups.scale_b_g
            if t.SPLIT:
                acc, acc1, it = _k_loop_split(acc, acc1, ring, it, k_blocks, scales, sb_ptr,
                                              TileAt(g, off_m, row_end, fill, off_n), N, HALF, t)
            else:
                index = ScaleIndex(sb_ptr, rows, mask_m, off_m, cols, mask_n)
                acc, it = _k_loop(acc, ring, it, k_blocks, scales, index, HALF, t)
    elif fill == 2:
        acc = gl.full([ACC_M, ACC_N], float("nan"), gl.float32, layout)
        if t.SPLIT:
            acc1 = gl.full([ACC_M, ACC_N], float("nan"), gl.float32, layout)
    if t.PINGPONG:  # the other consumer's K loop may start
        handoff.give_turn(HALF)
        turns += 1
    if t.SWIGLU:
        if fill == 0:
            if HALF == 1:  # hand the up product to the gate's warpgroup
                handoff.send(acc, swaps)
            else:
                acc = activate(acc, "silu") * handoff.receive(swaps, layout)
            swaps += 1
    # (grouped tiles store through pointers: no staging buffer)
    at = TileAt(g, off_m, row_end, fill, off_n)  # this consumer's part
    _epilogue_store(acc, io, out.desc, out.smem if t.GROUPED else out.smem.index(0), at, N, HALF, t, True)
    if t.SPLIT:
        _epilogue_store(acc1, io, out.desc, out.smem if t.GROUPED else out.smem.index(1), _part_at(at, 1, t), N,
                        HALF, t, False)
    return it, swaps, turns


@gluon.jit
def _epilogue_store(acc, io, c_desc, c_smem, at: TileAt, N, HALF: gl.constexpr, t, FIRST: gl.constexpr):
    """The epilogue and store of this consumer's accumulator ``acc`` (one part of its tile
    with SPLIT), whose element [0, 0] is C's [at.off_m, at.off_n]: core's epilogue, then a TMA
    store through ``c_smem`` (dense; FIRST: the tile's first part waits for the last tile's
    stores), or masked pointer stores of the group's rows (GROUPED; fill tiles as they are)."""
    C, scales, bias, groups = io
    g, off_m, row_end, fill, off_n = at.g, at.off_m, at.row_end, at.fill, at.off_n
    if t.SWAP:  # back to [tokens, features]: a register relabelling, no data moves
        acc = gl.permute(acc, (1, 0))
    layout: gl.constexpr = acc.type.layout
    rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    mask_m = rows < row_end
    mask_n = cols < N
    if t.GROUPED:
        if HALF == 0 or not t.SWIGLU:
            out_rows = rows
            if groups.scatter is not None:
                out_rows = gl.load(groups.scatter + rows, mask=mask_m, other=0)
            if fill == 0:  # a filled tile (rows past the last offset, bad offs) is stored as it is
                # group g's bias and per-column scales ([G, 1, N] row-wise scale_b); a jit
                # helper cannot return an absent vector's None, so these stay inline
                g64 = g.to(gl.int64)
                bias_g = Vector(None if bias.ptr is None else bias.ptr + g64 * groups.bias_g, bias.stride)
                sn = scales.n
                sn_g = Vector(None if sn.ptr is None else sn.ptr + g64 * groups.scale_b_g, sn.stride)
                acc = epilogue(acc, rows, cols, mask_m, mask_n, t.ACTIVATION,
                               Scales(scales.a, scales.b, scales.m, sn_g, scales.out), bias_g, groups.weight, out_rows)
            if scales.out.ptr is not None:
                acc = _quantize_rows(acc, scales.out, out_rows, off_n, N, mask_m, mask_n, C.ptr.dtype.element_ty)
            _store_rows(C, acc, off_m, off_n, row_end, N, groups.scatter)
    else:
        acc = epilogue(acc, rows, cols, mask_m, mask_n, t.ACTIVATION, scales, bias)
        if FIRST:
            tma.store_wait(pendings=0)  # the previous tile's stores have left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)  # clipped at M and N


@gluon.jit
def blockscaled_wgmma_kernel(A, B, C, M, N, K, scales, bias, groups,
                             ACTIVATION: gl.constexpr, SA_ROWS: gl.constexpr, SB_COLS: gl.constexpr,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                             K_GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             GROUPED: gl.constexpr = False, SWIGLU: gl.constexpr = False,
                             SWAP: gl.constexpr = False, PINGPONG: gl.constexpr = False,
                             FAST_ACC: gl.constexpr = False, LOADER_REGS: gl.constexpr = 40):
    """C = epilogue(sum over K blocks of (A_k @ B_k) * scale_a_k * scale_b_k), on sm_90.

    A: Operand over fp8 [M, K] with stride1 == 1 (row-major), 16-byte aligned rows.
    B: Operand over fp8 [K, N] with stride0 == 1: the transpose of a K-major weight W [N, K],
       which the kernel reads as W (rows of stride B.stride1), the layout fp8 wgmma takes.
       GROUPED: W is [G * groups.b_rows, K] (experts stacked), group g's rows from g * b_rows;
       with groups.b_cols, [b_rows, G * K] (experts side by side), group g's columns from g * K.
    C: Operand over [M, N] (bf16, fp16, fp32; fp8 with scales.out) with stride1 == 1. Dense:
       16-byte aligned rows, tiles leave through TMA stores, which clip at M and N. GROUPED:
       masked pointer stores of each group's rows (scattered by groups.scatter).
    scales: core's Scales. .a: Operand over scale_a [M or ceil(M/128), ceil(K/128)] (SA_ROWS
       rows per scale: 1 or 128); .b: Operand over scale_b [ceil(K/128), N or ceil(N/128)]
       (SB_COLS = 1 or 128; GROUPED: group g's at + g * groups.scale_b_g); or SA_ROWS =
       SB_COLS = 0 and no .a / .b: scales only in the epilogue. .m / .n: epilogue Vectors
       over C's rows / columns (GROUPED: .n is group g's at + g * groups.scale_b_g); .out:
       Operand over C's own 1x128 scales [M, ceil(N/128)] (written; GROUPED).
    bias: Vector over [N] (GROUPED: group g's at + g * groups.bias_g) or a None pointer.
    groups: Groups (GROUPED) or DENSE. ACTIVATION as tiles.activate.
    The options (SWIGLU, SWAP, FAST_ACC, PINGPONG, SPLIT, K_GROUP, STAGES): ``Tiling``.
    BLOCK_M = 128 (two 64-row consumers; 64 with SWIGLU; tokens with SWAP; 256 with SPLIT_M), BLOCK_K = 128
    (one scale block per K step); BLOCK_N <= 128 per accumulator when SB_COLS = 128.
    CONSUMER_REGS, LOADER_REGS: registers per thread of the worker consumer and of the loader
    (the default consumer gets what the register file leaves).
    Grid: (min(tiles, SMs),); each program walks tiles pid, pid + grid, ... in GROUP_M order.
    """
    gl.static_assert(SWAP or PINGPONG or BLOCK_M == (1 if SWIGLU else 2) * ROWS or BLOCK_M == 4 * ROWS)
    gl.static_assert(not PINGPONG or ((BLOCK_M == ROWS or BLOCK_M == 2 * ROWS) and not (SWIGLU or SWAP)))
    gl.static_assert(GROUPED or not SWAP)
    gl.static_assert(BLOCK_K == _SCALE_BLOCK)
    gl.static_assert((SA_ROWS == 0) == (SB_COLS == 0))  # block scales on both operands, or on neither
    gl.static_assert(not FAST_ACC or SA_ROWS == 0)  # block scales need their promotion
    gl.static_assert(SA_ROWS <= 1 or SA_ROWS % min(BLOCK_M, 2 * ROWS) == 0)  # an accumulator's rows share a scale
    gl.static_assert(SB_COLS <= 1 or SB_COLS % min(BLOCK_N, 128) == 0)
    gl.static_assert(not _split(BLOCK_M, BLOCK_N, FAST_ACC) or not (SWIGLU or SWAP or PINGPONG))
    gl.static_assert(BLOCK_M <= 2 * ROWS or (BLOCK_M == 4 * ROWS and BLOCK_N <= 128 and not FAST_ACC))
    gl.static_assert(BLOCK_N <= 128 or FAST_ACC or (BLOCK_N == 256 and SB_COLS != 1))
    gl.static_assert(GROUPED or not SWIGLU)
    t = Tiling(ACTIVATION, SA_ROWS, SB_COLS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, K_GROUP, GROUPED, SWIGLU, SWAP,
               PINGPONG, FAST_ACC)
    a_desc, b_desc, ring = _ring(A, B, M, K, groups, t)
    handoff = _handoff(t)
    if GROUPED:  # grouped tiles store through pointers: no C descriptor or staging tiles
        out0 = Staging(0, 0)
        out1 = Staging(0, 0)
    else:
        out0, out1 = _staging(C, M, N, t)
    gl.warp_specialize([
        (_consume_partition, (ring, handoff, out0, C, M, N, K, scales, bias, groups, 0, t)),
        (_consume_partition, (ring, handoff, out1, C, M, N, K, scales, bias, groups, 1, t)),
        (_load_partition, (a_desc, b_desc, ring, M, N, K, groups, t)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _ring(A, B, M, K, groups, t):
    """A's and W's TMA descriptors and the ring's slots and barriers (``Ring``)."""
    dtype: gl.constexpr = A.ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([t.BLOCK_M, t.BLOCK_K], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([t.BLOCK_N, t.BLOCK_K], B.ptr.dtype.element_ty)
    a_desc = tma.make_tensor_descriptor(A.ptr, [M, K], [A.stride0, 1], [t.BLOCK_M, t.BLOCK_K], a_layout)
    if groups.b_cols is None:
        b_desc = tma.make_tensor_descriptor(B.ptr, [groups.G * groups.b_rows, K], [B.stride1, 1],
                                            [t.BLOCK_N, t.BLOCK_K], b_layout)
    else:
        b_desc = tma.make_tensor_descriptor(B.ptr, [groups.b_rows, groups.G * groups.b_cols], [B.stride1, 1],
                                            [t.BLOCK_N, t.BLOCK_K], b_layout)
    B_TILE: gl.constexpr = (2 if t.SWIGLU or t.SWAP else 1) * t.BLOCK_N
    a_bufs = gl.allocate_shared_memory(dtype, [t.STAGES, t.BLOCK_M, t.BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(B.ptr.dtype.element_ty, [t.STAGES, B_TILE, t.BLOCK_K], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [t.STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [t.STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(t.STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1 if t.PINGPONG else 2)  # one arrival per consumer reading it
    return a_desc, b_desc, Ring(a_bufs, b_bufs, ready, empty, t.STAGES)


@gluon.jit
def _handoff(t):
    """PINGPONG's turn barriers and SWIGLU's fp32 up tile with its barriers (``Handoff``)."""
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for h in gl.static_range(2):
        mbarrier.init(turn.index(h), count=1)
    full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(full, count=1)
    mbarrier.init(free, count=1)
    XROWS: gl.constexpr = (t.BLOCK_N if t.SWAP else ROWS) if t.SWIGLU else 8  # an 8 x 8 placeholder otherwise
    XCOLS: gl.constexpr = (t.BLOCK_M if t.SWAP else t.BLOCK_N) if t.SWIGLU else 8
    xchg = gl.allocate_shared_memory(gl.float32, [XROWS, XCOLS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return Handoff(turn, xchg, full, free)


@gluon.jit
def _staging(C, M, N, t):
    """Each dense consumer's way out (``Staging``): C's descriptor and a buffer for its
    accumulators (two with SPLIT), stored by TMA."""
    out_dtype: gl.constexpr = C.ptr.dtype.element_ty
    PARTS: gl.constexpr = 2 if t.SPLIT else 1
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([t.ACC_ROWS, t.PART_N], out_dtype)
    c_desc = tma.make_tensor_descriptor(C.ptr, [M, N], [C.stride0, 1], [t.ACC_ROWS, t.PART_N], c_layout)
    out0 = Staging(c_desc, gl.allocate_shared_memory(out_dtype, [PARTS, t.ACC_ROWS, t.PART_N], c_layout))
    out1 = Staging(c_desc, gl.allocate_shared_memory(out_dtype, [PARTS, t.ACC_ROWS, t.PART_N], c_layout))
    return out0, out1


# ---------------------------------------------------------------------------- host side

BLOCKSCALED_WGMMA = Launcher(blockscaled_wgmma_kernel, "blockscaled_wgmma")

def on_sm90(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 GPU and kernels compile for it (not the interpreter)."""
    return not INTERPRET and t.is_cuda and capability(t.get_device()) == (9, 0)


def k_major_layout(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether TMA can read a [M, K] and b [K, N] K-major and write c [M, N] row-major: the
    only layout this body takes (fp8 wgmma reads both operands K-major from shared memory)."""
    layout = tma_layout(a, b, c)
    return layout is not None and layout.a_k_contig and layout.b_k_contig and a.shape[1] > 0


def k_loop_meta(scaling: Scaling, fast_accum: bool = False) -> dict:
    """The body's constexprs for a scaling: SA_ROWS / SB_COLS rows and columns per K-block
    scale, 0 for epilogue scales (tensor, row, column, or none), whose K loop only promotes
    each block to fp32, or with FAST_ACC sums the whole K in the tensor core."""
    if scaling.a_per_k_block:
        return dict(SA_ROWS=scaling.sa_rows, SB_COLS=scaling.sb_cols, FAST_ACC=False)
    return dict(SA_ROWS=0, SB_COLS=0, FAST_ACC=fast_accum)


def uses_gluon_body(a, b, c, scaling: Scaling, tma: bool | None, config) -> bool:
    """The one decision between core's two bodies of a scaled FP8 GEMM: this Gluon body on an
    sm_90 GPU for block scales on both operands (1x128 or 128x128 scale_a, 128x1 or 128x128
    scale_b) or on neither (tensor or row-wise scale_a, tensor or column-wise scale_b: the
    epilogue's), TMA-readable K-major operands and M >= hopper_configs.WGMMA_MIN_M; core's Triton
    body otherwise (other GPUs, the interpreter, mixed granularities and other layouts, tma=False).

    A forced ``config`` decides by its kind (hopper_configs.is_wgmma); a Gluon config on operands
    this body cannot take is a ValueError naming what stands in the way.
    """
    if config is not None and not hopper_configs.is_wgmma(config):
        return False
    if config is None and a.shape[0] < hopper_configs.WGMMA_MIN_M:
        return False  # decode-sized calls: decided before the layout checks, off their host time
    why = None
    if not on_sm90(a):
        why = "an sm_90 GPU (Triton's interpreter and other GPUs run core's Triton body)"
    elif scaling.a_per_k_block != scaling.b_per_k_block:
        why = (f"block scales on both operands (scale_a 1x128 or 128x128, scale_b 128x1 or 128x128) or on neither "
               f"(tensor / row-wise scale_a, tensor / column-wise scale_b; got {scaling.a}, {scaling.b})")
    elif tma is False:
        why = "TMA loads (tma=False asks for pointer loads)"
    elif not k_major_layout(a, b, c):
        why = ("K-major a [M, K] and b = W.t() with 16-byte aligned rows, K > 0, and an output row of a multiple "
               "of 16 bytes")
    if config is None:
        return why is None
    if why is not None:
        raise checks.bad_value("config", f"a Triton-body config: the Gluon body (K_GROUP) needs {why}", configs.label(config))
    return True


def wgmma_launch(a, b, c, bias, activation, key: hopper_configs.WgmmaKey, scales, config=None, scale_a=None,
                 scale_b=None) -> Launch:
    """This body's launch for operands shaped like a, b, c (``uses_gluon_body`` accepted them):
    a core/dispatch.py Launch whose builder takes (c, a, b, scale_a, scale_b, bias).
    ``key``: the call's WgmmaKey (tuning tables; its scaling and fast_accum set the K loop,
    ``k_loop_meta``). ``scales(scale_a, scale_b)`` -> tiles.Scales: block scales as .a / .b,
    epilogue scales as .m / .n. scale_a, scale_b: the call's scales, for autotuning's trials."""
    M, K = a.shape
    N = b.shape[1]

    def build(c, a, b, scale_a, scale_b, bias):
        return (Operand(a, *a.stride()), Operand(b, *b.stride()), Operand(c, *c.stride()), M, N, K,
                scales(scale_a, scale_b), NO_VECTOR if bias is None else Vector(bias, bias.stride(0)),
                Groups(None, None, 1, N, 0, 0))

    def launch_of(plan):
        tiles = cdiv(M, plan.meta["BLOCK_M"]) * cdiv(N, plan.meta["BLOCK_N"])
        return Launch(BLOCKSCALED_WGMMA, plan, (min(tiles, sm_count(plan.device_index)),), build)

    plan = BLOCKSCALED_WGMMA.plan_for(Request(
        key, dict(ACTIVATION=activation, **k_loop_meta(key.scaling, key.fast_accum)), a.device, config,
        lambda plan: launch_of(plan).run(c, a, b, scale_a, scale_b, bias)))
    return launch_of(plan)
