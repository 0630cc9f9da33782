"""The shared tile body of every onegemm kernel, as ``@triton.jit`` helpers.

A GEMM kernel in this project picks a tile and calls ``gemm_tile``, the one composition of
the tile body:

1. ``swizzle_tile``: program id -> (pid_m, pid_n) in grouped (GROUP_M) order, so that
   consecutive programs share A row-blocks and B column-blocks in L2.
2. ``mma_k_loop``: the K loop over broadcast 2-D pointer blocks, the ``k_remaining`` mask and
   fp32 accumulation, with per-K-block dequantisation scales (blockscaled/) and arbitrary row
   index vectors, which give the MoE row gather for free (grouped/).
3. ``split_k_combine`` (SPLIT_K > 1): the last of a tile's K splits sums their partials;
   ``stream_k_combine`` likewise for the stream-K schedule's shared tiles (``stream_k``).
4. ``epilogue`` + ``store_tile``: dequant scales, bias, activation, routing weight, an fp8
   output's own 1x128 quantisation (``quantize_tile``), cast,
   masked (or TMA) store.

``gemm_tile`` chains 2-4 for one output tile; its options (block scales, split-K, the MoE
gather/scatter/SwiGLU, a constant fill) are arguments, so kernels never copy the body: the
dense kernel (core/matmul.py, plain, persistent, split-K and block-scaled), the ragged and the
list kernels (grouped/kernels.py) all call it. A new need is a new option here.

Arguments travel in NamedTuples (Triton passes them to kernels and helpers as tuples, each
element specialised on its own: a None element is a compile-time None):
``Operand`` (a matrix and its strides), ``Vector``, ``Scales``, ``SplitK``, ``Routing``, ``Fill``
and ``TileSpec``, the constexprs of the body, which a kernel builds from its own.

Two flavours of loads and stores, one contract. The pointer flavour (the default) reads
through broadcast pointer blocks and works for any strides. The TMA flavour (``USE_TMA``, for
Hopper) reads and writes through tensor descriptors that ``make_operands`` builds: the TMA
unit copies whole boxes into shared memory asynchronously, zero-filling what lies outside the
matrix (so no masks), and frees the warps from address arithmetic. It needs a unit last
stride and 16-byte aligned base and strides (core/tma.py decides, and the host falls back to
pointers otherwise), and it cannot gather rows (docs/hopper.md).

Conventions: row/column index vectors must be valid indices even where the tile overhangs
the matrix (``tile_range`` wraps them with ``% size``; a gather reads them from an index
array), so loads need no M/N mask; only the store masks.
"""

import collections
from typing import Any, NamedTuple

import triton
import triton.language as tl

from .fp8 import amax_input, fp8_grid, fp8_scale
from .runtime import INTERPRET
from .scaling import SCALE_BLOCK

_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)


class Operand(NamedTuple):
    """A matrix: element [i, j] at ``ptr + i * stride0 + j * stride1`` (any strides; a
    transposed view swaps them). In the TMA flavour ``make_operands`` puts a tensor descriptor
    in ``ptr``."""

    ptr: Any
    stride0: Any
    stride1: Any


class Vector(NamedTuple):
    """A vector: element [i] at ``ptr + i * stride``; stride 0 broadcasts element 0."""

    ptr: Any
    stride: Any


# What an absent optional operand or vector is: its ``ptr`` is None. Kernels test ``x.ptr is
# None``, never ``x is None``: Triton 3.6 fails to compare a tuple holding constexpr elements
# (a None, or a stride specialised to 1) with None.
NO_OPERAND = Operand(None, 0, 0)
NO_VECTOR = Vector(None, 0)


class Scales(NamedTuple):
    """A block-scaled GEMM's fp32 dequantisation multipliers (``ptr`` None when absent).

    a: Operand over sa [ceil(M / SA_ROWS), ceil(K / BLOCK_K)]: A's scale per K block, for rows
       i // SA_ROWS (1x128: SA_ROWS = 1; 128x128: 128). Read by the K loop.
    b: Operand over sb [ceil(K / BLOCK_K), ceil(N / SB_COLS)]: B's, likewise per column block.
    m: Vector over C's rows (row-wise or, with stride 0, tensor-wise scale of A). Epilogue.
    n: Vector over C's columns (column-wise or tensor-wise scale of B). Epilogue.
    out: Operand over C's own scales [M, ceil(N / 128)], WRITTEN: C is fp8 and each row's
       128-column blocks are quantised in the epilogue (``quantize_tile``), so the next GEMM
       reads C as its 1x128-scaled A. BLOCK_N (after SwiGLU) must be a multiple of 128.
    """

    a: Any = NO_OPERAND
    b: Any = NO_OPERAND
    m: Any = NO_VECTOR
    n: Any = NO_VECTOR
    out: Any = NO_OPERAND


NO_SCALES = Scales()  # what an unscaled GEMM passes


class SplitK(NamedTuple):
    """Split ``index`` of a split-K tile and the buffers of ``split_k_combine``. ``tile``:
    None for the dense layout ([SPLIT_K * M, N] partials, counters by tile position), or the
    tile's id for one [BLOCK_M, BLOCK_N] slot per (tile, split) (grouped/'s ragged tiles,
    whose rows are a group's)."""

    index: Any
    ws: Any
    locks: Any
    tile: Any = None


class Segment(NamedTuple):
    """A stream-K program's part of one output tile (``stream_k``): K blocks [lo, hi) of it.

    parts: how many programs share the tile (1: this one computes it whole, no workspace).
    slot: where this part's fp32 partial goes in ``ws`` (two slots per program: its first
       and its last part). first_prog, first_slot: the tile's first program and that
       program's slot for it; part c > 0 is program first_prog + c's first part (slot
       2 * (first_prog + c)). ws: fp32 [2 * programs, BLOCK_M * BLOCK_N]; lock: the tile's
       int32 counter, zero before the launch, left zero after it.
    """

    lo: Any
    hi: Any
    parts: Any = 1
    slot: Any = 0
    first_prog: Any = 0
    first_slot: Any = 0
    ws: Any = None
    lock: Any = None


class Combine(NamedTuple):
    """MoE GEMM2's top-k sum after its store (``combine_pairs``): the last fields of a Routing
    (``Routing(gather, scatter, weight, *combine)``; Triton 3.6 mishandles a specialised value
    of a tuple nested in a tuple, so they are not a field of their own). C's rows are the
    (token, slot) pairs p = t * k + j of every token, each stored exactly once per column tile
    (other ranks' pairs too, as zeros).

    out [T, N] (strides out_stride0, out_stride1): out[t] = the sum over slots j of
    C[t * k + j] whose id is in [0, E), in slot order in fp32. tickets: int32
    [T * cdiv(N, BLOCK_N)], zero before the launch (one per token and column tile); None: no
    combine. ids [T, k] (int32 / int64; strides ids_stride0, ids_stride1): the pairs' experts.
    """

    out: Any = None
    out_stride0: Any = 0
    out_stride1: Any = 0
    tickets: Any = None
    ids: Any = None
    ids_stride0: Any = 0
    ids_stride1: Any = 0
    k: Any = 0
    E: Any = 0


# The MoE rows of a ragged tile (each None when absent), indexed by the grouped row.
# gather: int32; A row of grouped row r is gather[r] (GEMM1 reads token rows of x in place).
# scatter: int32; C row of grouped row r is scatter[r] (GEMM2 writes each (token, slot) row).
# weight: the C row's multiplier, weight[C row] (the routing weight), after the activation.
# Then a Combine's fields (GEMM2 also sums each token's rows into ``out``; tickets None: no
# combine), flat: see Combine.
Routing = collections.namedtuple("Routing", ("gather", "scatter", "weight") + Combine._fields,
                                 defaults=(None, None, None) + tuple(Combine()))


