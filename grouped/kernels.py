"""The grouped kernels: core's tile body (core/tiles.py gemm_tile) on per-group operands.

Two GEMM kernels; nothing here re-implements a K loop, an epilogue or a store.

* ``ragged_kernel``: torch._grouped_mm's four modes and the two MoE expert GEMMs. One dimension
  (M, N or K) is cut into G groups by ``offs`` (int32 cumulative END offsets), or none is
  (3D x 3D). The offsets stay on the device: the host never learns the group sizes, so the grid
  is an UPPER BOUND on the number of tiles (``tile_bound``: every non-empty group adds at most
  one partial tile, and at most min(G + 1, total) groups are non-empty) and each program finds
  its group from ``offs`` itself (``locate_tile``). That keeps the call free of host syncs and
  CUDA-graph capturable: the grid depends only on shapes.
* ``list_kernel``: list mode, every pair its own (M, N, K), read from device arrays of
  pointers, sizes and strides; a persistent walk over all tiles of all groups.

Where the operands allow it (row-major, 16-byte aligned group bases), the ragged kernel takes
core's TMA flavour with descriptors per group: their shape is the group's, so the TMA unit
zero-fills and clips at group edges exactly where the pointer flavour masks.

The memory-bound helpers around the MoE GEMMs: ``moe_prep_kernel`` (at decode sizes the routing
sort, x's rows in expert order and the row-tile tables, one launch); for core's Gluon FP8 body (core/hopper_fp8.py, its grouped flavour)
``row_tiles_kernel`` (the groups' row tiles, from offs on the device), ``gather_quantize_kernel``
(x quantised once per pair in expert order: TMA cannot gather rows) and ``combine_kernel``
(the top-k sum that skips other ranks' slots); ``route_kernel`` (fused routing at decode);
``swiglu_backward_kernel`` (the expert FFN's activation backward, one pass over its rows).
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from ..core.fp8 import amax_input, fp8_cast, fp8_scale
from ..core.scaling import SCALE_BLOCK
from ..core.tiles import (
    NO_OPERAND,
    NO_VECTOR,
    Fill,
    GroupK,
    Operand,
    Routing,
    Scales,
    SplitK,
    TileSpec,
    Vector,
    gemm_tile,
    make_operands,
    program_units,
    swizzle_tile,
)


class Stacked(NamedTuple):
    """G matrices in one tensor: element [g, i, j] at ptr + g*stride_g + i*stride0 + j*stride1
    (stride_g 0: one 2-D operand, which ``offs`` cuts into groups)."""

    ptr: Any
    stride_g: Any
    stride0: Any
    stride1: Any


_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


def grouped_scales(a=None, m=None, b=None, n=None, out=None) -> Scales:
    """ragged_kernel's ``scales`` from fp32 tensors, None where absent (docstring there):
    a [rows, ceil(K/128)] and out [rows, ceil(N/128)] as Operands, m [rows] a Vector, b
    [G, ceil(K/128), ceil(N/128)] a Stacked, n [G, N] an Operand. An absent one gets a
    placeholder of the same layout, so the kernel moves every field to its group alike."""
    return Scales(a=NO_OPERAND if a is None else Operand(a, *a.stride()),
                  b=Stacked(None, 0, 0, 0) if b is None else Stacked(b, *b.stride()),
                  m=NO_VECTOR if m is None else Vector(m, m.stride(0)),
                  n=NO_OPERAND if n is None else Operand(n, *n.stride()),
                  out=NO_OPERAND if out is None else Operand(out, *out.stride()))


NO_GROUPED_SCALES = grouped_scales()  # what an unscaled grouped GEMM passes



@triton.jit
def find_group(tile, tiles, idx):
    """Group of ``tile`` given each group's tile count ``tiles`` (vector indexed by ``idx``).

    Returns (g, first): the group whose tiles cover ``tile`` (groups are laid out one after the
    other) and the id of its first tile. A tile past the last group gets g = the first index
    whose running count is not exceeded, so callers check ``tile < tl.sum(tiles)``.
    """
    cum = tl.cumsum(tiles, 0)
    g = tl.sum((cum <= tile).to(tl.int32))
    first = tl.sum(tl.where(idx == g, cum - tiles, 0))
    return g, first


@triton.jit
def group_spans(offs, G, total, G_BLOCK: tl.constexpr):
    """(idx, starts, sizes, bad) of the G groups of ``offs`` plus the TAIL group G.

    offs: a Vector; offs[g] is at offs.ptr + g * offs.stride (a strided view is read in place).
    Group g spans [offs[g-1], offs[g]) (offs[-1] := 0); the tail group G spans
    [offs[G-1], total): the rows (or columns) past the last offset, whose output is zero.
    Entries past G are empty. ``bad``: offs decrease, start below 0 or pass ``total``: the host
    does not check offs values without a sync, so the kernel must never trust them.
    """
    idx = tl.arange(0, G_BLOCK)
    ends = tl.load(offs.ptr + idx * offs.stride, mask=idx < G, other=0)
    ends = tl.where(idx < G, ends, total)
    starts = tl.load(offs.ptr + (idx - 1) * offs.stride, mask=(idx >= 1) & (idx <= G), other=0)
    starts = tl.where(idx <= G, starts, total)
    sizes = ends - starts
    bad = tl.sum((sizes < 0).to(tl.int32)) > 0
    return idx, starts, sizes, bad


@triton.jit
def locate_tile(tile, offs, G, total, TILE: tl.constexpr, G_BLOCK: tl.constexpr):
    """Tile ``tile`` (of TILE rows or columns) of the ragged dimension -> (g, start, size,
    local tile, valid, bad).

    Tiles are numbered group after group, cdiv(size_g, TILE) per group, tail group last.
    With bad offs the whole dimension becomes one tail group (filled with NaN by the caller).
    """
    idx, starts, sizes, bad = group_spans(offs, G, total, G_BLOCK)
    starts = tl.where(bad, 0, starts)
    sizes = tl.where(bad, tl.where(idx == G, total, 0), sizes)
    tiles = (sizes + TILE - 1) // TILE
    g, first = find_group(tile, tiles, idx)
    start = tl.sum(tl.where(idx == g, starts, 0))
    size = tl.sum(tl.where(idx == g, sizes, 0))
    return g, start, size, tile - first, tile < tl.sum(tiles), bad


@triton.jit
def tile_bound(total, BLOCK: tl.constexpr, G):
    """An upper bound on the tiles of BLOCK that ``locate_tile`` numbers over ``total`` rows (or
    columns) cut into G groups and the tail: each non-empty group, of at most min(G + 1, total),
    adds at most one partial tile to cdiv(total, BLOCK). A decode step's few pairs over many
    experts get a grid of the tiles they can have, not one row of programs per expert.
    ``ops.tile_bound`` is the host's copy of the rule."""
    return tl.cdiv(total, BLOCK) + tl.minimum(G + 1, tl.maximum(total, 1))


