"""The grouped kernels: core's tile body with per-group base pointers and sizes.

Two kernels, both built from core/tiles.py (grouped_tile, tile_range, mma_k_loop, epilogue,
store_tile, gemm_tile); nothing here re-implements a K loop, an epilogue or a store.

* ``ragged_kernel``: torch._grouped_mm's four modes and the two MoE expert GEMMs. One dimension
  (M, N or K) is cut into G groups by ``offs`` (int32 cumulative END offsets), or none is
  (3D x 3D). The offsets stay on the device: the host never learns the group sizes, so the grid
  is an UPPER BOUND on the number of tiles (``sum_g cdiv(size_g, B) <= cdiv(total, B) + G + 1``)
  and each program finds its group from ``offs`` itself (``locate_tile``). That keeps the call
  free of host syncs and CUDA-graph capturable: the grid depends only on shapes.
* ``list_kernel``: list mode, every pair its own (M, N, K), read from device arrays of
  pointers, sizes and strides; a persistent walk over all tiles of all groups.

Where the operands allow it (row-major, 16-byte aligned group bases), the ragged kernel takes
core's TMA flavour with one descriptor per group: its shape is the group's, so the TMA unit
zero-fills and clips at group edges exactly where the pointer flavour masks.
"""

import triton
import triton.language as tl

from ..core.tiles import (
    activate,
    epilogue,
    gemm_tile,
    grouped_tile,
    make_operands,
    mma_k_loop,
    store_tile,
    tile_range,
)


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
def group_spans(offs_ptr, stride_offs, G, total, G_BLOCK: tl.constexpr):
    """(idx, starts, sizes, bad) of the G groups of ``offs`` plus the TAIL group G.

    offs[g] is at offs_ptr + g * stride_offs (a strided view of offsets is read in place).
    Group g spans [offs[g-1], offs[g]) (offs[-1] := 0); the tail group G spans
    [offs[G-1], total): the rows (or columns) past the last offset, whose output is zero.
    Entries past G are empty. ``bad``: offs decrease, start below 0 or pass ``total``: the host
    does not check offs values without a sync, so the kernel must never trust them.
    """
    idx = tl.arange(0, G_BLOCK)
    ends = tl.load(offs_ptr + idx * stride_offs, mask=idx < G, other=0)
    ends = tl.where(idx < G, ends, total)
    starts = tl.load(offs_ptr + (idx - 1) * stride_offs, mask=(idx >= 1) & (idx <= G), other=0)
    starts = tl.where(idx <= G, starts, total)
    sizes = ends - starts
    bad = tl.sum((sizes < 0).to(tl.int32)) > 0
    return idx, starts, sizes, bad


@triton.jit
def locate_tile(tile, offs_ptr, stride_offs, G, total, BLOCK: tl.constexpr, G_BLOCK: tl.constexpr):
    """Block ``tile`` of the ragged dimension -> (g, start, size, local block, valid, bad).

    Blocks are numbered group after group, cdiv(size_g, BLOCK) per group, tail group last.
    With bad offs the whole dimension becomes one tail group (filled with NaN by the caller).
    """
    idx, starts, sizes, bad = group_spans(offs_ptr, stride_offs, G, total, G_BLOCK)
    starts = tl.where(bad, 0, starts)
    sizes = tl.where(bad, tl.where(idx == G, total, 0), sizes)
    tiles = (sizes + BLOCK - 1) // BLOCK
    g, first = find_group(tile, tiles, idx)
    start = tl.sum(tl.where(idx == g, starts, 0))
    size = tl.sum(tl.where(idx == g, sizes, 0))
    return g, start, size, tile - first, tile < tl.sum(tiles), bad