class GroupK(NamedTuple):
    """A ragged K's group in the TMA flavour (grouped/): the descriptors keep the matrices'
    bases, end at the group's end and are read from column ``k0``. TMA's box offsets along a
    contiguous dimension are 16-byte multiples, so where A or B is K-contiguous the group's
    first ``head`` columns (k0 - head is its start) are summed through pointers first: ``a``,
    ``b`` pointer Operands at the group's start (``_group_k_head``)."""

    k0: Any
    a: Any
    b: Any
    head: Any


_HEAD_K = tl.constexpr(32)  # a tl.dot's K (fp8's smallest) holding a head of under 16 bytes


class Fill(NamedTuple):
    """Write ``value`` instead of a product when ``on`` (grouped/: rows past the last offset
    are 0, every element is NaN for bad offsets)."""

    on: Any
    value: Any


class TileSpec(NamedTuple):
    """The tile body's constexprs (a kernel builds one from its own).

    ACTIVATION: None, "relu", "gelu", "gelu_tanh", "silu" (``activate``).
    UPCAST: convert tiles to fp32 before tl.dot (bf16 under the interpreter, which computes
        garbage on bf16: docs/interpreter.md). PRECISION: tl.dot's input_precision for fp32.
    USE_TMA, A_K_CONTIG, B_K_CONTIG: the TMA flavour and its operand orientation
        (``make_operands``). WARP_SPECIALIZE: the warp-specialised K loop (``mma_k_loop``).
    SPLIT_K: K splits per tile. SA_ROWS, SB_COLS: rows / columns per block scale (``Scales``).
    SWIGLU: B holds gate then up columns; the tile writes silu(gate) * up (``gemm_tile``).
    B_W4: B holds 4-bit weights, "mxfp4" or "int4" (core/scaling.py; ``_w4_k_block``), two per
        byte along K, dequantised to A's dtype in the K loop; W4_GROUP values along K per scale.
    W4_TMA: with B_W4 and pointer loads for A and C, B's packed bytes come through a tensor
        descriptor (``make_operands``): the copy engine fills shared memory with no address or
        mask arithmetic, which otherwise costs as much as the decode.
    W4_FRAG: with B_W4 "mxfp4", B is in fragment order (grouped/prepack.py, BLOCK_K = 128) and
        the tile is computed transposed, acc^T = W X^T, so that the decoded weight is wgmma's
        register operand as it leaves the decode (``_w4_frag_k_block``).
    """

    BLOCK_M: Any
    BLOCK_N: Any
    BLOCK_K: Any
    ACTIVATION: Any = None
    UPCAST: Any = False
    PRECISION: Any = "ieee"
    USE_TMA: Any = False
    A_K_CONTIG: Any = True
    B_K_CONTIG: Any = True
    WARP_SPECIALIZE: Any = False
    SPLIT_K: Any = 1
    SA_ROWS: Any = 1
    SB_COLS: Any = 1
    SWIGLU: Any = False
    B_W4: Any = None
    W4_GROUP: Any = 32
    W4_TMA: Any = False
    W4_FRAG: Any = False