@triton.jit
def _ragged_tile(pid, offs, G, M, N, K, RAGGED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_N_OUT: tl.constexpr, GROUP_M: tl.constexpr, G_BLOCK: tl.constexpr):
    """Program ``pid``'s tile (ragged_kernel's grid): (group g, the group's first row / column /
    K index, pid_m, pid_n within the group, valid: a real tile, bad: the offs are bad, and the
    group's M, N, K)."""
    start = 0
    valid = True
    bad = False
    M_g = M
    N_g = N
    K_g = K
    if RAGGED == "M":
        pid_m, pid_n = swizzle_tile(pid, tile_bound(M, BLOCK_M, G), tl.cdiv(N, BLOCK_N_OUT), GROUP_M)
        g, start, M_g, pid_m, valid, bad = locate_tile(pid_m, offs, G, M, BLOCK_M, G_BLOCK)
    elif RAGGED == "N":
        pid_m, pid_n = swizzle_tile(pid, tl.cdiv(M, BLOCK_M), tile_bound(N, BLOCK_N, G), GROUP_M)
        g, start, N_g, pid_n, valid, bad = locate_tile(pid_n, offs, G, N, BLOCK_N, G_BLOCK)
    else:
        tiles_per_group = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N_OUT)
        g = pid // tiles_per_group
        pid_m, pid_n = swizzle_tile(pid % tiles_per_group, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N_OUT), GROUP_M)
        if RAGGED == "K":
            idx, starts, sizes, bad = group_spans(offs, G, K, G_BLOCK)
            start = tl.sum(tl.where(idx == g, starts, 0))
            K_g = tl.sum(tl.where(idx == g, sizes, 0))
    return g, start, pid_m, pid_n, valid, bad, M_g, N_g, K_g


@triton.jit
def _group_pointers(A, B, C, g64, start, RAGGED: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                    USE_TMA: tl.constexpr):
    """Group g's A, B and C (int64: group offsets times strides pass 2^31 elements on large
    MoE batches), moved to its ``start`` along the ragged dimension; the grouped row of its
    first row (routing's index) and the rows of A's and C's own scales it starts at. A ragged
    K in the TMA flavour stays at the matrices' bases (the descriptors start at ``start``
    instead: a K-contiguous operand's group may begin at any element, TMA's base cannot)."""
    a_g = A.ptr + g64 * A.stride_g
    b_g = B.ptr + g64 * B.stride_g
    c_g = C.ptr + g64 * C.stride_g
    row0 = 0
    a_row0 = 0
    c_row0 = 0
    if RAGGED == "M":
        row0 = start
        if not GATHER:
            a_row0 = start.to(tl.int64)
            a_g += a_row0 * A.stride0
        if not SCATTER:
            c_row0 = start.to(tl.int64)
            c_g += c_row0 * C.stride0
    if RAGGED == "N":
        b_g += start.to(tl.int64) * B.stride1
        c_g += start.to(tl.int64) * C.stride1
    if RAGGED == "K" and not USE_TMA:
        a_g += start.to(tl.int64) * A.stride1
        b_g += start.to(tl.int64) * B.stride0
    return a_g, b_g, c_g, row0, a_row0, c_row0


@triton.jit
def _ragged_k(A, B, a_g, b_g, start, K_g, spec):
    """A ragged K's group in the TMA flavour: (its tiles.GroupK, the K the descriptors' loop
    sums, the descriptors' K extent: the group's end). Where A or B is K-contiguous the loop
    starts at the group's first 16-byte aligned column and the head before it goes through
    pointers (the bases a_g, b_g are the matrices', unmoved)."""
    VEC: tl.constexpr = 128 // A.ptr.dtype.element_ty.primitive_bitwidth
    head = 0
    if spec.A_K_CONTIG or spec.B_K_CONTIG:
        head = tl.minimum((VEC - start % VEC) % VEC, K_g)
    a = Operand(a_g + start.to(tl.int64) * A.stride1, A.stride0, A.stride1)
    b = Operand(b_g + start.to(tl.int64) * B.stride0, B.stride0, B.stride1)
    return GroupK(start + head, a, b, head), K_g - head, start + K_g