@triton.jit
def group_tile(
    pid_m, pid_n, a_g, b_g, c_g, bias_g, M_g, N_g, K_g,
    row0, a_rows_ptr, c_rows_ptr, weight_ptr, fill, fill_value,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias_n,
    SWIGLU: tl.constexpr, ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_TMA: tl.constexpr = False, A_K_CONTIG: tl.constexpr = True, B_K_CONTIG: tl.constexpr = True,
):
    """One output tile of one group: core's K loop, epilogue and store on the group's operands.

    a_g, b_g, c_g, bias_g: the group's A [M_g, K_g], B [K_g, *], C [M_g, N_g] and bias [N_g].
    a_rows_ptr (MoE GEMM1): A row of grouped row r is a_rows[row0 + r] (a gather of token
        rows through core's row index vector: no permuted copy of x exists).
    c_rows_ptr (MoE GEMM2): output row of grouped row r is c_rows[row0 + r] (a scatter).
    weight_ptr: per-output-row multiplier weight[output row] (the routing weight).
    SWIGLU: B has 2*N_g columns, gate then up. The tile's BLOCK_N B columns are gate and up
        columns interleaved (j, N_g + j, j+1, ...) so ONE dot computes both and the
        accumulator splits into [BLOCK_M, BLOCK_N/2] gate and up halves; the tile writes
        silu(gate) * up, BLOCK_N/2 columns wide. The [rows, 2I] product is never stored.
    fill: store ``fill_value`` (0 for rows past offs[-1], NaN for bad offs) instead of a product.
    USE_TMA: core's TMA flavour (not with a gather or SWIGLU; the host decides): descriptors
        over the GROUP's A [M_g, K_g], B and C [M_g, N_g], so the TMA unit zero-fills and clips
        at the group's edges, which is what the masks do for pointers. A scattered C
        (c_rows_ptr) is still stored through pointers.
    """
    BLOCK_N_OUT: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N
    offs_m, wrapped_m, mask_m = tile_range(pid_m, M_g, BLOCK_M)
    offs_n, wrapped_n, mask_n = tile_range(pid_n, N_g, BLOCK_N_OUT)
    rows = wrapped_m
    out_rows = offs_m
    if a_rows_ptr is not None:
        rows = tl.load(a_rows_ptr + row0 + wrapped_m)
    if c_rows_ptr is not None:
        out_rows = tl.load(c_rows_ptr + row0 + wrapped_m)
    a, b, c = make_operands(
        a_g, b_g, c_g, M_g, N_g, K_g, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_K_CONTIG, B_K_CONTIG,
    )
    if fill:
        acc = tl.zeros((BLOCK_M, BLOCK_N_OUT), tl.float32) + fill_value
    else:
        cols = wrapped_n
        if SWIGLU:
            cols = tl.reshape(tl.join(wrapped_n, wrapped_n + N_g), (BLOCK_N,))
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = mma_k_loop(
            acc, a, b, rows, cols, K_g,
            stride_am, stride_ak, stride_bk, stride_bn,
            BLOCK_K, UPCAST, PRECISION,
            USE_TMA=USE_TMA, off_m=pid_m * BLOCK_M, off_n=pid_n * BLOCK_N,
            A_K_CONTIG=A_K_CONTIG, B_K_CONTIG=B_K_CONTIG,
        )
        if SWIGLU:
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N_OUT, 2)))
            acc = activate(gate, "silu") * up
        acc = epilogue(
            acc, offs_m, offs_n, mask_m, mask_n, ACTIVATION,
            bias_g, stride_bias_n, weight_ptr=weight_ptr, weight_idx=out_rows,
        )
    if USE_TMA and c_rows_ptr is None:
        store_tile(c, acc, out_rows, offs_n, mask_m, mask_n, stride_cm, stride_cn, True, pid_m * BLOCK_M, pid_n * BLOCK_N)
    else:
        store_tile(c_g, acc, out_rows, offs_n, mask_m, mask_n, stride_cm, stride_cn)


