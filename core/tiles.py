"""The shared tile body of every onegemm kernel, as ``@triton.jit`` helpers.

A GEMM kernel in this project is three steps, each one helper here:

1. ``grouped_tile``: program id -> (pid_m, pid_n) in grouped (GROUP_M) order, so that
   consecutive programs share A row-blocks and B column-blocks in L2.
2. ``mma_k_loop``: the K loop over broadcast 2-D pointer blocks, the ``k_remaining`` mask, fp32
   accumulation, and two switches other packages need: per-K-block dequantisation scales
   (blockscaled/) and arbitrary row/column index vectors, which give a row gather for free
   (grouped/ MoE).
3. ``epilogue`` + ``store_tile``: dequant scales, bias, activation, routing weight, cast, masked
   store.

``gemm_tile`` chains 2 and 3 for one output tile of a plain GEMM; a kernel calls it once per
work unit, one unit per program (launch-per-tile) or a loop of them (``program_units``, the
persistent schedule). With
SPLIT_K it computes one K range of the tile, and the last range to finish sums them
(``split_k_range``, ``split_k_combine``; core/splitk.py is the host side).
Kernels never copy these bodies: a new need is a new constexpr or argument here.

Two flavours of loads and stores, one contract. The pointer flavour (the default) reads
through broadcast pointer blocks and works for any strides. The TMA flavour (``USE_TMA``, for
Hopper) reads and writes through tensor descriptors that ``make_operands`` builds once per
program: the TMA unit copies whole boxes into shared memory asynchronously, zero-filling
what lies outside the matrix (so no masks), and frees the warps from address arithmetic.
It needs a unit last stride and 16-byte aligned base and strides (core/tma.py decides, and
the host falls back to pointers otherwise), and it cannot gather rows: ``rows``/``cols`` are
then only used by the optional scale loads, the tile's origin comes from ``off_m``/``off_n``.

Conventions: ``rows``/``cols`` are int32/int64 index vectors into A's rows and B's columns.
They must be valid indices even where the tile overhangs the matrix (callers wrap them with
``% M`` or gather them from an index array), so loads need no M/N mask; only the store masks.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
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
    it: the sm_90 PTX has the loop-free kernel's instruction counts. A loop from pid to pid + 1
    is not removed, and it cost 64x128 and warp-specialised fp8 configs 4-6% on the H200 and
    broke 256x128 with TMA (bench/results/blockscaled.md).
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
    coordinate ``pid * BLOCK`` the caller computes. Triton 3.6's Hopper warp specialisation
    (WARP_SPECIALIZE) gives the second consumer warpgroup rows [BLOCK/2, BLOCK) by shifting
    both ``tl.arange`` and every use of the TMA coordinate; a shared value was shifted twice,
    so that warpgroup read its 1x128 scales 64 rows too far (relative error 0.22 on the H200,
    tests/test_blockscaled.py test_warp_specialize_switch).
    """
    offs = (pid.to(tl.int64) * BLOCK).to(tl.int32) + tl.arange(0, BLOCK)
    return offs, offs % size, offs < size


@triton.jit
def make_operands(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_TMA: tl.constexpr = False,
    A_K_CONTIG: tl.constexpr = True, B_K_CONTIG: tl.constexpr = True,
    EPI_SPLIT: tl.constexpr = 1,
):
    """What the K loop and the store read and write: (a, b, c).

    Pointer flavour: the three pointers, unchanged. TMA flavour: tensor descriptors, built once
    per program (a persistent kernel reuses them for all its tiles):
      a: over A [M, K] with [BLOCK_M, BLOCK_K] boxes if A_K_CONTIG (stride_ak == 1), else over
         A's transpose [K, M] (stride_am == 1) with [BLOCK_K, BLOCK_M] boxes;
      b: over B [K, N] with [BLOCK_K, BLOCK_N] boxes, or, if B_K_CONTIG (stride_bk == 1, i.e.
         B = W.t()), over W [N, K] with [BLOCK_N, BLOCK_K] boxes;
      c: over C [M, N] (stride_cn == 1) with [BLOCK_M, BLOCK_N // EPI_SPLIT] boxes.
    The host (core/tma.py) has checked the unit strides and the 16-byte alignment TMA needs.
    """
    a = a_ptr
    b = b_ptr
    c = c_ptr
    if USE_TMA:
        if A_K_CONTIG:
            a = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        else:
            a = tl.make_tensor_descriptor(a_ptr, [K, M], [stride_ak, 1], [BLOCK_K, BLOCK_M])
        if B_K_CONTIG:
            b = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
        c = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N // EPI_SPLIT])
    return a, b, c