@triton.jit
def swizzle_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear tile id to (pid_m, pid_n), walking GROUP_M row-blocks column by column.

    The last group is shorter when num_pid_m % GROUP_M != 0; ``group_size_m`` shrinks to what
    is left, otherwise its tiles would map past num_pid_m (and others never be visited).
    """
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def program_units(units, PERSISTENT: tl.constexpr):
    """How many work units (output tiles, or K splits of them) this program runs.

    Launch-per-tile: 1, its own unit ``program_id``. PERSISTENT: units pid, pid + P, ... below
    ``units`` (P = the grid size), so a kernel walks both schedules with one loop:

        for i in tl.range(0, program_units(units, PERSISTENT)):
            unit = tl.program_id(0) + i * tl.num_programs(0)

    Launch-per-tile, the loop's bounds are then the constants (0, 1) and the compiler removes
    it; a loop from pid to pid + 1 is not removed, and it slowed small and warp-specialised
    tiles (docs/performance.md).
    """
    if PERSISTENT:
        return tl.cdiv(units - tl.program_id(0), tl.num_programs(0))
    else:
        return 1


@triton.jit
def tile_range(pid, size, BLOCK: tl.constexpr):
    """Offsets of block ``pid`` along one dimension, and which of them lie inside ``size``.

    Returns (offs, wrapped, mask): ``wrapped = offs % size`` is always a valid index, so a load
    through it needs no mask (the overhanging rows re-read real data and are never stored).

    The block origin goes through int64 so that it is not the same value as the TMA
    coordinate ``pid * BLOCK`` the caller computes: Triton 3.6's Hopper warp specialisation
    shifts both ``tl.arange`` and the TMA coordinate for its second consumer warpgroup, and a
    shared value was shifted twice (docs/hopper.md; tests/test_blockscaled.py
    test_warp_specialize_switch).
    """
    offs = (pid.to(tl.int64) * BLOCK).to(tl.int32) + tl.arange(0, BLOCK)
    return offs, offs % size, offs < size


@triton.jit
def make_operands(A, B, C, M, N, K, spec):
    """What the K loop and the store read and write: Operands (A, B, C).

    Pointer flavour: A, B, C unchanged. TMA flavour (spec.USE_TMA): their ``ptr`` becomes a
    tensor descriptor (a persistent kernel builds them once for all its tiles):
      A: over A [M, K] with [BLOCK_M, BLOCK_K] boxes if A_K_CONTIG (stride1 == 1), else over
         A's transpose [K, M] (stride0 == 1) with [BLOCK_K, BLOCK_M] boxes;
      B: over B [K, N] with [BLOCK_K, BLOCK_N] boxes, or, if B_K_CONTIG (stride0 == 1, i.e.
         B = W.t()), over W [N, K] with [BLOCK_N, BLOCK_K] boxes;
      C: over C [M, N] (stride1 == 1) with [BLOCK_M, BLOCK_N] boxes.
    W4_TMA (A and C stay pointers): B's ptr becomes a descriptor over the packed weights as
    stored, W [N, K/2] uint8 (B = W.t() viewed as [K/2, N], stride0 == 1), with
    [BLOCK_N, BLOCK_K/2] boxes; with SWIGLU over [2, N, K/2] (gate rows, then up rows) with
    [1, BLOCK_N/2, BLOCK_K/2] boxes; W4_FRAG: over the [rows, ceil(K/128) * 64] fragment-order
    rows (2N with SWIGLU) with [BLOCK_N, 64] boxes. The host (core/tma.py) has checked the unit strides and the
    16-byte alignment TMA needs.
    """
    if spec.W4_TMA:
        HALF: tl.constexpr = spec.BLOCK_K // 2
        if spec.W4_FRAG:  # rows as stored (SwiGLU's gate and up already interleaved), K padded
            rows = 2 * N if spec.SWIGLU else N
            b = tl.make_tensor_descriptor(B.ptr, [rows, tl.cdiv(K, spec.BLOCK_K) * HALF], [B.stride1, 1],
                                          [spec.BLOCK_N, HALF])
        elif spec.SWIGLU:
            b = tl.make_tensor_descriptor(B.ptr, [2, N, K // 2], [N * B.stride1, B.stride1, 1],
                                          [1, spec.BLOCK_N // 2, HALF])
        else:
            b = tl.make_tensor_descriptor(B.ptr, [N, K // 2], [B.stride1, 1], [spec.BLOCK_N, HALF])
        return A, Operand(b, B.stride0, B.stride1), C
    elif spec.USE_TMA:
        BM: tl.constexpr = spec.BLOCK_M
        BN: tl.constexpr = spec.BLOCK_N
        BK: tl.constexpr = spec.BLOCK_K
        if spec.A_K_CONTIG:
            a = tl.make_tensor_descriptor(A.ptr, [M, K], [A.stride0, 1], [BM, BK])
        else:
            a = tl.make_tensor_descriptor(A.ptr, [K, M], [A.stride1, 1], [BK, BM])
        if spec.B_K_CONTIG:
            b = tl.make_tensor_descriptor(B.ptr, [N, K], [B.stride1, 1], [BN, BK])
        else:
            b = tl.make_tensor_descriptor(B.ptr, [K, N], [B.stride0, 1], [BK, BN])
        c = tl.make_tensor_descriptor(C.ptr, [M, N], [C.stride0, 1], [BM, BN])
        return Operand(a, A.stride0, A.stride1), Operand(b, B.stride0, B.stride1), Operand(c, C.stride0, C.stride1)
    else:
        return A, B, C


@triton.jit
def _block_scale(kb, scales, sa_idx, sb_idx, SA_UNIFORM: tl.constexpr, SB_UNIFORM: tl.constexpr, valid=None):
    """K block ``kb``'s multipliers (mma_k_loop's per-K-block scales) as (by row, by column):
    [BLOCK_M, 1] and [1, BLOCK_N] factors, or scalars, folded where one side is uniform so a
    promotion costs one multiply per element where it can and two where both vary. Kept
    apart rather than multiplied into a [BLOCK_M, BLOCK_N] tile, which would be built in the
    loads' layout and converted to the MMA's through shared memory every K block.
    ``valid`` False (K == 0: there is no block) reads nothing."""
    HAS_A: tl.constexpr = scales.a.ptr is not None
    HAS_B: tl.constexpr = scales.b.ptr is not None
    sa = 1.0
    sb = 1.0
    if HAS_A:
        sa = tl.load(scales.a.ptr + sa_idx.to(tl.int64) * scales.a.stride0 + kb * scales.a.stride1, mask=valid)
    if HAS_B:
        sb = tl.load(scales.b.ptr + kb * scales.b.stride0 + sb_idx.to(tl.int64) * scales.b.stride1, mask=valid)
    if HAS_A and not SA_UNIFORM:
        if HAS_B and not SB_UNIFORM:
            return sa[:, None], sb[None, :]
        else:
            return sa[:, None] * sb, 1.0
    else:
        if HAS_B and not SB_UNIFORM:
            return 1.0, sa * sb[None, :]
        else:
            return 1.0, sa * sb


@triton.jit
def _scale_indices(rows, cols, spec, off_m, off_n, scale_cols, SA_UNIFORM: tl.constexpr, SB_UNIFORM: tl.constexpr):
    """The scale_a rows of ``rows`` and the scale_b columns of ``cols`` (``_block_scale``'s
    indices): one index where one scale block covers the tile (UNIFORM), else one per row or
    column; ``scale_cols`` where the caller gives them (SwiGLU)."""
    if SA_UNIFORM:
        sa_idx = off_m // spec.SA_ROWS
    else:
        sa_idx = rows // spec.SA_ROWS
    if SB_UNIFORM:
        sb_idx = off_n // spec.SB_COLS
    elif scale_cols is not None:
        sb_idx = scale_cols
    else:
        sb_idx = cols // spec.SB_COLS
    return sa_idx, sb_idx


@triton.jit
def _k_block_pointers(A, B, rows, cols, offs_k, kb_lo, SPLIT: tl.constexpr, W4: tl.constexpr,
                      W4_TMA: tl.constexpr):
    """Pointer flavour: the pointers of A[rows, k] and B[k, cols] over the first K block (a
    split's ``kb_lo``); W4: of B's packed rows (two K each); W4_TMA: A's, and B's descriptor
    itself (``make_operands``), which is read by coordinates. int64: rows * stride passes 2^31
    elements for tall or widely strided operands, and so can a split's first column times a
    transposed A's K stride."""
    a_ptrs = A.ptr + rows.to(tl.int64)[:, None] * A.stride0 + offs_k[None, :] * A.stride1
    b_ptrs = B.ptr
    if not W4_TMA:
        if W4:
            b_rows = tl.arange(0, offs_k.shape[0] // 2)
        else:
            b_rows = offs_k
        b_ptrs = B.ptr + b_rows[:, None] * B.stride0 + cols.to(tl.int64)[None, :] * B.stride1
    if SPLIT:  # without a range the code is the plain loop's, unchanged
        k_first = kb_lo.to(tl.int64) * offs_k.shape[0]
        a_ptrs += k_first * A.stride1
        if not W4_TMA:
            b_ptrs += (k_first // 2 if W4 else k_first) * B.stride0
    return a_ptrs, b_ptrs


@triton.jit
def _pointer_k_block(a_ptrs, b_ptrs, offs_k, k_remaining, kb, cols, off_n, scales, spec):
    """Pointer flavour: the K block of A and B at the pointers, zero past K (``k_remaining``:
    K left from the block's first column). W4_TMA: B's packed block from its descriptor
    ``b_ptrs`` (the box past K/2 or N arrives zero-filled), columns from ``off_n``."""
    a = tl.load(a_ptrs, mask=offs_k[None, :] < k_remaining, other=0.0)
    if spec.B_W4 is not None:
        HALF: tl.constexpr = spec.BLOCK_K // 2
        if spec.W4_TMA and spec.SWIGLU and not spec.W4_FRAG:
            # gate and up rows interleaved, as the tile's columns are (``_gate_up``)
            gate = tl.reshape(b_ptrs.load([0, off_n // 2, kb * HALF]), (spec.BLOCK_N // 2, HALF))
            up = tl.reshape(b_ptrs.load([1, off_n // 2, kb * HALF]), (spec.BLOCK_N // 2, HALF))
            packed = tl.reshape(tl.permute(tl.join(gate, up), (0, 2, 1)), (spec.BLOCK_N, HALF))
        elif spec.W4_TMA:
            packed = b_ptrs.load([off_n, kb * HALF])
        elif spec.W4_FRAG:  # K is padded to the block: a byte's place is not its K
            packed = tl.trans(tl.load(b_ptrs))
        else:
            packed = tl.trans(tl.load(b_ptrs, mask=(2 * tl.arange(0, HALF))[:, None] < k_remaining, other=0))
        if spec.W4_FRAG:
            b = _w4_frag_k_block(packed, scales.b, kb, cols, k_remaining, a.dtype, spec.W4_GROUP)
        else:
            b = _w4_k_block(packed, scales.b, kb, cols, k_remaining, a.dtype, spec.B_W4, spec.W4_GROUP)
    else:
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)
    return a, b


@triton.jit
def _e2m1(code):
    """fp32 of 4-bit e2m1 codes (any integer type): sign bit 3, exponent bits 2-1 (bias 1),
    mantissa bit 0; exponent 0 holds 0 and 0.5."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
    return tl.where((c & 8) != 0, -magnitude, magnitude)


# e2m1 -> bf16 for 4 packed bytes (8 values) in one 32-bit register: each nibble's sign to
# bit 15 and its 3 magnitude bits to bits 8-6 (bf16's low exponent bits and top mantissa bit)
# make 2^-126 times its value (code 1, 0.5, a bf16 subnormal), which one mul.bf16x2 by 2^126
# corrects exactly. $0, $1: the low nibbles' values (bytes 0-1, 2-3); $2, $3: the high ones'.
_E2M1_PTX = tl.constexpr("""
{
.reg .b32 n, t, a, b, c;
mov.b32 c, 0x7E807E80;
and.b32 n, $4, 0x0F0F0F0F;
prmt.b32 t, n, 0, 0x4140;
shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $0, a, c;
prmt.b32 t, n, 0, 0x4342;
shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $1, a, c;
shr.u32 n, $4, 4;
and.b32 n, n, 0x0F0F0F0F;
prmt.b32 t, n, 0, 0x4140;
shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $2, a, c;
prmt.b32 t, n, 0, 0x4342;
shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $3, a, c;
}
""")
# INT4 -> bf16 likewise: each nibble n into a bf16 half as 0x4300 | n (128 + n, exact: the ulp
# at 128 is 1), then one sub.bf16x2 of 136 gives n - 8 exactly. Same registers as _E2M1_PTX.
_INT4_PTX = tl.constexpr("""
{
.reg .b32 n, t, c;
mov.b32 c, 0x43084308;
and.b32 n, $4, 0x0F0F0F0F;
prmt.b32 t, n, 0, 0x4140;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 $0, t, c;
prmt.b32 t, n, 0, 0x4342;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 $1, t, c;
shr.u32 n, $4, 4;
and.b32 n, n, 0x0F0F0F0F;
prmt.b32 t, n, 0, 0x4140;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 $2, t, c;
prmt.b32 t, n, 0, 0x4342;
or.b32 t, t, 0x43004300;
sub.rn.bf16x2 $3, t, c;
}
""")
_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def _e2m1_pairs(packed):
    """bf16 values of the (low, high) nibbles of uint8 ``packed``, exactly. On the GPU a few
    integer ops per 4 bytes (``_E2M1_PTX``): the arithmetic decode costs as much as the weight
    stream at decode. The interpreter, which runs no PTX, decodes arithmetically."""
    if _INTERPRET:
        return _e2m1(packed & 0xF).to(tl.bfloat16), _e2m1(packed >> 4).to(tl.bfloat16)
    return tl.inline_asm_elementwise(_E2M1_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=4)


@triton.jit
def _int4_pairs(packed):
    """bf16 values (nibble - 8) of the (low, high) nibbles of uint8 ``packed``, exactly: on the
    GPU ``_INT4_PTX``, under the interpreter integer ops."""
    if _INTERPRET:
        lo = ((packed & 0xF).to(tl.int32) - 8).to(tl.float32)  # (the interpreter bit-casts int -> bf16: via fp32)
        return lo.to(tl.bfloat16), ((packed >> 4).to(tl.int32) - 8).to(tl.float32).to(tl.bfloat16)
    return tl.inline_asm_elementwise(_INT4_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=4)


@triton.jit
def _e8m0_bf16(s):
    """bf16 2^(s - 127) of e8m0 scale bytes, exactly (s = 0 is the subnormal 0x0040, 255 NaN)."""
    s = s.to(tl.int32)
    bits = tl.where(s == 0, 0x0040, s << 7)
    bits = tl.where(s == 255, 0x7FC0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _w4_scales(sb, kb, cols, k_remaining, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, FORMAT: tl.constexpr):
    """The scales of K block kb's groups for ``cols``: [len(cols), BLOCK_K / SUB] of ``sb``
    (an Operand over [K / GROUP, N]), SUB = min(GROUP, BLOCK_K): a group longer than the block
    gives it one. Past K: MXFP4's 1.0 (127), INT4's 0."""
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP
    sk = tl.arange(0, BLOCK_K // SUB)
    first = kb * BLOCK_K + sk * SUB
    return tl.load(sb.ptr + cols.to(tl.int64)[:, None] * sb.stride1 + (first // GROUP).to(tl.int64)[None, :] * sb.stride0,
                   mask=(sk * SUB < k_remaining)[None, :], other=127 if FORMAT == "mxfp4" else 0)


# Fragment order (grouped/prepack.py): each 32-bit word holds the 8 e2m1 values of one thread's
# wgmma A registers for a 16-wide K chunk, coded so that each bf16 pair comes out in place:
# $0 = w & 0x81C081C0 (sign to bit 15 / 31, magnitude to bits 8-6 / 24-22, as _E2M1_PTX), $1 the
# same of w << 3, $2 of w << 6, $3 gathered from bits 14, 13, 11-10 (and 30, 29, 27-26); each
# then times 2^126. $0, $1: rows g, g + 8 at K 2c, 2c + 1; $2, $3: the same at K + 8.
_FRAG_PTX = tl.constexpr("""
{
.reg .b32 c, t, u;
mov.b32 c, 0x7E807E80;
and.b32 t, $4, 0x81C081C0;
mul.rn.bf16x2 $0, t, c;
shl.b32 t, $4, 3;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, c;
shl.b32 t, $4, 6;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, c;
shl.b32 t, $4, 1;
and.b32 t, t, 0x80008000;
shr.b32 u, $4, 4;
and.b32 u, u, 0x00C000C0;
or.b32 t, t, u;
shr.b32 u, $4, 5;
and.b32 u, u, 0x01000100;
or.b32 t, t, u;
mul.rn.bf16x2 $3, t, c;
}
""")
# Where _FRAG_PTX takes each value's (sign, e1, e0, m) bits: the slots of its outputs in order
# (x0, x1, x2, x3, y0, y1, y2, y3), x the first output's 4 values, y the second's.
FRAG_BITS = ((15, 8, 7, 6), (31, 24, 23, 22), (12, 5, 4, 3), (28, 21, 20, 19),
             (9, 2, 1, 0), (25, 18, 17, 16), (14, 13, 11, 10), (30, 29, 27, 26))
_FRAG_BITS = tl.constexpr(FRAG_BITS)


@triton.jit
def _frag_code(w, SLOT: tl.constexpr):
    """Interpreter: the e2m1 code in slot SLOT (FRAG_BITS) of int32 words ``w``."""
    bits: tl.constexpr = _FRAG_BITS[SLOT]
    return (((w >> bits[0]) & 1) << 3) | (((w >> bits[1]) & 1) << 2) | (((w >> bits[2]) & 1) << 1) | ((w >> bits[3]) & 1)


@triton.jit
def _frag_pairs(packed):
    """bf16 (x, y) of fragment-order bytes ``packed`` [R, C] (C a multiple of 4): as
    _FRAG_PTX, byte i of each 4-byte word gives x's and y's value i. On the GPU the words are
    the registers the compiled layout holds (4 consecutive bytes of a row); the interpreter
    forms them from the same 4 bytes and decodes arithmetically."""
    if _INTERPRET:
        R: tl.constexpr = packed.shape[0]
        C: tl.constexpr = packed.shape[1]
        b0, b1 = tl.split(tl.reshape(packed.to(tl.int32), (R, C // 4, 2, 2)))  # bytes (0, 2), (1, 3)
        lo, hi = tl.split(b0 | (b1 << 8))  # bytes 0-1 and 2-3 as 16-bit halves
        w = lo | (hi << 16)
        x = tl.join(tl.join(_frag_code(w, 0), _frag_code(w, 1)), tl.join(_frag_code(w, 2), _frag_code(w, 3)))
        y = tl.join(tl.join(_frag_code(w, 4), _frag_code(w, 5)), tl.join(_frag_code(w, 6), _frag_code(w, 7)))
        # join(join(v0, v1), join(v2, v3)) is [..., 2, 2] with v1 at [1, 0]: value i at [i % 2, i // 2]
        x = tl.reshape(tl.permute(x, (0, 1, 3, 2)), (R, C))
        y = tl.reshape(tl.permute(y, (0, 1, 3, 2)), (R, C))
        return _e2m1(x).to(tl.bfloat16), _e2m1(y).to(tl.bfloat16)
    return tl.inline_asm_elementwise(_FRAG_PTX, "=r,=r,=r,=r,r", [packed], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=4)


@triton.jit
def _w4_frag_k_block(packed, sb, kb, cols, k_remaining, dtype: tl.constexpr, GROUP: tl.constexpr):
    """W4_FRAG: the MXFP4 weight's K block kb as [BLOCK_N, 128] values of ``dtype``, rows
    ``cols`` in order, from ``packed`` [BLOCK_N, 64] fragment-order bytes (grouped/prepack.py:
    per 16 rows, stored row 2g + ch holds, for the quad lanes c = 2ch and 2ch + 1, 32 bytes
    each: per 16-wide K chunk q one word whose byte i = 2h + j holds row g + 8h at K
    16q + 2c + j (x) and + 8 (y)). The reshapes only rename registers: the layout the MMA wants
    for its register operand propagates back to the load. ``sb``, cols, k_remaining: as
    ``_w4_k_block``'s."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    x, y = _frag_pairs(packed)
    v = tl.reshape(tl.join(x, y), (BLOCK_N // 16, 8, 2, 2, 8, 2, 2, 2))  # (group, g, ch, cl, q, h, j, x|y)
    v = tl.reshape(tl.permute(v, (0, 5, 1, 4, 7, 2, 3, 6)), (BLOCK_N, 128))  # (group, h, g | q, x|y, ch, cl, j)
    s = _e8m0_bf16(_w4_scales(sb, kb, cols, k_remaining, 128, GROUP, "mxfp4"))
    GROUPS: tl.constexpr = s.shape[1]
    scale = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 128 // GROUPS)), (BLOCK_N, 128))
    if _INTERPRET:  # the interpreter's bf16 products are garbage (docs/interpreter.md)
        return (v.to(tl.float32) * scale.to(tl.float32)).to(tl.bfloat16).to(dtype)
    return (v * scale).to(dtype)  # exact in bf16; fp16 rounds once, as a conversion would


@triton.jit
def _w4_k_block(packed, sb, kb, cols, k_remaining, dtype: tl.constexpr, FORMAT: tl.constexpr, GROUP: tl.constexpr):
    """4-bit B's K block kb as [BLOCK_K, BLOCK_N] values of ``dtype`` from ``packed``
    [BLOCK_N, BLOCK_K/2] uint8 (byte j of a column holds K 2j in its low nibble and 2j + 1 in
    its high one) and ``sb``, an Operand over the scales [K / GROUP, N] (one per GROUP K of a
    column). FORMAT "mxfp4": e2m1 values, e8m0 scales, exact (an e2m1 value times a power of
    two is a bf16 value; fp16: rounded once, as a conversion of it would be). "int4": nibble - 8
    (exact in bf16) times the scale, rounded once to ``dtype``; int32 scales carry a zero point
    (core/scaling.py INT4_ZERO): (nibble - zero) times the scale, rounded once."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    BLOCK_K: tl.constexpr = 2 * packed.shape[1]
    s = _w4_scales(sb, kb, cols, k_remaining, BLOCK_K, GROUP, FORMAT)
    SUB: tl.constexpr = BLOCK_K // s.shape[1]
    GROUPS: tl.constexpr = s.shape[1]
    if FORMAT == "mxfp4":
        lo, hi = _e2m1_pairs(packed)
        values = tl.reshape(tl.join(lo, hi), (BLOCK_N, GROUPS, SUB))
        scale = _e8m0_bf16(s)[:, :, None]
        if _INTERPRET:  # the interpreter's bf16 products are garbage (docs/interpreter.md)
            values = (values.to(tl.float32) * scale.to(tl.float32)).to(tl.bfloat16)
        else:
            values = values * scale
    else:
        lo, hi = _int4_pairs(packed)
        values = tl.reshape(tl.join(lo, hi), (BLOCK_N, GROUPS, SUB))
        if s.dtype == tl.int32:  # a zero point in each scale word's low byte (core/scaling.py)
            zero = ((s & 0xFF) - 8).to(tl.float32)
            s = (s & -256).to(tl.float32, bitcast=True)
            values = ((values.to(tl.float32) - zero[:, :, None]) * s[:, :, None])  # (code - zero) * scale, exact
        elif s.dtype == tl.bfloat16 and dtype == tl.bfloat16 and not _INTERPRET:
            values = values * s[:, :, None]  # bf16 x bf16, rounded once: the fp32 product's rounding
        else:
            values = values.to(tl.float32) * s.to(tl.float32)[:, :, None]
    return tl.trans(tl.reshape(values, (BLOCK_N, BLOCK_K))).to(dtype)


@triton.jit
def _group_k_head(acc, group_k, rows, cols, spec):
    """(acc plus a ragged K's head, the descriptors' first K): see GroupK; (acc, 0) without one."""
    off_k = 0
    if group_k is not None:
        off_k = group_k.k0
        if spec.A_K_CONTIG or spec.B_K_CONTIG:
            k = tl.arange(0, _HEAD_K)
            a = tl.load(group_k.a.ptr + rows.to(tl.int64)[:, None] * group_k.a.stride0 + k[None, :] * group_k.a.stride1,
                        mask=k[None, :] < group_k.head, other=0.0)
            b = tl.load(group_k.b.ptr + k[:, None] * group_k.b.stride0 + cols.to(tl.int64)[None, :] * group_k.b.stride1,
                        mask=k[:, None] < group_k.head, other=0.0)
            if spec.UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=spec.PRECISION)
    return acc, off_k


@triton.jit
def _tma_k_block(A, B, k0, off_m, off_n, spec):
    """TMA flavour: the K block at column ``k0`` of A's rows from off_m and of B's columns from
    off_n. A column-major A or a row-major B is stored MN-contiguous; its box is loaded as
    stored and transposed in shared memory, which wgmma reads either way for 16-bit types
    (Triton converts for fp8, which wants K-major operands)."""
    if spec.A_K_CONTIG:
        a = A.ptr.load([off_m, k0])
    else:
        a = A.ptr.load([k0, off_m]).T
    if spec.B_K_CONTIG:
        b = B.ptr.load([off_n, k0]).T
    else:
        b = B.ptr.load([k0, off_n])
    return a, b


@triton.jit
def _unscaled_dot(acc, a, b, spec):
    """acc + a @ b for one K block without block scales (W4_FRAG: acc^T + W X^T, b the weight)."""
    if spec.W4_FRAG:  # (Triton compiles what follows a return in a constexpr if: no early returns)
        acc = tl.dot(b, tl.trans(a), acc, input_precision=spec.PRECISION)
    elif a.dtype.is_fp8():
        # Promote fp8 partial sums to fp32 once per K block rather than accumulating the
        # whole K loop inside the tensor core (about 14 bits there on Hopper).
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=spec.BLOCK_K)
    else:
        acc = tl.dot(a, b, acc, input_precision=spec.PRECISION)
    return acc


@triton.jit
def mma_k_loop(acc, A, B, rows, cols, K, spec, scales, off_m=0, off_n=0, kb_lo=0, kb_hi=None, scale_cols=None,
               group_k=None):
    """acc[BLOCK_M, BLOCK_N] += A[rows, 0:K] @ B[0:K, cols], in fp32 (W4_FRAG: summed transposed).

    A, B: Operands (pointer flavour: A[r, k] at A.ptr + r*A.stride0 + k*A.stride1; B[k, c]
        likewise; W.t() of an nn.Linear weight has B.stride0 == 1, the K-major layout Hopper's
        fp8 MMA wants), or ``make_operands``' descriptors (TMA flavour).
    rows [BLOCK_M], cols [BLOCK_N]: valid row/column indices (module docstring). The TMA flavour's tile
        starts at ``off_m``, ``off_n`` (K: a ragged K's GroupK ``group_k``); boxes past M, N, K are zero.
    K: the reduction length, any (the last block is masked by ``k_remaining``).
    spec: the TileSpec (BLOCK_K, UPCAST, PRECISION, the TMA flags, WARP_SPECIALIZE, SA_ROWS,
        SB_COLS; B_W4, W4_GROUP, W4_TMA: B 4-bit with its scales in ``scales.b``).

    Per-K-block scales (``scales.a`` / ``scales.b``, blockscaled/): K block ``kb`` of the
    product is multiplied by sa[rows // SA_ROWS, kb] per row and sb[kb, cols // SB_COLS] per
    column (BLOCK_K = the scale block, 128); each block's dot starts from zero and is promoted
    to the fp32 ``acc`` after scaling (Hopper's fp8 MMA accumulates in reduced precision,
    docs/hopper.md). Where one scale block covers the tile, one scalar per K block is read
    (``_scale_indices``). Scales are loaded a block ahead, their latency under the MMA.

    kb_lo, kb_hi: only K blocks [kb_lo, kb_hi) of the ceil(K / BLOCK_K) (default: all), what
        one split of a split-K tile sums (``split_k_range``); masks and scales stay indexed by
        the absolute K block, so a range ends at K exactly like the whole loop does.
    scale_cols [BLOCK_N]: the column of ``scales.b`` for each of ``cols`` (default
        cols // SB_COLS; SwiGLU's up columns have their own blocks, see ``gemm_tile``).

    WARP_SPECIALIZE: ``tl.range(warp_specialize=True)`` for the K loop, TMA flavour only (a TMA
    producer, two consumer warpgroups of BLOCK_M/2 rows on sm_90); not with pointer loads
    (Triton 3.6's Hopper pass asserts, triton-lang/triton#9728) or fp8 not both K-major.
    """
    BLOCK_K: tl.constexpr = spec.BLOCK_K
    W4: tl.constexpr = spec.B_W4 is not None
    SCALED: tl.constexpr = (scales.a.ptr is not None or scales.b.ptr is not None) and not W4
    SA_UNIFORM: tl.constexpr = spec.SA_ROWS % spec.BLOCK_M == 0
    # SwiGLU's interleaved gate and up columns are never one scale block.
    SB_UNIFORM: tl.constexpr = spec.SB_COLS % spec.BLOCK_N == 0 and not spec.SWIGLU
    sa_idx, sb_idx = _scale_indices(rows, cols, spec, off_m, off_n, scale_cols, SA_UNIFORM, SB_UNIFORM)
    offs_k = tl.arange(0, BLOCK_K)
    if spec.W4_FRAG:
        acc = tl.trans(acc)  # [BLOCK_N, BLOCK_M]: the weight is the MMA's first operand
    acc, off_k = _group_k_head(acc, group_k, rows, cols, spec)  # (acc, 0) without a group
    if not spec.USE_TMA:
        a_ptrs, b_ptrs = _k_block_pointers(A, B, rows, cols, offs_k, kb_lo, kb_hi is not None, W4, spec.W4_TMA)
    if kb_hi is None:
        kb_hi = tl.cdiv(K, BLOCK_K)
    if SCALED:
        row_scale, col_scale = _block_scale(kb_lo, scales, sa_idx, sb_idx, SA_UNIFORM, SB_UNIFORM, valid=kb_hi > kb_lo)
    # Triton 3.6 cannot warp-specialise fp8 tiles that must be transposed in shared memory
    # (an MN-major A or B): the sm_90 compile fails or aborts. Those run unspecialised.
    WS: tl.constexpr = spec.WARP_SPECIALIZE and spec.USE_TMA and (
        (spec.A_K_CONTIG and spec.B_K_CONTIG) or not A.ptr.dtype.is_fp8())
    for kb in tl.range(kb_lo, kb_hi, warp_specialize=WS):
        if spec.USE_TMA:
            a, b = _tma_k_block(A, B, off_k + kb * BLOCK_K, off_m, off_n, spec)
        else:
            a, b = _pointer_k_block(a_ptrs, b_ptrs, offs_k, K - kb * BLOCK_K, kb, cols, off_n, scales, spec)
        if spec.UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if not SCALED:
            acc = _unscaled_dot(acc, a, b, spec)
        else:
            # The next block's scales are loaded before this block's MMA, so their global
            # load latency hides behind it (the promotion must wait for the MMA anyway).
            # The last block re-reads its own scales (an index past them is out of bounds).
            next_row, next_col = _block_scale(tl.minimum(kb + 1, kb_hi - 1), scales, sa_idx, sb_idx, SA_UNIFORM,
                                              SB_UNIFORM)
            part = tl.dot(a, b, input_precision=spec.PRECISION)
            acc += part * row_scale * col_scale
            row_scale = next_row
            col_scale = next_col
        if not spec.USE_TMA:
            a_ptrs += BLOCK_K * A.stride1
            if not spec.W4_TMA:
                b_ptrs += (BLOCK_K // 2 if W4 else BLOCK_K) * B.stride0
    if spec.W4_FRAG:
        acc = tl.trans(acc)
    return acc


@triton.jit
def activate(x, ACTIVATION: tl.constexpr):
    """x -> act(x) in fp32. ACTIVATION: None, "relu", "gelu" (erf), "gelu_tanh", "silu"."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # 1/sqrt(2)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no tanh needed (libdevice is not in the interpreter).
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2*sqrt(2/pi)
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def epilogue(acc, offs_m, offs_n, mask_m, mask_n, ACTIVATION: tl.constexpr, scales, bias, weight=None,
             weight_idx=None):
    """out = weight[:, None] * act(acc * scales.m[:, None] * scales.n[None, :] + bias[None, :]).

    Each term is optional (a None ``ptr`` or weight switches it off at compile time).
    ``scales.m`` / ``.n``: Vectors of dequantisation multipliers by output row / column
    (stride 0: one scalar). bias: a Vector, loaded in its own dtype and used in fp32. weight: a per-row multiplier
    applied after the activation (the MoE routing weight); ``weight_idx`` [BLOCK_M] says which
    element belongs to each row.
    """
    if scales.m.ptr is not None:
        row_scale = tl.load(scales.m.ptr + offs_m.to(tl.int64) * scales.m.stride, mask=mask_m, other=0.0)
        acc = acc * row_scale.to(tl.float32)[:, None]
    if scales.n.ptr is not None:
        col_scale = tl.load(scales.n.ptr + offs_n.to(tl.int64) * scales.n.stride, mask=mask_n, other=0.0)
        acc = acc * col_scale.to(tl.float32)[None, :]
    if bias.ptr is not None:
        b = tl.load(bias.ptr + offs_n.to(tl.int64) * bias.stride, mask=mask_n, other=0.0)
        acc = acc + b.to(tl.float32)[None, :]
    acc = activate(acc, ACTIVATION)
    if weight is not None:
        w = tl.load(weight + weight_idx, mask=mask_m, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    return acc


@triton.jit
def quantize_tile(acc, S, rows, pid_n, N, mask_m, mask_n, dtype: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] -> its fp8 ``dtype`` values (in fp32, on the fp8 grid: the
    store's cast is exact) with one scale per row per 128 columns (core/fp8.py's rule, the
    same as quantize_fp8's 1x128 blocks); the scales are stored at
    S[rows, pid_n * BLOCK_N / 128 + j] (S: an Operand over [M, ceil(N / 128)]). Columns past
    N are zeroed first: they hold re-read data (``tile_range``) that must not set an amax.
    """
    BM: tl.constexpr = acc.shape[0]
    BN: tl.constexpr = acc.shape[1]
    NB: tl.constexpr = BN // _SCALE_BLOCK
    acc = tl.where(mask_n[None, :], acc, 0.0)
    blocks = tl.reshape(acc, (BM, NB, _SCALE_BLOCK))
    scale = fp8_scale(tl.max(amax_input(blocks), axis=2), dtype)
    q = fp8_grid(blocks, scale[:, :, None], dtype)
    blk = pid_n * NB + tl.arange(0, NB)
    s_ptrs = S.ptr + rows.to(tl.int64)[:, None] * S.stride0 + blk.to(tl.int64)[None, :] * S.stride1
    tl.store(s_ptrs, scale, mask=mask_m[:, None] & (blk < tl.cdiv(N, _SCALE_BLOCK))[None, :])
    return tl.reshape(q, (BM, BN))


@triton.jit
def store_tile(C, acc, offs_m, offs_n, mask_m, mask_n, USE_TMA: tl.constexpr = False, off_m=0, off_n=0):
    """C[offs_m, offs_n] = acc cast to C's dtype, masked to the rows and columns that exist.

    TMA flavour (USE_TMA): C.ptr is ``make_operands``' descriptor and the tile starts at
    (off_m, off_n); the TMA unit clips the box at the matrix edge, so no mask is needed.
    """
    if USE_TMA:
        C.ptr.store([off_m, off_n], acc.to(C.ptr.dtype))
    else:
        c_ptrs = C.ptr + offs_m.to(tl.int64)[:, None] * C.stride0 + offs_n.to(tl.int64)[None, :] * C.stride1
        tl.store(c_ptrs, acc.to(C.ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def combine_pairs(C, pairs, offs_n, mask_m, mask_n, pid_n, N, BLOCK_N: tl.constexpr, combine):
    """``combine`` (a Routing's Combine fields) after a scattered tile's store (rows ``pairs`` of C, columns ``offs_n``): each
    stored row takes a ticket on its token's counter for this column tile; the row that gets
    the k-th sums the token's k rows of C in slot order, skipping other ranks' slots, and
    stores out[t]. The sum reads stored values only, so it is the same whichever tile arrives
    last (deterministic: no atomics on values), and nobody waits for anybody."""
    t = pairs // combine.k
    # Every thread's rows are stored before the tickets; acq_rel at GPU scope orders the
    # other tiles' stores before the last arrival's loads (as split_k_combine's).
    tl.debug_barrier()
    ticket = tl.atomic_add(combine.tickets + t * tl.cdiv(N, BLOCK_N) + pid_n, 1, mask=mask_m, sem="acq_rel", scope="gpu")
    last = mask_m & (ticket == combine.k - 1)
    tl.debug_barrier()
    t64 = t.to(tl.int64)
    cols = offs_n.to(tl.int64)[None, :]
    # Slot j's id and row, stepped through the loop. The steps are tensors: Triton 3.6 fails to
    # compile a specialised stride of 1 from a nested tuple used inside a runtime loop.
    ids_at = combine.ids + t64 * combine.ids_stride0
    ids_step = combine.ids_stride1 + tl.zeros_like(t64)
    c_at = C.ptr + (t64 * combine.k)[:, None] * C.stride0 + cols * C.stride1
    c_step = C.stride0 + tl.zeros_like(t64)[:, None]
    experts = combine.E + tl.zeros_like(t)
    acc = tl.zeros((pairs.shape[0], BLOCK_N), dtype=tl.float32)
    for _ in range(combine.k):
        e = tl.load(ids_at, mask=last, other=-1)
        use = last & (e >= 0) & (e < experts)
        # .cg: from L2, where the other SMs' rows are (not a stale L1 line)
        acc += tl.load(c_at, mask=use[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
        ids_at += ids_step
        c_at += c_step
    tl.store(combine.out + t64[:, None] * combine.out_stride0 + cols * combine.out_stride1,
             acc.to(combine.out.dtype.element_ty), mask=last[:, None] & mask_n[None, :])


@triton.jit
def split_k_range(split, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """The K blocks [kb_lo, kb_hi) that split ``split`` of SPLIT_K sums: ceil(blocks / SPLIT_K)
    consecutive blocks each, the last splits shorter or empty (K of 2 blocks over 4 splits
    leaves two empty; they still write a zero partial, see ``split_k_combine``)."""
    num_kb = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(num_kb, SPLIT_K)
    kb_lo = tl.minimum(split * per_split, num_kb)
    return kb_lo, tl.minimum(kb_lo + per_split, num_kb)


@triton.jit
def split_k_combine(acc, split, tile_id, M, N, offs_m, offs_n, mask_m, mask_n, SPLIT_K: tl.constexpr):
    """Split-K's reduction: returns (sum of the tile's SPLIT_K partials, is_last).

    Every split stores its fp32 partial ``acc`` into the workspace and then takes a ticket on
    its tile's counter; only the split that arrives last gets ``is_last`` and the sum, which it
    reads back in split order, so the result does not depend on which split finished first
    (deterministic, unlike atomically added partials). Nobody waits for anybody, so no
    schedule of the programs can deadlock. The last split puts the counter back to 0: the
    buffers then serve the next launch as they are (autotune repetitions, CUDA-graph replays).

    split: SplitK. split.ws: fp32 [SPLIT_K * M, N] contiguous; split s of C[i, j] at
    ws + (s*M + i)*N + j. split.locks: int32 [number of tiles], zero before the first launch;
    ``tile_id`` indexes it. (``split.tile`` set: ``_split_k_combine_slots`` instead.)
    """
    mask = mask_m[:, None] & mask_n[None, :]
    cols = offs_n.to(tl.int64)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    tl.store(split.ws + (split.index * M + rows) * N + cols, acc, mask=mask)
    # Every thread's partial is stored before the ticket is taken; the ticket's release and
    # acquire (acq_rel, GPU scope) order those stores before the last split's loads.
    tl.debug_barrier()
    ticket = tl.atomic_add(split.locks + tile_id, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == SPLIT_K - 1
    if is_last:
        acc = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            # .cg: read from L2, where the other SMs' partials are (not a stale L1 line).
            acc += tl.load(split.ws + (s * M + rows) * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(split.locks + tile_id, 0)
    return acc, is_last


@triton.jit
def _combine_splits(acc, split, tile_id, M, N, offs_m, offs_n, mask_m, mask_n, SPLIT_K: tl.constexpr):
    """gemm_tile's split-K reduction: in ``split.tile``'s slots where set, else
    ``split_k_combine``'s layout by ``tile_id``."""
    if split.tile is not None:
        acc, finish = _split_k_combine_slots(acc, split, SPLIT_K)
    else:
        acc, finish = split_k_combine(acc, split, tile_id, M, N, offs_m, offs_n, mask_m, mask_n, SPLIT_K)
    return acc, finish


@triton.jit
def _split_k_combine_slots(acc, split, SPLIT_K: tl.constexpr):
    """``split_k_combine`` over one [BLOCK_M, BLOCK_N] slot per (tile, split), the same
    protocol: split.ws fp32 [tiles, SPLIT_K, BLOCK_M * BLOCK_N] (dense, no masks),
    split.locks int32 [tiles], both indexed by split.tile."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = split.ws + split.tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
    tl.store(base + split.index * (BLOCK_M * BLOCK_N) + local, acc)
    tl.debug_barrier()
    ticket = tl.atomic_add(split.locks + split.tile, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == SPLIT_K - 1
    if is_last:
        acc = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(base + s * (BLOCK_M * BLOCK_N) + local, cache_modifier=".cg")
        tl.store(split.locks + split.tile, 0)
    return acc, is_last


@triton.jit
def stream_k_combine(acc, seg):
    """Stream-K's reduction of a tile shared by ``seg.parts`` programs: returns (the sum of
    all parts, is_last). As ``split_k_combine``: each part stores its partial, takes a ticket
    on the tile's counter, and the last to arrive sums the partials in part order
    (deterministic) and resets the counter; nobody waits. The workspace slot is tile-local,
    [BLOCK_M, BLOCK_N] dense, so it needs no masks."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(seg.ws + seg.slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + local, acc)
    tl.debug_barrier()
    ticket = tl.atomic_add(seg.lock, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == seg.parts - 1
    if is_last:
        # Its own part is read back too: kept in registers next to the sum, it spilled the
        # 128x256 tile (bench/results/persistent_default.md).
        acc = tl.zeros_like(acc)
        for c in range(seg.parts):
            slot = tl.where(c == 0, seg.first_slot, 2 * (seg.first_prog + c))
            acc += tl.load(seg.ws + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + local, cache_modifier=".cg")
        tl.store(seg.lock, 0)
    return acc, is_last


@triton.jit
def holder_of(x, iters, P):
    """The stream-K program whose iteration range [p * iters // P, (p+1) * iters // P) holds
    iteration ``x``."""
    return ((x + 1) * P + iters - 1) // iters - 1


@triton.jit
def stream_k(A, B, C, M, N, K, spec, scales, bias, ws, locks, sk_tiles, GROUP_M: tl.constexpr):
    """The stream-K schedule of the dense kernel (Stream-K, Osama et al. 2023): the first
    ``sk_tiles`` tiles (in GROUP_M order) are cut into their K blocks, and the programs share
    those sk_tiles * ceil(K / BLOCK_K) iterations evenly, each a contiguous run that may
    start and end inside a tile (``Segment``; shared tiles meet in ``stream_k_combine``);
    then each program walks the remaining tiles whole, persistent-style. core/configs.py
    ``stream_k_tiles`` picks sk_tiles (0: the plain persistent walk)."""
    num_pid_m = tl.cdiv(M, spec.BLOCK_M)
    num_pid_n = tl.cdiv(N, spec.BLOCK_N)
    tiles = num_pid_m * num_pid_n
    P = tl.num_programs(0)
    pid = tl.program_id(0)
    kb = tl.cdiv(K, spec.BLOCK_K).to(tl.int64)
    iters = sk_tiles * kb
    start = pid.to(tl.int64) * iters // P
    end = (pid + 1).to(tl.int64) * iters // P
    it = start
    while it < end:
        t = it // kb
        first, last = holder_of(t * kb, iters, P), holder_of((t + 1) * kb - 1, iters, P)
        first_slot = 2 * first + (first * iters // P < t * kb).to(tl.int64)
        hi = tl.minimum(kb, end - t * kb)
        seg = Segment((it - t * kb).to(tl.int32), hi.to(tl.int32), (last - first + 1).to(tl.int32),
                      2 * pid + (it != start).to(tl.int32), first.to(tl.int32), first_slot.to(tl.int32), ws, locks + t)
        pid_m, pid_n = swizzle_tile(t.to(tl.int32), num_pid_m, num_pid_n, GROUP_M)
        gemm_tile(pid_m, pid_n, A, B, C, M, N, K, spec, scales, Routing(), bias, segment=seg)
        it = t * kb + hi
    for i in tl.range(0, tl.cdiv(tiles - sk_tiles - pid, P)):  # the plain persistent loop's form
        pid_m, pid_n = swizzle_tile(sk_tiles + pid + i * P, num_pid_m, num_pid_n, GROUP_M)
        gemm_tile(pid_m, pid_n, A, B, C, M, N, K, spec, scales, Routing(), bias)


@triton.jit
def _gate_up(gate, up_offset, BLOCK_N: tl.constexpr):
    """SwiGLU's [BLOCK_N] B columns (or their scale columns) from the tile's [BLOCK_N / 2] gate
    ones: gate and up interleaved (j, up_offset + j, j + 1, ...)."""
    return tl.reshape(tl.join(gate, gate + up_offset), (BLOCK_N,))


@triton.jit
def gemm_tile(pid_m, pid_n, A, B, C, M, N, K, spec, scales, routing, bias, split=None, row0=0, fill=None, segment=None,
              group_k=None):
    """One BLOCK_M x BLOCK_N tile of C = act(A @ B + bias): K loop, epilogue, store.

    A [M, K], B [K, N], C [M, N]: Operands, or ``make_operands``' descriptors (spec.USE_TMA).
    spec: TileSpec. scales: Scales (NO_SCALES for an unscaled GEMM). bias: Vector (NO_VECTOR: none).
    routing: Routing (grouped/ MoE; all None elsewhere): the tile's rows are grouped rows
        row0 + [0, M), by which the gather/scatter arrays and the routing weight are indexed.
        A scattered C is stored through pointers (C.ptr must then be a pointer, also in the
        TMA flavour); with its Combine fields the stored rows are then summed per token (``combine_pairs``).
    split: SplitK when spec.SPLIT_K > 1: this program sums split ``split.index`` of the tile's
        K blocks (``split_k_range``); the last split to finish sums the partials and alone runs
        the epilogue and the store (``_combine_splits``; core/splitk.py is the host side).
    spec.SWIGLU: B has 2N columns, gate then up, interleaved in the tile (``_gate_up``; W4_FRAG:
        stored interleaved) so ONE dot computes both; the tile writes silu(gate) * up, BLOCK_N/2 columns of C.
    fill: a Fill; when ``fill.on`` the tile stores ``fill.value`` instead of a product.
    segment: a stream-K Segment (``stream_k``): only its K blocks; the tile's last part stores.
    scales.out: C is fp8 and the tile is quantised before its store (``quantize_tile``).
    group_k: a ragged K's GroupK in the TMA flavour (K is then what its descriptors' loop sums).
    """
    BLOCK_M: tl.constexpr = spec.BLOCK_M
    BLOCK_N: tl.constexpr = spec.BLOCK_N
    BLOCK_N_OUT: tl.constexpr = BLOCK_N // 2 if spec.SWIGLU else BLOCK_N
    offs_m, wrapped_m, mask_m = tile_range(pid_m, M, BLOCK_M)
    offs_n, cols, mask_n = tile_range(pid_n, N, BLOCK_N_OUT)
    rows = wrapped_m
    out_rows = offs_m
    # Fields, not the Routing itself, are compared with None: Triton 3.6 cannot compare a
    # tuple holding None elements.
    if routing.gather is not None:
        rows = tl.load(routing.gather + row0 + wrapped_m)
    if routing.scatter is not None:
        out_rows = tl.load(routing.scatter + row0 + wrapped_m)
    scale_cols = None
    if spec.SWIGLU:
        # Gate and up weights are quantised apart (a checkpoint's gate_proj and up_proj), so
        # the up columns' scale blocks follow all of the gate's: ceil(N / SB_COLS) of them.
        if scales.b.ptr is not None:
            scale_cols = _gate_up(cols // spec.SB_COLS, tl.cdiv(N, spec.SB_COLS), BLOCK_N)
        cols = _gate_up(2 * cols, 1, BLOCK_N) if spec.W4_FRAG else _gate_up(cols, N, BLOCK_N)
    kb_lo, kb_hi = 0, None
    if spec.SPLIT_K > 1:
        kb_lo, kb_hi = split_k_range(split.index, K, spec.BLOCK_K, spec.SPLIT_K)
    if segment is not None:
        kb_lo, kb_hi = segment.lo, segment.hi
    # Without a Fill, ``filled`` is a constant false and the compiler drops the branch.
    filled = False
    fill_value = 0.0
    if fill is not None:
        filled = fill.on
        fill_value = fill.value
    finish = True
    if filled:
        acc = tl.zeros((BLOCK_M, BLOCK_N_OUT), tl.float32) + fill_value
        finish = split.index == 0 if spec.SPLIT_K > 1 else True  # one split stores a filled tile
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = mma_k_loop(acc, A, B, rows, cols, K, spec, scales, pid_m * BLOCK_M, pid_n * BLOCK_N, kb_lo, kb_hi, scale_cols,
                         group_k)
        if spec.SPLIT_K > 1:  # the splits' sums meet before SwiGLU, which is not linear
            acc, finish = _combine_splits(acc, split, pid_m * tl.cdiv(N, BLOCK_N) + pid_n, M, N, offs_m, offs_n, mask_m,
                                          mask_n, spec.SPLIT_K)
        if spec.SWIGLU:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N_OUT, 2)))
            acc = activate(gate, "silu") * up
        if segment is not None:
            if segment.parts > 1:
                acc, finish = stream_k_combine(acc, segment)
        if finish:
            acc = epilogue(acc, offs_m, offs_n, mask_m, mask_n, spec.ACTIVATION, scales, bias, routing.weight, out_rows)
    if finish:
        # A scattered C is written row by row through pointers.
        TMA_STORE: tl.constexpr = spec.USE_TMA and routing.scatter is None
        if scales.out.ptr is not None:
            acc = quantize_tile(acc, scales.out, out_rows, pid_n, N, mask_m, mask_n,
                                C.ptr.dtype if TMA_STORE else C.ptr.dtype.element_ty)
        store_tile(C, acc, out_rows, offs_n, mask_m, mask_n, TMA_STORE, pid_m * BLOCK_M, pid_n * BLOCK_N)
        if routing.tickets is not None:
            combine_pairs(C, out_rows, offs_n, mask_m, mask_n, pid_n, N, BLOCK_N_OUT, routing)