@triton.jit
def ragged_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, offs_ptr, stride_offs,
    a_rows_ptr, c_rows_ptr, weight_ptr,
    G, M, N, K,
    stride_ag, stride_am, stride_ak,
    stride_bg, stride_bk, stride_bn,
    stride_cg, stride_cm, stride_cn,
    stride_bias_g, stride_bias_n,
    RAGGED: tl.constexpr, SWIGLU: tl.constexpr,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    G_BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr = False, A_K_CONTIG: tl.constexpr = True, B_K_CONTIG: tl.constexpr = True,
):
    """C_g = act(A_g @ B_g + bias_g) for G groups; the groups cut ONE dimension (RAGGED).

    Element [i, j] of group g of X is at x_ptr + g*stride_xg + i*stride_x0 + j*stride_x1; a 2-D
    operand has stride_xg = 0 and is cut by offs instead. Shapes by RAGGED:
      "M": a [M, K], b [G, K, N] (*), c [M, N];   group g = rows [offs[g-1], offs[g]).
      "N": a [G, M, K], b [K, N], c [M, N];       group g = columns of b and c.
      "K": a [M, K], b [K, N], c [G, M, N];       group g = a slice of the reduction.
      "":  a [G, M, K], b [G, K, N] (*), c [G, M, N]; no offs (batched).
    (*) with SWIGLU, b has 2N columns (gate then up) and c has N.
    M, N, K: the sizes; the ragged one is the total over groups. offs_ptr [G] int32, element g
        at offs_ptr + g * stride_offs.
    bias_ptr: bias_g[j] at bias_ptr + g*stride_bias_g + j*stride_bias_n ([G, N]; for "N" a
        [total N] vector with stride_bias_g = 0), or None.
    a_rows_ptr, c_rows_ptr [M] int32, weight_ptr: the MoE gather / scatter / routing weight
        ("M" only; see group_tile).
    G_BLOCK: next power of two >= G + 1 (the groups plus the tail group).
    USE_TMA, A_K_CONTIG, B_K_CONTIG: core's TMA flavour, per group (see group_tile); USE_TMA
        comes from the config.
    Grid (1-D, tiles in GROUP_M order), an upper bound that needs no offs values:
      "M": (cdiv(M, BLOCK_M) + G + 1) * cdiv(N, BLOCK_N_OUT); "N": cdiv(M, BLOCK_M) *
      (cdiv(N, BLOCK_N) + G + 1); "K" and "": G * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N).
      Programs past the real tile count return at once.
    Rows (columns) past offs[-1] are written as zero; with bad offs (decreasing, negative,
    past the total) every element of C is written as NaN: never a silent wrong answer.
    """
    BLOCK_N_OUT: tl.constexpr = BLOCK_N // 2 if SWIGLU else BLOCK_N
    pid = tl.program_id(0)
    start = 0
    size = 0
    valid = True
    fill = False
    fill_value = 0.0
    if RAGGED == "M":
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M) + G + 1, tl.cdiv(N, BLOCK_N_OUT), GROUP_M)
        g, start, size, pid_m, valid, bad = locate_tile(pid_m, offs_ptr, stride_offs, G, M, BLOCK_M, G_BLOCK)
        M_g = size
        N_g = N
        K_g = K
    elif RAGGED == "N":
        pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N) + G + 1, GROUP_M)
        g, start, size, pid_n, valid, bad = locate_tile(pid_n, offs_ptr, stride_offs, G, N, BLOCK_N, G_BLOCK)
        M_g = M
        N_g = size
        K_g = K
    else:
        tiles_per_group = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N_OUT)
        g = pid // tiles_per_group
        pid_m, pid_n = grouped_tile(pid % tiles_per_group, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N_OUT), GROUP_M)
        M_g = M
        N_g = N
        K_g = K
        bad = False
        if RAGGED == "K":
            idx, starts, sizes, bad = group_spans(offs_ptr, stride_offs, G, K, G_BLOCK)
            start = tl.sum(tl.where(idx == g, starts, 0))
            K_g = tl.sum(tl.where(idx == g, sizes, 0))
    if RAGGED != "":
        # The tail group (past offs[-1]) is zeros; bad offs make everything one NaN group.
        fill = (g == G) | bad
        fill_value = tl.where(bad, float("nan"), 0.0)
    if valid:
        # int64: group offsets times strides pass 2^31 elements on large MoE batches.
        g64 = g.to(tl.int64)
        a_g = a_ptr + g64 * stride_ag
        b_g = b_ptr + g64 * stride_bg
        c_g = c_ptr + g64 * stride_cg
        bias_g = bias_ptr
        if bias_ptr is not None:
            bias_g = bias_ptr + g64 * stride_bias_g
        row0 = 0
        if RAGGED == "M":
            row0 = start
            if a_rows_ptr is None:
                a_g += start.to(tl.int64) * stride_am
            if c_rows_ptr is None:
                c_g += start.to(tl.int64) * stride_cm
        if RAGGED == "N":
            b_g += start.to(tl.int64) * stride_bn
            c_g += start.to(tl.int64) * stride_cn
            if bias_ptr is not None:
                bias_g += start.to(tl.int64) * stride_bias_n
        if RAGGED == "K":
            a_g += start.to(tl.int64) * stride_ak
            b_g += start.to(tl.int64) * stride_bk
        group_tile(
            pid_m, pid_n, a_g, b_g, c_g, bias_g, M_g, N_g, K_g,
            row0, a_rows_ptr, c_rows_ptr, weight_ptr, fill, fill_value,
            stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias_n,
            SWIGLU, ACTIVATION, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            USE_TMA, A_K_CONTIG, B_K_CONTIG,
        )