@triton.jit
def _block_scale(kb, sa_ptr, sa_idx, stride_sa_idx, stride_sa_k, sb_ptr, sb_idx, stride_sb_idx, stride_sb_k,
                 SA_UNIFORM: tl.constexpr, SB_UNIFORM: tl.constexpr, valid=None):
    """K block ``kb``'s multiplier (mma_k_loop's per-K-block scales): [BLOCK_M, 1], [1, BLOCK_N],
    their product, or a scalar; folding the scalars first leaves one multiply-add per element.
    ``valid`` False (K == 0: there is no block) reads nothing."""
    scale = 1.0
    if sa_ptr is not None:
        sa = tl.load(sa_ptr + sa_idx.to(tl.int64) * stride_sa_idx + kb * stride_sa_k, mask=valid)
        scale = sa if SA_UNIFORM else sa[:, None]
    if sb_ptr is not None:
        sb = tl.load(sb_ptr + kb * stride_sb_k + sb_idx.to(tl.int64) * stride_sb_idx, mask=valid)
        scale = scale * (sb if SB_UNIFORM else sb[None, :])
    return scale


@triton.jit
def mma_k_loop(
    acc,
    a_ptr, b_ptr, rows, cols, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    sa_ptr=None, sa_idx=None, stride_sa_idx=0, stride_sa_k=0,
    sb_ptr=None, sb_idx=None, stride_sb_idx=0, stride_sb_k=0,
    USE_TMA: tl.constexpr = False, off_m=0, off_n=0,
    A_K_CONTIG: tl.constexpr = True, B_K_CONTIG: tl.constexpr = True,
    SA_UNIFORM: tl.constexpr = False, SB_UNIFORM: tl.constexpr = False,
    WARP_SPECIALIZE: tl.constexpr = False,
    kb_lo=0, kb_hi=None,
):
    """acc[BLOCK_M, BLOCK_N] += A[rows, 0:K] @ B[0:K, cols], in fp32.

    a_ptr: A's element [0, 0]; A[r, k] is at a_ptr + r*stride_am + k*stride_ak (any strides:
        a transposed view just swaps them, no copy).
    b_ptr: B's element [0, 0]; B[k, c] is at b_ptr + k*stride_bk + c*stride_bn (W.t() of an
        nn.Linear weight has stride_bk == 1, the K-major layout Hopper's fp8 MMA wants).
    rows [BLOCK_M], cols [BLOCK_N]: valid row/column indices (see module docstring).
    K: the reduction length; the last block is masked by ``k_remaining``, so K need not be a
        multiple of BLOCK_K (unmasked, it would read past the row and sum garbage).
    UPCAST: convert tiles to fp32 before tl.dot. Set only for bf16 under the interpreter,
        which stores bf16 as raw uint16 and computes garbage on it (docs/interpreter.md).
    PRECISION: tl.dot input_precision for fp32 inputs ("ieee" or "tf32").

    Per-K-block scales (blockscaled/): when ``sa_ptr`` is given, K block ``kb`` of the product
    is multiplied by sa[sa_idx, kb] per row (sa_idx [BLOCK_M]: the scale row of each A row,
    i.e. rows for 1x128 scales or rows // 128 for 128x128); likewise ``sb_ptr`` with
    sb[kb, sb_idx] per column. The caller must then use BLOCK_K == the scale block (128).
    Each block's dot starts from zero and is promoted to the fp32 ``acc`` after scaling:
    Hopper's fp8 MMA accumulates in reduced precision, so accumulating across blocks inside
    the tensor core would lose bits (docs/hopper.md).
    SA_UNIFORM / SB_UNIFORM: the whole tile shares one scale row / column (a 128x128 scale
    block covers the tile), and ``sa_idx`` / ``sb_idx`` is that one index, a scalar. The
    promotion is then one FMA per element (acc += part * s[:, None]) instead of a multiply
    and an FMA: the promotion runs on the CUDA cores while the tensor core waits, so its cost
    per element matters (a 128x128x128 fp8 block is ~512 tensor-core cycles per SM, and its
    16384 promotions ~128 FP32 cycles per op). Each block's scales are loaded one block
    ahead, before its MMA is issued, so their global-load latency is hidden behind the MMA.

    TMA flavour (USE_TMA): a_ptr / b_ptr are ``make_operands``' descriptors (A_K_CONTIG and
    B_K_CONTIG must be the ones they were built with) and the tile starts at row ``off_m`` and
    column ``off_n``; rows/cols only index the scales. Boxes past M, N or K arrive zero-filled,
    which is what the masks give the pointer flavour.

    kb_lo, kb_hi: only K blocks [kb_lo, kb_hi) of the ceil(K / BLOCK_K) (default: all), what
        one split of a split-K tile sums (``split_k_range``); masks and scales stay indexed by
        the absolute K block, so a range ends at K exactly like the whole loop does.

    WARP_SPECIALIZE: ``tl.range(warp_specialize=True)`` for the K loop, TMA flavour only.
    Compiled for sm_90 (Triton 3.6) with 4 warps, the loop becomes a TMA producer and two
    consumer warpgroups of BLOCK_M/2 rows each, synchronised by mbarriers instead of the
    CTA-wide barrier of a plain pipelined loop. With pointer loads Triton 3.6's Hopper pass
    fails an assertion (WSLowerToken.cpp; triton-lang/triton#9728), so the switch is ignored
    there, as it is for fp8 operands that are not both K-major. Tuned configs use it where
    the H200 measured a gain (core/matmul.py, bf16; blockscaled/matmul.py);
    bench/diagnose_blockscaled.py sweeps it.
    """
    offs_k = tl.arange(0, BLOCK_K)
    if not USE_TMA:
        # int64: rows * stride_am passes 2^31 elements for tall or widely strided operands.
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
        if kb_hi is not None:
            # A split starts at block kb_lo (int64: that column times a transposed A's K
            # stride can pass 2^31). Without a range the code is the plain loop's, unchanged.
            k_first = kb_lo.to(tl.int64) * BLOCK_K
            a_ptrs += k_first * stride_ak
            b_ptrs += k_first * stride_bk
    if kb_hi is None:
        kb_hi = tl.cdiv(K, BLOCK_K)
    if sa_ptr is not None or sb_ptr is not None:
        scale = _block_scale(kb_lo, sa_ptr, sa_idx, stride_sa_idx, stride_sa_k, sb_ptr, sb_idx, stride_sb_idx, stride_sb_k,
                             SA_UNIFORM, SB_UNIFORM, valid=kb_hi > kb_lo)
    # Triton 3.6 cannot warp-specialise fp8 tiles that must be transposed in shared memory
    # (an MN-major A or B): the sm_90 compile fails or aborts. Those run unspecialised.
    WS: tl.constexpr = WARP_SPECIALIZE and USE_TMA and ((A_K_CONTIG and B_K_CONTIG) or not a_ptr.dtype.is_fp8())
    for kb in tl.range(kb_lo, kb_hi, warp_specialize=WS):
        if USE_TMA:
            k0 = kb * BLOCK_K
            # A column-major A or a row-major B is stored MN-contiguous; its box is loaded as
            # stored and transposed in shared memory, which wgmma reads either way for 16-bit
            # types (Triton converts for fp8, which wants K-major operands).
            if A_K_CONTIG:
                a = a_ptr.load([off_m, k0])
            else:
                a = a_ptr.load([k0, off_m]).T
            if B_K_CONTIG:
                b = b_ptr.load([off_n, k0]).T
            else:
                b = b_ptr.load([k0, off_n])
        else:
            k_remaining = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_remaining, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_remaining, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if sa_ptr is None and sb_ptr is None:
            if a.dtype.is_fp8():
                # Promote fp8 partial sums to fp32 once per K block rather than accumulating
                # the whole K loop inside the tensor core (about 14 bits there on Hopper).
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
        else:
            # The next block's scales are loaded before this block's MMA, so their global
            # load latency hides behind it: the MMA must finish before the promotion
            # (Triton waits for it), and loaded after that wait they stalled every K block.
            # The last block re-reads its own scales (an index past them is out of bounds).
            next_scale = _block_scale(tl.minimum(kb + 1, kb_hi - 1), sa_ptr, sa_idx, stride_sa_idx, stride_sa_k,
                                      sb_ptr, sb_idx, stride_sb_idx, stride_sb_k, SA_UNIFORM, SB_UNIFORM)
            part = tl.dot(a, b, input_precision=PRECISION)
            acc += part * scale
            scale = next_scale
        if not USE_TMA:
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
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
def epilogue(
    acc, offs_m, offs_n, mask_m, mask_n,
    ACTIVATION: tl.constexpr,
    bias_ptr=None, stride_bias=1,
    scale_m_ptr=None, stride_scale_m=0,
    scale_n_ptr=None, stride_scale_n=0,
    weight_ptr=None, weight_idx=None,
):
    """out = weight[:, None] * act(acc * scale_m[:, None] * scale_n[None, :] + bias[None, :]).

    Each term is optional (a None pointer switches it off at compile time).
    scale_m_ptr / scale_n_ptr: dequantisation multipliers indexed by output row / column;
        stride 0 broadcasts one scalar (tensor-wise scale).
    bias_ptr: bias[offs_n * stride_bias], loaded in its own dtype and used in fp32.
    weight_ptr: a per-row multiplier applied after the activation, e.g. the MoE routing
        weight; ``weight_idx`` [BLOCK_M] says which element belongs to each row.
    """
    if scale_m_ptr is not None:
        sm = tl.load(scale_m_ptr + offs_m.to(tl.int64) * stride_scale_m, mask=mask_m, other=0.0)
        acc = acc * sm.to(tl.float32)[:, None]
    if scale_n_ptr is not None:
        sn = tl.load(scale_n_ptr + offs_n.to(tl.int64) * stride_scale_n, mask=mask_n, other=0.0)
        acc = acc * sn.to(tl.float32)[None, :]
    if bias_ptr is not None:
        bias = tl.load(bias_ptr + offs_n.to(tl.int64) * stride_bias, mask=mask_n, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    acc = activate(acc, ACTIVATION)
    if weight_ptr is not None:
        w = tl.load(weight_ptr + weight_idx, mask=mask_m, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    return acc


@triton.jit
def store_tile(
    c_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_cm, stride_cn,
    USE_TMA: tl.constexpr = False, off_m=0, off_n=0, EPI_SPLIT: tl.constexpr = 1,
):
    """C[offs_m, offs_n] = acc cast to C's dtype, masked to the rows and columns that exist.

    TMA flavour (USE_TMA): c_ptr is ``make_operands``' descriptor and the tile starts at
    (off_m, off_n); the TMA unit clips the box at the matrix edge, so no mask is needed.
    EPI_SPLIT = 2 stores the tile as two [BLOCK_M, BLOCK_N / 2] halves: the shared-memory
    staging buffer a TMA store goes through is halved. Compiled for sm_90, the persistent
    128x256x64 bf16 kernel with 3 stages needs 213 KB whole and 180 KB split, and a 4th stage
    fits only split (229 KB of 232 KB). Measured on the H200 (bench/results/persistent.md),
    the split bought +1% at 4096^3, -7% at 8192^3 and -24% on a 266-tile shape, and the 4th
    stage it makes room for +3%, -7% and -29%: no consistent gain, so autotuned configs keep 1.
    """
    if USE_TMA:
        if EPI_SPLIT == 1:
            c_ptr.store([off_m, off_n], acc.to(c_ptr.dtype))
        else:
            BLOCK_M: tl.constexpr = acc.shape[0]
            HALF_N: tl.constexpr = acc.shape[1] // 2
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1))
            left, right = tl.split(halves)
            c_ptr.store([off_m, off_n], left.to(c_ptr.dtype))
            c_ptr.store([off_m, off_n + HALF_N], right.to(c_ptr.dtype))
    else:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


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
def split_k_combine(acc, split, tile_id, ws_ptr, lock_ptr, M, N, offs_m, offs_n, mask_m, mask_n,
                    SPLIT_K: tl.constexpr):
    """Split-K's reduction: returns (sum of the tile's SPLIT_K partials, is_last).

    Every split stores its fp32 partial ``acc`` into the workspace and then takes a ticket on
    its tile's counter; only the split that arrives last gets ``is_last`` and the sum, which it
    reads back in split order, so the result does not depend on which split finished first
    (deterministic, unlike atomically added partials). Nobody waits for anybody, so no
    schedule of the programs can deadlock. The last split puts the counter back to 0: the
    buffers then serve the next launch as they are (autotune repetitions, CUDA-graph replays).

    ws_ptr: fp32 [SPLIT_K * M, N] contiguous; split s of C[i, j] at ws_ptr + (s*M + i)*N + j.
    lock_ptr: int32 [number of tiles], zero before the first launch; ``tile_id`` indexes it.
    """
    mask = mask_m[:, None] & mask_n[None, :]
    cols = offs_n.to(tl.int64)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    tl.store(ws_ptr + (split * M + rows) * N + cols, acc, mask=mask)
    # Every thread's partial is stored before the ticket is taken; the ticket's release and
    # acquire (acq_rel, GPU scope) order those stores before the last split's loads.
    tl.debug_barrier()
    ticket = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == SPLIT_K - 1
    if is_last:
        acc = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            # .cg: read from L2, where the other SMs' partials are (not a stale L1 line).
            acc += tl.load(ws_ptr + (s * M + rows) * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(lock_ptr + tile_id, 0)
    return acc, is_last


@triton.jit
def gemm_tile(
    pid_m, pid_n,
    a_ptr, b_ptr, c_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_bias,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    sa_ptr=None, stride_sa_m=0, stride_sa_k=0, SA_ROWS_PER_SCALE: tl.constexpr = 1,
    sb_ptr=None, stride_sb_k=0, stride_sb_n=0, SB_COLS_PER_SCALE: tl.constexpr = 1,
    scale_m_ptr=None, stride_scale_m=0, scale_n_ptr=None, stride_scale_n=0,
    USE_TMA: tl.constexpr = False, A_K_CONTIG: tl.constexpr = True, B_K_CONTIG: tl.constexpr = True,
    EPI_SPLIT: tl.constexpr = 1, WARP_SPECIALIZE: tl.constexpr = False,
    split=0, SPLIT_K: tl.constexpr = 1, ws_ptr=None, lock_ptr=None,
):
    """One BLOCK_M x BLOCK_N tile of C = act(A @ B + bias): K loop, epilogue, store.

    The optional scale arguments are blockscaled/'s: ``sa_ptr``/``sb_ptr`` are per-K-block
    scales (SA_ROWS_PER_SCALE = 1 for 1x128, 128 for 128x128; SB_COLS_PER_SCALE likewise),
    ``scale_m_ptr``/``scale_n_ptr`` row-wise / column-wise / scalar scales for the epilogue.
    USE_TMA: a_ptr, b_ptr and c_ptr are the descriptors ``make_operands`` returned (built with
    the same A_K_CONTIG, B_K_CONTIG and EPI_SPLIT); the strides are then unused.
    SPLIT_K > 1: this program is split ``split`` of SPLIT_K over the tile's K blocks
    (``split_k_range``); the last split to finish sums the partials through ``ws_ptr`` and
    ``lock_ptr`` (``split_k_combine``, which gives their layout) and alone runs the epilogue
    and the store. core/splitk.py is the host side.
    """
    offs_m, rows, mask_m = tile_range(pid_m, M, BLOCK_M)
    offs_n, cols, mask_n = tile_range(pid_n, N, BLOCK_N)
    # A tile inside one scale block (BLOCK_M divides 128 for 128x128 scales) reads one scale
    # per K block: the scalar index of its first row (rows past M wrap, but are never stored).
    SA_UNIFORM: tl.constexpr = SA_ROWS_PER_SCALE % BLOCK_M == 0
    SB_UNIFORM: tl.constexpr = SB_COLS_PER_SCALE % BLOCK_N == 0
    if SA_UNIFORM:
        sa_idx = (pid_m * BLOCK_M) // SA_ROWS_PER_SCALE
    else:
        sa_idx = rows // SA_ROWS_PER_SCALE
    if SB_UNIFORM:
        sb_idx = (pid_n * BLOCK_N) // SB_COLS_PER_SCALE
    else:
        sb_idx = cols // SB_COLS_PER_SCALE
    kb_lo = 0
    kb_hi = None
    if SPLIT_K > 1:
        kb_lo, kb_hi = split_k_range(split, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = mma_k_loop(
        acc, a_ptr, b_ptr, rows, cols, K,
        stride_am, stride_ak, stride_bk, stride_bn,
        BLOCK_K, UPCAST, PRECISION,
        sa_ptr, sa_idx, stride_sa_m, stride_sa_k,
        sb_ptr, sb_idx, stride_sb_n, stride_sb_k,
        USE_TMA, pid_m * BLOCK_M, pid_n * BLOCK_N, A_K_CONTIG, B_K_CONTIG,
        SA_UNIFORM, SB_UNIFORM, WARP_SPECIALIZE, kb_lo, kb_hi,
    )
    finish = True
    if SPLIT_K > 1:
        tile_id = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
        acc, finish = split_k_combine(acc, split, tile_id, ws_ptr, lock_ptr, M, N, offs_m, offs_n, mask_m, mask_n, SPLIT_K)
    if finish:
        acc = epilogue(
            acc, offs_m, offs_n, mask_m, mask_n, ACTIVATION,
            bias_ptr, stride_bias,
            scale_m_ptr, stride_scale_m, scale_n_ptr, stride_scale_n,
        )
        store_tile(
            c_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_cm, stride_cn,
            USE_TMA, pid_m * BLOCK_M, pid_n * BLOCK_N, EPI_SPLIT,
        )