@triton.jit
def _split_of(ws, locks, RAGGED: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's tiles.SplitK: split p % SPLIT_K of tile p // SPLIT_K, whose partials meet
    in one [BLOCK_M * BLOCK_N] slot per (tile, split) of ``ws`` with a ticket on ``locks``
    (the tile's rows are a group's, so the slots are tile-local). Ragged rows only."""
    tl.static_assert(RAGGED == "M")
    return SplitK(tl.program_id(0) % SPLIT_K, ws, locks, tl.program_id(0) // SPLIT_K)


@triton.jit
def ragged_kernel(
    A, B, C, bias, offs, routing, scales, G, M, N, K, split_ws, split_locks,
    RAGGED: tl.constexpr, SWIGLU: tl.constexpr,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, G_BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr = False, A_K_CONTIG: tl.constexpr = True, B_K_CONTIG: tl.constexpr = True,
    SA_ROWS: tl.constexpr = 1, SB_COLS: tl.constexpr = 1, B_W4: tl.constexpr = None, W4_GROUP: tl.constexpr = 32,
    W4_TMA: tl.constexpr = False, W4_FRAG: tl.constexpr = False, SPLIT_K: tl.constexpr = 1):
    """C_g = act(A_g @ B_g + bias_g) for G groups; the groups cut ONE dimension (RAGGED).

    A, B, C: Stacked (a 2-D operand has stride_g = 0 and is cut by offs instead). By RAGGED:
      "M": A [M, K], B [G, K, N] (*), C [M, N];   group g = rows [offs[g-1], offs[g]).
      "N": A [G, M, K], B [K, N], C [M, N];       group g = columns of B and C.
      "K": A [M, K], B [K, N], C [G, M, N];       group g = a slice of the reduction.
      "":  A [G, M, K], B [G, K, N] (*), C [G, M, N]; no offs (batched).
    (*) with SWIGLU, B has 2N columns (gate then up) and C has N. M, N, K: sizes (ragged: the total).
    offs: Vector over int32 [G] (None for ""). bias: Operand over [G, N] ("N": [total N], stride0 0) or NO_OPERAND.
    routing: tiles.Routing ("M": the MoE gather, scatter and weight; all None otherwise).
    scales: an FP8 grouped GEMM's tiles.Scales, as ``grouped_scales`` builds them ("M" only;
        NO_GROUPED_SCALES without scales), moved to each group here: ``a`` an Operand over
        A's per-K-block scales [rows of A, ceil(K/128)] (1x128, SA_ROWS = 1; with a gather
        indexed by token row, like A), ``m`` a Vector over A's row scales [M] (not with a
        gather); ``b`` a Stacked over [G, ceil(K/128), ceil(N/128)] (128x128, SB_COLS = 128;
        with SWIGLU 2 * ceil(N/128) columns, the gate's blocks then the up's; B_W4: B 4-bit, uint8
        [G, K/2, N] (W4_FRAG: in prepack.py's order), ``b`` its scales [G, K/W4_GROUP, N]), ``n`` an
        Operand over [G, N] (per column); ``out`` over C's own scales [M, ceil(N/128)] when C is fp8.
    G_BLOCK: next power of two >= G + 1 (the groups plus the tail group).
    SPLIT_K ("M"): split_ws fp32 [tiles, SPLIT_K, BLOCK_M * BLOCK_N], split_locks int32 [tiles] (``_split_of``).
    USE_TMA, A_K_CONTIG, B_K_CONTIG: core's TMA flavour, descriptors over each group's A [M_g, K_g],
        B and C [M_g, N_g] (zero-filled and clipped at the group's edges, as masks do; not with a
        gather or SWIGLU), a ragged K's over A [M, end_g], B [end_g, N] (``_ragged_k``); a
        scattered C goes through pointers. W4_TMA: B (4-bit) alone (W4_FRAG: see B_W4).
    Grid (1-D, tiles in GROUP_M order), an upper bound that needs no offs values (programs past
      the real tile count return at once; ``tile_bound``): "M": tile_bound(M, BLOCK_M, G) * cdiv(N, BLOCK_N_OUT) *
      SPLIT_K; "N": cdiv(M, BLOCK_M) * tile_bound(N, BLOCK_N, G); "K" and "": G * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N).
    Rows (columns) past offs[-1] are written as zero; bad offs (decreasing, negative, past the total)
    write every element of C as NaN: never a silent wrong answer.
    """
    spec: tl.constexpr = TileSpec(BLOCK_M, BLOCK_N, BLOCK_K, ACTIVATION, UPCAST, PRECISION, USE_TMA, A_K_CONTIG, B_K_CONTIG,
                                  SPLIT_K=SPLIT_K, SA_ROWS=SA_ROWS, SB_COLS=SB_COLS, SWIGLU=SWIGLU, B_W4=B_W4,
                                  W4_GROUP=W4_GROUP, W4_TMA=W4_TMA, W4_FRAG=W4_FRAG)
    BLOCK_N_OUT: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N
    split = _split_of(split_ws, split_locks, RAGGED, SPLIT_K) if SPLIT_K > 1 else None
    g, start, pid_m, pid_n, valid, bad, M_g, N_g, K_g = _ragged_tile(
        tl.program_id(0) // SPLIT_K, offs, G, M, N, K, RAGGED, BLOCK_M, BLOCK_N, BLOCK_N_OUT, GROUP_M, G_BLOCK)
    fill = None
    if RAGGED != "":
        # The tail group (past offs[-1]) is zeros; bad offs make everything one NaN group.
        fill = Fill((g == G) | bad, tl.where(bad, float("nan"), 0.0))
    HAS_BIAS: tl.constexpr = bias.ptr is not None
    GATHER: tl.constexpr = routing.gather is not None
    SCATTER: tl.constexpr = routing.scatter is not None
    if valid:
        g64 = g.to(tl.int64)
        a_g, b_g, c_g, row0, a_row0, c_row0 = _group_pointers(A, B, C, g64, start, RAGGED, GATHER, SCATTER, USE_TMA)
        group_k, K_loop, K_ext = None, K_g, K_g
        if RAGGED == "K" and USE_TMA:
            group_k, K_loop, K_ext = _ragged_k(A, B, a_g, b_g, start, K_g, spec)
        if HAS_BIAS:
            bias_g = Vector(bias.ptr + g64 * bias.stride0, bias.stride1)
            if RAGGED == "N":
                bias_g = Vector(bias_g.ptr + start.to(tl.int64) * bias.stride1, bias.stride1)
        else:
            bias_g = Vector(None, 0)
        a, b, c = make_operands(Operand(a_g, A.stride0, A.stride1), Operand(b_g, B.stride0, B.stride1),
                                Operand(c_g, C.stride0, C.stride1), M_g, N_g, K_ext, spec)
        if SCATTER:
            c = Operand(c_g, C.stride0, C.stride1)  # scattered rows are stored through pointers
        # The group's scales: A's follow its rows (from a_row0; a gather indexes them by token
        # row, as A itself), B's its group, C's own (an fp8 output) its rows, as C itself.
        # (a jit helper cannot return an absent operand's None: the guards stay inline)
        sa, sb, sm, sn, so = scales
        sa_g = Operand(None if sa.ptr is None else sa.ptr + a_row0 * sa.stride0, sa.stride0, sa.stride1)
        sm_g = Vector(None if sm.ptr is None else sm.ptr + a_row0 * sm.stride, sm.stride)
        sb_g = Operand(None if sb.ptr is None else sb.ptr + g64 * sb.stride_g, sb.stride0, sb.stride1)
        sn_g = Vector(None if sn.ptr is None else sn.ptr + g64 * sn.stride0, sn.stride1)
        so_g = Operand(None if so.ptr is None else so.ptr + c_row0 * so.stride0, so.stride0, so.stride1)
        gemm_tile(pid_m, pid_n, a, b, c, M_g, N_g, K_loop, spec, Scales(sa_g, sb_g, sm_g, sn_g, so_g), routing, bias_g,
                  split, row0, fill, group_k=group_k)


@triton.jit
def list_kernel(
    a_ptrs, b_ptrs, c_ptrs, sizes_ptr, strides_ptr, G,
    a_like, b_like, c_like,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, G_BLOCK: tl.constexpr,
):
    """List mode: C_g = act(A_g @ B_g) for G independent problems, one persistent launch.

    a_ptrs, b_ptrs, c_ptrs [G] int64: data_ptr() of each A_g [M_g, K_g], B_g [K_g, N_g],
        C_g [M_g, N_g] (cast back to pointers of a_like's / b_like's / c_like's dtype; the
        *_like tensors are the first group's, passed only for their dtypes).
    sizes_ptr [G, 3] int32: (M_g, N_g, K_g), row-major.
    strides_ptr [G, 6] int64: (stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn).
    Grid: (min(SM count, total tiles),). Program p walks tiles p, p + grid, ... over all
    groups' tiles laid out group after group (GROUP_M order inside a group); every tile is
    core's gemm_tile, masked on M, N and K, so no size needs to be a multiple of a block.
    """
    spec: tl.constexpr = TileSpec(BLOCK_M, BLOCK_N, BLOCK_K, ACTIVATION, UPCAST, PRECISION)
    idx = tl.arange(0, G_BLOCK)
    Ms = tl.load(sizes_ptr + idx * 3 + 0, mask=idx < G, other=0)
    Ns = tl.load(sizes_ptr + idx * 3 + 1, mask=idx < G, other=0)
    tiles = tl.cdiv(Ms, BLOCK_M) * tl.cdiv(Ns, BLOCK_N)
    for i in tl.range(0, program_units(tl.sum(tiles), True)):
        tile = tl.program_id(0) + i * tl.num_programs(0)
        g, first = find_group(tile, tiles, idx)
        M = tl.load(sizes_ptr + g * 3 + 0)
        N = tl.load(sizes_ptr + g * 3 + 1)
        K = tl.load(sizes_ptr + g * 3 + 2)
        pid_m, pid_n = swizzle_tile(tile - first, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        st = strides_ptr + g * 6
        A = Operand(tl.load(a_ptrs + g).to(tl.pointer_type(a_like.dtype.element_ty)), tl.load(st + 0), tl.load(st + 1))
        B = Operand(tl.load(b_ptrs + g).to(tl.pointer_type(b_like.dtype.element_ty)), tl.load(st + 2), tl.load(st + 3))
        C = Operand(tl.load(c_ptrs + g).to(tl.pointer_type(c_like.dtype.element_ty)), tl.load(st + 4), tl.load(st + 5))
        gemm_tile(pid_m, pid_n, A, B, C, M, N, K, spec, Scales(), Routing(), Vector(None, 0))


@triton.jit
def _expert_of(ids, i, live, E):
    """The expert of pairs i (int32), E for ids outside [0, E) (compared in their own width:
    no wrap-around), which sort after every expert's."""
    e = tl.load(ids + i, mask=live, other=0)
    return tl.where((e >= 0) & (e < E), e, E).to(tl.int32)


@triton.jit
def _expert_counts(ids, P, E, start, E_BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """(all, before): each expert's pair count over all P pairs and over pairs [0, start), as
    [E_BLOCK] histograms (ids outside [0, E) at index E), SCAN_BLOCK pairs per step: a few
    steps for any P the prep takes, where a compare matrix took P / 64 dependent ones."""
    last = tl.arange(0, E_BLOCK) == E_BLOCK - 1
    total = tl.zeros([E_BLOCK], dtype=tl.int32)
    before = tl.zeros([E_BLOCK], dtype=tl.int32)
    end = 0
    for s0 in range(0, P, SCAN_BLOCK):
        j = s0 + tl.arange(0, SCAN_BLOCK)
        ej = _expert_of(ids, j, j < P, E)
        # the padding goes to the last bin and is taken off it below (it may be E's own bin)
        total += tl.histogram(tl.where(j < P, ej, E_BLOCK - 1), E_BLOCK)
        before += tl.histogram(tl.where(j < start, ej, E_BLOCK - 1), E_BLOCK)
        end = s0 + SCAN_BLOCK
    total = tl.where(last, total - (end - P), total)
    before = tl.where(last, before - (end - start), before)
    return total, before


@triton.jit
def _sorted_rows(ids, i, e, live, start, P, E, E_BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """Row of pairs i = start + arange (experts e) in the stable sort by expert: the pairs of
    lower experts, the earlier pairs of the same one before the block (histograms) and within
    it (a [block, block] compare). Every program counts for its own pairs, so none waits for
    another's result."""
    total, before = _expert_counts(ids, P, E, start, E_BLOCK, SCAN_BLOCK)
    lower = tl.cumsum(total, axis=0) - total
    same = (e[None, :] == e[:, None]) & (i[None, :] < i[:, None]) & live[None, :]
    return tl.gather(lower + before, e, 0) + tl.sum(same.to(tl.int32), axis=1)


class RowTiles(NamedTuple):
    """A row-tile table of ``moe_prep_kernel`` (``row_tiles_kernel``'s sched and count), or
    ``NO_ROW_TILES``; its tile height is the kernel's BLOCK_M1 / BLOCK_M2."""

    sched: Any
    count: Any


NO_ROW_TILES = RowTiles(None, None)


class Routes(NamedTuple):
    """``moe_prep_kernel``'s routing (onegemm.route fused in front of the sort): the logits
    [T, E] and their strides (flat: Triton 3.6 drops a specialised value of a tuple nested in
    a tuple), the correction bias ([E], stride 1; None without one), the weights written
    (fp32 [T, k], contiguous) and the factor they are multiplied by."""

    logits: Any
    logits_stride0: Any
    logits_stride1: Any
    bias: Any
    weights: Any
    scale: Any


NO_ROUTES = Routes(None, 0, 0, None, None, 1.0)


@triton.jit
def moe_prep_kernel(ids, pair, token, offs, X, Q, S, zeros, tiles1, tiles2, routes, P, E, k, H, col_blocks, n_zero,
                    E_BLOCK: tl.constexpr, PAIR_BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr,
                    BLOCK_M1: tl.constexpr = 0, BLOCK_M2: tl.constexpr = 0, CHUNK: tl.constexpr = 32,
                    ROUTE: tl.constexpr = None, ROUTE_TOKENS: tl.constexpr = 16, SORTED_X: tl.constexpr = True):
    """The MoE step before the expert GEMMs, one launch: the (token, slot) pairs sorted by
    expert, x's rows in that order (quantised), the row-tile tables of the GEMMs' tile heights.

    ids [P = T * k] (int32 or int64, contiguous): the expert of pair i; ids outside [0, E)
        (experts on other ranks) sort after every expert's, in a last group.
    pair, token [P] int32 (out): row r of the sorted order is pair pair[r], of token
        token[r] = pair[r] // k; the sort is stable (a pair's row: the pairs of lower experts
        plus the earlier pairs of its own, ``_sorted_rows``).
    offs [E] int32 (out): expert e owns rows [offs[e-1], offs[e]).
    X: Operand over x [T, H] (any strides), or NO_OPERAND (the sort alone). Q: Operand over
        [P, H], row r = x[token[r]], quantised to Q's fp8 dtype in 1x128 blocks with scales
        S (Operand over fp32 [P, ceil(H/128)]; NO_OPERAND: Q is 16/32-bit and gets the rows as
        they are). Rows of other ranks' pairs are not written (no GEMM tile reads them).
        SORTED_X False: Q [T, H], S [T, ceil(H/128)], x's rows in token order (for a gather).
    zeros: int32 [n_zero] (out: zeros), or None: GEMM2's combine tickets (core/tiles.py Combine).
    tiles1, tiles2: RowTiles of BLOCK_M1 / BLOCK_M2 rows (0: none), as ``row_tiles_kernel``
        writes them without the tail group (the GEMMs' Groups.sched).
    routes: Routes (ROUTE, a RouteSpec: the routing is this kernel's too), or NO_ROUTES. Every
        program routes every token (``route_tokens``, ROUTE_TOKENS at a time) and stores the
        weights and ids, the same bits from each, then reads the ids back after a barrier: no
        program waits for another. ids is then int32 [T, k], written.
    E_BLOCK: a power of two > E. PAIR_BLOCK: pairs per program. SCAN_BLOCK: pairs per step of
        the expert counts. col_blocks: 128-column blocks of x per program.
    Grid: (cdiv(P, PAIR_BLOCK) + table programs, cdiv(ceil(H/128), col_blocks)): program
    (p, c), p < cdiv(P, PAIR_BLOCK), places pairs [p * PAIR_BLOCK, ...) (c = 0) and writes
    column blocks c * col_blocks, ... of their rows (or tokens, SORTED_X False); table program
    (cdiv(P, PAIR_BLOCK) + q, 0) rows [q * CHUNK, ...) of each table, q = 0 offs (the tables'
    serial work spread). Every program zeroes a slice of ``zeros``.
    """
    pid, cid = tl.program_id(0), tl.program_id(1)
    pair_programs = tl.cdiv(P, PAIR_BLOCK)
    is_pairs = pid < pair_programs
    if ROUTE is not None:
        if is_pairs | (cid == 0):
            for t0 in range(0, P // k, ROUTE_TOKENS):
                t = t0 + tl.arange(0, ROUTE_TOKENS)
                live_t = t < P // k
                logits = Operand(routes.logits, routes.logits_stride0, routes.logits_stride1)
                w, chosen = route_tokens(logits, routes.bias, t, live_t, ROUTE)
                store_routes(routes.weights, ids, t, live_t, w, chosen, routes.scale, ROUTE)
            tl.debug_barrier()  # the CTA's own stores of ids, visible to all its threads
    if is_pairs:
        i = pid * PAIR_BLOCK + tl.arange(0, PAIR_BLOCK)
        live = i < P
        kb_lo = cid * col_blocks
        kb_hi = tl.minimum(kb_lo + col_blocks, tl.cdiv(H, _SCALE_BLOCK))
        if SORTED_X:
            e, row = _place_pairs(ids, pair, token, i, live, pid * PAIR_BLOCK, P, E, k, cid == 0, E_BLOCK, SCAN_BLOCK)
            if X.ptr is not None:
                _quantize_rows(X, (i // k).to(tl.int64), row.to(tl.int64), live & (e < E), Q, S, H, kb_lo, kb_hi,
                               False, "")
        else:  # one quantisation per token (tokens [p * PAIR_BLOCK, ...)), off the sort's path
            if cid == 0:
                _place_pairs(ids, pair, token, i, live, pid * PAIR_BLOCK, P, E, k, True, E_BLOCK, SCAN_BLOCK)
            if X.ptr is not None:
                _quantize_rows(X, i.to(tl.int64), i.to(tl.int64), i < P // k, Q, S, H, kb_lo, kb_hi, False, "")
    elif cid == 0:
        q = pid - pair_programs
        sizes, _ = _expert_counts(ids, P, E, 0, E_BLOCK, SCAN_BLOCK)
        experts = tl.arange(0, E_BLOCK)
        ends = tl.cumsum(sizes, axis=0)
        if q == 0:
            tl.store(offs + experts, ends, mask=experts < E)
        t = q * CHUNK + tl.arange(0, CHUNK)
        if BLOCK_M1 > 0:
            _row_tile_chunk(t, experts, ends - sizes, sizes, False, E, P, tiles1, BLOCK_M1, False, q == 0)
        if BLOCK_M2 > 0:
            _row_tile_chunk(t, experts, ends - sizes, sizes, False, E, P, tiles2, BLOCK_M2, False, q == 0)
    if zeros is not None:  # each program a slice
        per = tl.cdiv(n_zero, tl.num_programs(0) * tl.num_programs(1))
        lo = (pid * tl.num_programs(1) + cid) * per
        hi = tl.minimum(lo + per, n_zero)
        for z in range(lo, hi, 1024):
            o = z + tl.arange(0, 1024)
            tl.store(zeros + o, 0, mask=o < hi)


@triton.jit
def _place_pairs(ids, pair, token, i, live, start, P, E, k, store, E_BLOCK: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """(experts, sorted rows) of the live pairs i = start + arange (``_sorted_rows``); where
    ``store``, pair[row] = i and token[row] = i // k."""
    e = _expert_of(ids, i, live, E)
    row = _sorted_rows(ids, i, e, live, start, P, E, E_BLOCK, SCAN_BLOCK)
    if store:
        tl.store(pair + row, i, mask=live)
        tl.store(token + row, i // k, mask=live)
    return e, row


@triton.jit
def _row_tile_chunk(t, idx, starts, sizes, bad, G, M, tiles, BLOCK_M: tl.constexpr, TAIL: tl.constexpr, first):
    """Rows t of a row-tile table from the groups' spans (``group_spans``' idx, starts, sizes,
    bad); the count too where ``first``."""
    starts = tl.where(bad, 0, starts)
    sizes = tl.where(bad, tl.where(idx == G, M, 0), sizes)
    n = (sizes + BLOCK_M - 1) // BLOCK_M
    if not TAIL:
        n = tl.where(idx == G, 0, n)
    ends = tl.cumsum(n, 0)
    total = tl.sum(n)
    g = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
    own = idx[None, :] == g[:, None]
    first_tile = tl.sum(tl.where(own, (ends - n)[None, :], 0), axis=1)
    start = tl.sum(tl.where(own, starts[None, :], 0), axis=1)
    size = tl.sum(tl.where(own, sizes[None, :], 0), axis=1)
    fill = tl.where(bad, 2, tl.where(g == G, 1, 0))
    live = t < total
    row = tiles.sched + t.to(tl.int64) * 4
    tl.store(row, tl.minimum(g, G - 1), mask=live)
    tl.store(row + 1, start + (t - first_tile) * BLOCK_M, mask=live)
    tl.store(row + 2, start + size, mask=live)
    tl.store(row + 3, fill, mask=live)
    if first:
        tl.store(tiles.count, total)


@triton.jit
def row_tiles_kernel(offs, sched, count, G, M, BLOCK_M: tl.constexpr, G_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                     TAIL: tl.constexpr = True):
    """The row tiles of a ragged M, as core's Gluon body walks them (hopper_fp8.Groups).

    offs: Vector over int32 [G] (group g's rows [offs[g-1], offs[g]) of M).
    sched (out): int32 [cdiv(M, BLOCK_M) + G + 1, 4]; row t = (group, first row, end row of
        the group, fill) of row tile t, tiles numbered group after group as ``locate_tile``
        numbers them (the tail group G, rows past offs[-1], last: fill 1, zeros); bad offs
        make every row one tail group of fill 2 (NaN). A fill tile's group is clamped into
        [0, G) so that the body's per-group pointers stay inside their tensors. TAIL False:
        the tail group gets no tiles (the MoE's rows of experts on other ranks, which its
        combine skips).
    count (out): int32 [1], the number of row tiles (program 0 writes it).
    Grid: (cdiv(cdiv(M, BLOCK_M) + G + 1, CHUNK),): each program places CHUNK tiles.
    """
    idx, starts, sizes, bad = group_spans(offs, G, M, G_BLOCK)
    t0 = tl.program_id(0) * CHUNK
    _row_tile_chunk(t0 + tl.arange(0, CHUNK), idx, starts, sizes, bad, G, M, RowTiles(sched, count), BLOCK_M, TAIL,
                    t0 == 0)


@triton.jit
def _quantize_rows(X, src, dst, live, Q, S, H, kb_lo, kb_hi, SWIGLU: tl.constexpr, ROUND: tl.constexpr):
    """Q[dst] = X[src] for 128-column blocks [kb_lo, kb_hi) of the rows where ``live``: in
    fp8 with 1x128 block scales S[dst, kb] (core/fp8.py's rule), or as they are (S.ptr None).
    SWIGLU, ROUND: ``gather_quantize_kernel``'s."""
    dtype: tl.constexpr = Q.ptr.dtype.element_ty
    for kb in range(kb_lo, kb_hi):
        cols = kb * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)
        mask = live[:, None] & (cols < H)[None, :]
        x = tl.load(X.ptr + src[:, None] * X.stride0 + cols[None, :] * X.stride1, mask=mask, other=0.0)
        x = x.to(tl.float32)
        if SWIGLU:
            u = tl.load(X.ptr + src[:, None] * X.stride0 + (cols + H)[None, :] * X.stride1, mask=mask, other=0.0)
            x = x * tl.sigmoid(x) * u.to(tl.float32)
            if ROUND == "bf16":
                x = x.to(tl.bfloat16).to(tl.float32)
            elif ROUND == "fp16":
                x = x.to(tl.float16).to(tl.float32)
        if S.ptr is None:
            tl.store(Q.ptr + dst[:, None] * Q.stride0 + cols[None, :] * Q.stride1, x.to(dtype), mask=mask)
        else:
            scale = fp8_scale(tl.max(amax_input(x), axis=1), dtype)
            # fp8_cast, not fp8_grid: one reciprocal per row and the hardware's cast, where a
            # division per element made a decode step's prep instruction-bound (the same bits)
            q = fp8_cast(x, scale[:, None], dtype)
            tl.store(Q.ptr + dst[:, None] * Q.stride0 + cols[None, :] * Q.stride1, q, mask=mask)
            tl.store(S.ptr + dst * S.stride0 + kb * S.stride1, scale, mask=live)


@triton.jit
def gather_quantize_kernel(X, rows, Q, S, P, H, offs, G, col_blocks, BLOCK_R: tl.constexpr,
                           SWIGLU: tl.constexpr = False, ROUND: tl.constexpr = ""):
    """Q[r] = X[rows[r]] in fp8 with 1x128 block scales S[r, :] (core/fp8.py's rule): the MoE
    GEMM1 operand written once in expert-sorted order, which TMA then reads as whole rows.

    X: Operand over [T, H] (fp32, bf16, fp16, any strides); rows: int32 [P] (the sort's token
    of each row), or None (row r of X); Q: Operand over fp8 [P, H]; S: Operand over fp32
    [P, ceil(H/128)], or NO_OPERAND: Q is 16/32-bit and gets the rows as they are (no
    quantisation). SWIGLU: X is [P, 2H] (gate | up) and the row is silu(gate) * up, computed
    in fp32 and, before a quantisation, rounded to ROUND ("bf16", "fp16" or "": kept fp32), the
    value a 16-bit SwiGLU output would hold (the FP8 training forward's GEMM2 operand).
    offs: int32 [G] expert end offsets (contiguous), or None: only rows before offs[G - 1] are
    written (the later ones belong to experts on other ranks, which no GEMM tile reads).
    Grid: (cdiv(P, BLOCK_R), cdiv(ceil(H/128), col_blocks)): a program walks col_blocks of its
    rows' 128-column blocks (few rows: many programs per row; many rows: whole rows).
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    end = P
    if offs is not None:
        end = tl.minimum(tl.load(offs + G - 1), P)
    if tl.program_id(0) * BLOCK_R < end:  # programs past the last live row leave at once
        live = r < end
        if rows is None:
            src = r.to(tl.int64)
        else:
            src = tl.load(rows + r, mask=live, other=0).to(tl.int64)
        kb_lo = tl.program_id(1) * col_blocks
        _quantize_rows(X, src, r.to(tl.int64), live, Q, S, H, kb_lo, tl.minimum(kb_lo + col_blocks, tl.cdiv(H, _SCALE_BLOCK)),
                       SWIGLU, ROUND)


@triton.jit
def combine_kernel(Y, ids, Out, E, H, k: tl.constexpr, BLOCK_H: tl.constexpr):
    """Out[t] = sum over slots j of Y[t * k + j] where 0 <= ids[t, j] < E, in slot order, in
    fp32: the MoE combine that never reads the rows of experts on other ranks (unwritten).

    Y: Operand over [T * k, H] (each (token, slot) pair's weighted expert output); ids: int32
    or int64 [T, k] contiguous; Out: Operand over [T, H]. Grid: (T, cdiv(H, BLOCK_H)).
    """
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(k):
        e = tl.load(ids + t * k + j)
        if (e >= 0) & (e < E):
            acc += tl.load(Y.ptr + (t * k + j) * Y.stride0 + cols * Y.stride1, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out.ptr + t * Out.stride0 + cols * Out.stride1, acc.to(Out.ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(Hpre, dHu, w, dHpre, Hout, dw, I, BLOCK_I: tl.constexpr):
    """MoE GEMM1's SwiGLU backward for one (token, slot) row r per program, all in fp32:
    g, u = Hpre[r, :I], Hpre[r, I:]; h = silu(g) * u; dw[r] = <dHu[r], h> (summed in a fixed
    order); dh = w[r] * dHu[r]; dHpre[r] = [dh * u * silu'(g), dh * silu(g)]; Hout[r] = w[r] * h.

    Hpre: Operand over [P, 2I] (GEMM1's pre-activation, recomputed); dHu: Operand over [P, I]
    fp32 (dy @ W2_e: h's gradient before the routing weight); w: fp32 [P] contiguous (each
    row's routing weight); dHpre: Operand over [P, 2I]; Hout: Operand over [P, I] (dW2's
    operand, weighted as dy's rows are not); dw: fp32 [P] (the routing weights' gradient). Grid: (P,).
    """
    r = tl.program_id(0).to(tl.int64)
    wr = tl.load(w + r)
    acc = tl.zeros([BLOCK_I], dtype=tl.float32)
    for c0 in range(0, I, BLOCK_I):
        cols = c0 + tl.arange(0, BLOCK_I)
        mask = cols < I
        g = tl.load(Hpre.ptr + r * Hpre.stride0 + cols * Hpre.stride1, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(Hpre.ptr + r * Hpre.stride0 + (cols + I) * Hpre.stride1, mask=mask, other=0.0).to(tl.float32)
        dhu = tl.load(dHu.ptr + r * dHu.stride0 + cols * dHu.stride1, mask=mask, other=0.0)
        sig = tl.sigmoid(g)
        silu = g * sig
        h = silu * u
        acc += dhu * h
        dh = dhu * wr
        out = dHpre.ptr + r * dHpre.stride0
        tl.store(out + cols * dHpre.stride1, (dh * u * sig * (1 + g * (1 - sig))).to(dHpre.ptr.dtype.element_ty), mask=mask)
        tl.store(out + (cols + I) * dHpre.stride1, (dh * silu).to(dHpre.ptr.dtype.element_ty), mask=mask)
        tl.store(Hout.ptr + r * Hout.stride0 + cols * Hout.stride1, (h * wr).to(Hout.ptr.dtype.element_ty), mask=mask)
    tl.store(dw + r, tl.sum(acc, axis=0))


class RouteSpec(NamedTuple):
    """onegemm.route's choices as one constexpr (grouped/routing.py says what each means).

    The experts are held as [G_BLOCK, GROUP_BLOCK]: group g, member j is expert g * GROUP + j
    (without groups N_GROUP = 1 and GROUP = E). SCORING: 0 softmax, 1 sigmoid, 2 top-k then
    softmax, 3 top-k then sigmoid. K_BLOCK: a power of two >= TOP_K."""

    GROUP: int
    N_GROUP: int
    G_BLOCK: int
    GROUP_BLOCK: int
    TOPK_GROUP: int
    TOP_K: int
    K_BLOCK: int
    SCORING: int
    HAS_BIAS: bool
    RENORMALIZE: bool


@triton.jit
def route_tokens(L, bias, t, live, R: tl.constexpr):
    """(weights fp32, ids int32), each [TB, K_BLOCK], of tokens t [TB] (rows of the logits
    Operand L; rows not ``live`` compute on row 0 and are the caller's to drop). bias: fp32
    [E] (R.HAS_BIAS). Each pick is an argmax that takes the lowest group, then the lowest
    member, among equal values: the lowest expert index, as route's stable sort."""
    NEG: tl.constexpr = float("-inf")
    # a constexpr tuple's fields arrive as Python values: bound as constexprs for the builders
    GROUP: tl.constexpr = R.GROUP
    N_GROUP: tl.constexpr = R.N_GROUP
    TOPK_GROUP: tl.constexpr = R.TOPK_GROUP
    TOP_K: tl.constexpr = R.TOP_K
    K_BLOCK: tl.constexpr = R.K_BLOCK
    SCORING: tl.constexpr = R.SCORING
    GROUP_BLOCK: tl.constexpr = R.GROUP_BLOCK
    gs = tl.arange(0, R.G_BLOCK)
    g = gs[None, :, None]
    j = tl.arange(0, GROUP_BLOCK)[None, None, :]
    valid = (g < N_GROUP) & (j < GROUP)
    e = g * GROUP + j
    rows = tl.where(live, t, 0)[:, None, None]
    x = tl.load(L.ptr + rows * L.stride0 + e * L.stride1, mask=valid, other=NEG).to(tl.float32)
    if SCORING == 0:
        p = tl.where(valid, tl.exp(x - tl.max(tl.max(x, axis=2), axis=1)[:, None, None]), 0.0)
        s = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    elif SCORING == 1:
        s = tl.where(valid, tl.sigmoid(x), 0.0)
    else:
        s = x
    choice = s
    if R.HAS_BIAS:
        choice = s + tl.load(bias + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, NEG)
    if N_GROUP > 1:
        best = tl.max(choice, axis=2)
        if R.HAS_BIAS:  # the sum of the group's two best
            first = tl.argmax(choice, axis=2, tie_break_left=True)
            best += tl.max(tl.where(j == first[:, :, None], NEG, choice), axis=2)
        gscore = tl.where(gs[None, :] < N_GROUP, best, NEG)
        kept = tl.zeros_like(gscore) != 0  # [TB, G_BLOCK]
        for _ in tl.static_range(TOPK_GROUP):
            hit = gs[None, :] == tl.argmax(gscore, axis=1, tie_break_left=True)[:, None]
            kept = kept | hit
            gscore = tl.where(hit, NEG, gscore)
        choice = tl.where(kept[:, :, None], choice, NEG)
    ks = tl.arange(0, K_BLOCK)[None, :]
    w = tl.zeros([t.shape[0], K_BLOCK], dtype=tl.float32)
    ids = tl.zeros([t.shape[0], K_BLOCK], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        gi = tl.argmax(tl.max(choice, axis=2), axis=1, tie_break_left=True)
        ji = tl.sum(tl.where(gs[None, :] == gi[:, None], tl.argmax(choice, axis=2, tie_break_left=True), 0), axis=1)
        sel = (g == gi[:, None, None]) & (j == ji[:, None, None])
        w = tl.where(ks == i, tl.sum(tl.sum(tl.where(sel, s, 0.0), axis=2), axis=1)[:, None], w)
        ids = tl.where(ks == i, (gi * GROUP + ji)[:, None], ids)
        choice = tl.where(sel, NEG, choice)
    real = ks < TOP_K
    if SCORING == 2:
        p = tl.where(real, tl.exp(w - tl.max(tl.where(real, w, NEG), axis=1)[:, None]), 0.0)
        w = p / tl.sum(p, axis=1)[:, None]
    elif SCORING == 3:
        w = tl.sigmoid(w)
    if R.RENORMALIZE:
        w = w / (tl.sum(tl.where(real, w, 0.0), axis=1)[:, None] + 1e-20)
    return w, ids


@triton.jit
def store_routes(w_ptr, ids_ptr, t, live, w, ids, scale, R: tl.constexpr):
    """Tokens t's rows of route's outputs: w_ptr fp32 and ids_ptr int32 [T, R.TOP_K]
    (contiguous); the weights times ``scale``."""
    K_BLOCK: tl.constexpr = R.K_BLOCK
    TOP_K: tl.constexpr = R.TOP_K
    ks = tl.arange(0, K_BLOCK)[None, :]
    at = t[:, None] * TOP_K + ks
    mask = live[:, None] & (ks < TOP_K)
    tl.store(w_ptr + at, w * scale, mask=mask)
    tl.store(ids_ptr + at, ids, mask=mask)


@triton.jit
def route_kernel(L, bias, w_ptr, ids_ptr, T, scale, R: tl.constexpr, TOKENS: tl.constexpr):
    """onegemm.route for TOKENS tokens per program (``route_tokens``).

    L: Operand over the logits [T, E] (any strides); bias [E] fp32 (R.HAS_BIAS); w_ptr fp32
    and ids_ptr int32 [T, R.TOP_K] (out, contiguous). Grid: (cdiv(T, TOKENS),).
    """
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    live = t < T
    w, ids = route_tokens(L, bias, t, live, R)
    store_routes(w_ptr, ids_ptr, t, live, w, ids, scale, R)