@triton.jit
def list_kernel(
    a_ptrs, b_ptrs, c_ptrs, sizes_ptr, strides_ptr, G,
    a_like, b_like, c_like,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    G_BLOCK: tl.constexpr,
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
    idx = tl.arange(0, G_BLOCK)
    Ms = tl.load(sizes_ptr + idx * 3 + 0, mask=idx < G, other=0)
    Ns = tl.load(sizes_ptr + idx * 3 + 1, mask=idx < G, other=0)
    tiles = tl.cdiv(Ms, BLOCK_M) * tl.cdiv(Ns, BLOCK_N)
    for tile in range(tl.program_id(0), tl.sum(tiles), tl.num_programs(0)):
        g, first = find_group(tile, tiles, idx)
        M = tl.load(sizes_ptr + g * 3 + 0)
        N = tl.load(sizes_ptr + g * 3 + 1)
        K = tl.load(sizes_ptr + g * 3 + 2)
        pid_m, pid_n = grouped_tile(tile - first, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        a = tl.load(a_ptrs + g).to(tl.pointer_type(a_like.dtype.element_ty))
        b = tl.load(b_ptrs + g).to(tl.pointer_type(b_like.dtype.element_ty))
        c = tl.load(c_ptrs + g).to(tl.pointer_type(c_like.dtype.element_ty))
        st = strides_ptr + g * 6
        gemm_tile(
            pid_m, pid_n, a, b, c, None, M, N, K,
            tl.load(st + 0), tl.load(st + 1), tl.load(st + 2), tl.load(st + 3),
            tl.load(st + 4), tl.load(st + 5), 0,
            ACTIVATION, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )


@triton.jit
def sort_by_expert_kernel(
    ids_ptr, pair_ptr, token_ptr, offs_ptr, P, E, k,
    E_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Stable counting sort of the P = T * k (token, slot) pairs by expert, in one program.

    ids_ptr [P] (int32 or int64, contiguous): the expert of pair i; ids outside [0, E) form a
        last group after every expert's (compared in their own width: no wrap-around).
    pair_ptr, token_ptr [P] int32 (out): row r of the sorted order is pair pair[r], of token
        token[r] = pair[r] // k; pairs of one expert keep their order (stable).
    offs_ptr [E] int32 (out): cumulative end offsets, expert e owns rows [offs[e-1], offs[e]).
    E_BLOCK: a power of two > E (the experts plus the last group). BLOCK: pairs per step.
    Grid: (1,). Two passes over the pairs: count per expert, then place each pair at its
    expert's start + the pairs of that expert before it (a running count plus a prefix sum
    over the step's one-hot rows). For decode-sized P, where torch's sort is several launches.
    """
    experts = tl.arange(0, E_BLOCK)
    totals = tl.zeros([E_BLOCK], dtype=tl.int32)
    for start in range(0, P, BLOCK):
        i = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + i, mask=i < P, other=0)
        e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
        onehot = ((e[:, None] == experts[None, :]) & (i < P)[:, None]).to(tl.int32)
        totals += tl.sum(onehot, axis=0)
    ends = tl.cumsum(totals, axis=0)
    tl.store(offs_ptr + experts, ends, mask=experts < E)
    base = ends - totals
    for start in range(0, P, BLOCK):
        i = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + i, mask=i < P, other=0)
        e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
        onehot = ((e[:, None] == experts[None, :]) & (i < P)[:, None]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in this step
        pos = tl.sum(onehot * (before + base[None, :]), axis=1)
        tl.store(pair_ptr + pos, i, mask=i < P)
        tl.store(token_ptr + pos, i // k, mask=i < P)
        base += tl.sum(onehot, axis=0)
