"""onegemm.grouped_matmul (all four offs modes and list mode) against float64 torch."""

import re

import pytest
import torch

import onegemm
from helpers import fp8_grouped_inputs, offs_of
from onegemm.core.configs import EITHER, flavoured
from onegemm.grouped.configs import RAGGED_CONFIGS
from onegemm.core.configs import cfg as _cfg
from onegemm.core.configs import with_meta
from onegemm.core.scaling import BLOCKS, ROW_BLOCKS, read_granularity
from onegemm.grouped.ops import SCALES_A, SCALES_B, tile_bound

GROUPED_CONFIGS = flavoured(RAGGED_CONFIGS, EITHER)  # every ragged config in both load flavours
from onegemm.testing import TOL, assert_close, grouped_mm_ref, matmul_ref


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def expert_weights(G, K, N, dtype, device):
    """b [G, K, N] as a transposed view of [G, N, K] (how expert weights are stored)."""
    return rand(G, N, K, dtype=dtype, device=device).transpose(1, 2)


# Group sizes (rows of a per expert), then how many rows lie past offs[-1].
# Empty groups first, last and in a row; a group of one row; all rows in one group; 127 and
# 300 rows (more than one 32-row tile, last one partial).
ROW_CASES = [
    ([3, 0, 37, 20], 0),
    ([0, 0, 17, 1, 0], 5),
    ([1], 0),
    ([0, 127, 0], 0),
    ([300, 2], 1),
    ([5, 9, 0, 7, 3, 11, 2, 4], 3),
    # more groups than rows (a decode step: the grid is bounded by the rows, not by G)
    ([1] * 17 + [0] * 40, 0),
    ([0, 33, 1, 0, 65, 1], 2),
]


@pytest.mark.parametrize("sizes,tail", ROW_CASES, ids=str)
@pytest.mark.parametrize("N,K", [(50, 40), (130, 65)])  # 130 > 2 BLOCK_N, 65 > BLOCK_K
def test_2d_3d_ragged_rows(sizes, tail, N, K, device):
    G = len(sizes)
    a = rand(sum(sizes) + tail, K, dtype=torch.float16, device=device)
    b = expert_weights(G, K, N, torch.float16, device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs)
    assert out.shape == (a.shape[0], N) and out.dtype == torch.float16
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.float16])
    if tail:  # rows past offs[-1] are exactly zero, not just small
        assert (out[sum(sizes):] == 0).all()


@pytest.mark.parametrize("block", [16, 32, 128])
def test_tile_bound_covers_every_partition(block):
    """The ragged grid's bound (ops.tile_bound) is at least the tiles ``locate_tile`` numbers
    (each group's and the tail's cdiv) for partitions with every group non-empty, most empty,
    and one row each: the cases where a bound of cdiv(total, block) + G would be needed or
    too loose."""
    gen = torch.Generator().manual_seed(block)
    for _ in range(300):
        G = int(torch.randint(1, 300, (1,), generator=gen))
        sizes = torch.randint(0, 3 * block, (G,), generator=gen)
        sizes *= torch.rand(G, generator=gen) < torch.rand(1, generator=gen)  # a random share empty
        tail = int(torch.randint(0, 2 * block, (1,), generator=gen))
        total = int(sizes.sum()) + tail
        tiles = int(((sizes + block - 1) // block).sum()) + -(-tail // block)
        assert tiles <= tile_bound(total, block, G), (G, sizes.tolist(), tail)
    # every group and the tail one row: G + 1 partial tiles
    assert tile_bound(9, block, 8) >= 9 and tile_bound(1, block, 1000) == 2


def test_decode_grid_follows_the_rows_not_the_experts(device):
    """A decode-sized call (8 rows over 128 experts) launches the tiles its rows can have, as
    ops.tile_bound counts them, not a row of programs per expert; its output is still whole."""
    from onegemm.core import launch

    sizes = [0] * 128
    for g in (3, 17, 40, 41, 90, 100, 101, 127):
        sizes[g] = 1
    a = rand(8, 64, dtype=torch.float16, device=device)
    b = expert_weights(128, 64, 96, torch.float16, device)
    offs = offs_of(sizes, device)
    with launch.recording() as seen:
        out = onegemm.grouped_matmul(a, b, offs)
    (run,) = seen
    bm, bn = run.plan.meta["BLOCK_M"], run.plan.meta["BLOCK_N"]
    assert run.grid[0] == tile_bound(8, bm, 128) * -(-96 // bn) <= (1 + 8) * -(-96 // bn)
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.float16])


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_2d_3d_dtypes(dtype, device):
    sizes = [7, 0, 40, 13]
    a = rand(sum(sizes) + 2, 48, dtype=dtype, device=device)
    b = expert_weights(len(sizes), 48, 33, dtype, device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs)
    out_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
    assert out.dtype == out_dtype
    tol = 1e-3 if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest" else TOL[out_dtype]
    assert_close(out, grouped_mm_ref(a, b, offs), tol)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_2d_3d_bias_activation_out_dtype(activation, device):
    sizes = [9, 0, 30]
    G, K, N = 3, 36, 45
    a = rand(sum(sizes), K, dtype=torch.bfloat16, device=device)
    b = expert_weights(G, K, N, torch.bfloat16, device)
    bias = rand(G, N, device=device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs, bias=bias, activation=activation, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, grouped_mm_ref(a, b, offs, bias, activation), 1e-5)


@pytest.mark.parametrize("layout", ["contiguous_b", "sliced_a"])
def test_2d_3d_layouts(layout, device):
    sizes = [20, 11]
    G, K, N = 2, 30, 24
    if layout == "contiguous_b":
        a = rand(31, K, device=device)
        b = rand(G, K, N, device=device)  # row-major [G, K, N]: stride 1 along N
    else:
        a = rand(70, K + 7, device=device)[1::2, 3 : 3 + K][:31]  # strided rows and columns
        b = expert_weights(G, K, N, torch.float32, device)
    offs = offs_of(sizes, device)
    assert_close(onegemm.grouped_matmul(a, b, offs), grouped_mm_ref(a, b, offs), 1e-5)


@pytest.mark.parametrize("G,M,N,K", [(3, 17, 33, 65), (1, 1, 1, 1), (4, 40, 1, 7)])
def test_3d_3d_batched(G, M, N, K, device):
    a = rand(G, M, K, dtype=torch.float16, device=device)
    b = expert_weights(G, K, N, torch.float16, device)
    bias = rand(G, N, dtype=torch.float16, device=device)
    out = onegemm.grouped_matmul(a, b, bias=bias)
    assert out.shape == (G, M, N)
    assert_close(out, grouped_mm_ref(a, b, None, bias), TOL[torch.float16])


# 2D x 2D splits the reduction (the MoE weight gradient, x^T @ dy per expert): empty groups
# give act(bias) (here zero without bias), K past offs[-1] is ignored.
@pytest.mark.parametrize("sizes,tail", [([30, 0, 41, 1], 0), ([0, 65], 3), ([127], 0)], ids=str)
def test_2d_2d_ragged_k(sizes, tail, device):
    M, N = 19, 34
    K = sum(sizes) + tail
    a = rand(K, M, dtype=torch.float16, device=device).t()  # x^T: a transposed view
    b = rand(K, N, dtype=torch.float16, device=device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs)
    assert out.shape == (len(sizes), M, N)
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.float16])
    for g, s in enumerate(sizes):
        if s == 0:
            assert (out[g] == 0).all()


@pytest.mark.parametrize("sizes,tail", [([12, 0, 40], 5), ([1, 33], 0)], ids=str)
def test_3d_2d_ragged_cols(sizes, tail, device):
    G, M, K = len(sizes), 21, 30
    N = sum(sizes) + tail
    a = rand(G, M, K, device=device)
    b = rand(N, K, device=device).t()
    bias = rand(N, device=device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs, bias=bias)
    assert out.shape == (M, N)
    assert_close(out, grouped_mm_ref(a, b, offs, bias), 1e-5)
    assert (out[:, sum(sizes):] == 0).all()


def test_empty_inputs(device):
    b = expert_weights(3, 8, 5, torch.float32, device)
    offs = torch.zeros(3, dtype=torch.int32, device=device)
    empty = onegemm.grouped_matmul(rand(0, 8, device=device), b, offs)
    assert empty.shape == (0, 5) and empty.dtype == torch.float32
    a = rand(6, 8, device=device)  # every group empty: all rows lie past offs[-1]
    out = onegemm.grouped_matmul(a, b, offs)
    assert (out == 0).all()


def test_config_block_sizes(device):
    """The upper-bound grid follows the chosen config (here two block shapes)."""
    sizes = [33, 0, 70, 5]
    a = rand(sum(sizes), 40, dtype=torch.float16, device=device)
    b = expert_weights(4, 40, 70, torch.float16, device)
    offs = offs_of(sizes, device)
    for cfg in [_cfg(16, 64, 32, 4, 2, group_m=2), _cfg(64, 32, 16, 4, 2, group_m=1)]:
        out = onegemm.grouped_matmul(a, b, offs, config=cfg)
        assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.float16], what=str(cfg))


# ---- split-K over ragged rows (decode-sized expert groups) ----

# (split, what): 2 and 3 splits of 10 K blocks; 16 splits, more than the blocks (empty splits)
SPLITS = [2, 3, 16]


def _split_cfg(split, block_k=32):
    return with_meta(_cfg(16, 32, block_k, 4, 1, group_m=1), SPLIT_K=split)


@pytest.mark.parametrize("split", SPLITS)
def test_split_k_ragged_rows(split, device):
    """SPLIT_K > 1 on ragged rows: each tile's K splits meet in a slot per (tile, split), the
    last sums them in split order and alone runs the epilogue: bias and activation, empty
    groups, rows past offs[-1] (zero) as without splits; bitwise reruns."""
    sizes = [3, 0, 17, 1, 0]
    a = rand(sum(sizes) + 2, 300, device=device)
    b = expert_weights(5, 300, 40, torch.float32, device)
    offs, bias = offs_of(sizes, device), rand(5, 40, device=device)
    out = onegemm.grouped_matmul(a, b, offs, bias=bias, activation="gelu", config=_split_cfg(split))
    assert_close(out, grouped_mm_ref(a, b, offs, bias, "gelu"), TOL[torch.float32])
    assert (out[sum(sizes):] == 0).all()
    assert torch.equal(onegemm.grouped_matmul(a, b, offs, bias=bias, activation="gelu", config=_split_cfg(split)), out)


@pytest.mark.parametrize("split", SPLITS)
def test_split_k_moe_gemms(split, device):
    """The MoE pipeline's two GEMMs split along K: GEMM1 gathers token rows and applies SwiGLU
    after the splits' sums meet (silu is not linear in them), GEMM2 scatters row r to
    pair[r] times weight[pair[r]], each against float64."""
    from onegemm.grouped.moe_steps import expert_gemm

    T, H, I, E = 7, 96, 40, 3
    x = rand(T, H, device=device)
    w13, w2 = rand(E, 2 * I, H, device=device), rand(E, H, I, device=device)
    token = torch.tensor([4, 0, 6, 2, 2, 5, 1, 3], dtype=torch.int32, device=device)
    offs = offs_of([3, 0, 5], device)
    h = torch.full((8, I), float("nan"), device=device)
    expert_gemm(x, w13, h, offs, a_rows=token, swiglu=True, config=_split_cfg(split))
    pre = torch.cat([x[token[r]].double()[None] @ w13[e].double().t() for e, r in
                     [(0, 0), (0, 1), (0, 2)] + [(2, r) for r in range(3, 8)]])
    want = torch.nn.functional.silu(pre[:, :I]) * pre[:, I:]
    assert_close(h, want, TOL[torch.float32], "GEMM1 (gather, SwiGLU)")
    pair, weight = torch.randperm(8, device=device).to(torch.int32), torch.rand(8, device=device)
    y = torch.full((8, H), float("nan"), device=device)
    expert_gemm(h, w2, y, offs, c_rows=pair, weight=weight, config=_split_cfg(split))
    rows = torch.cat([h[r].double()[None] @ w2[e].double().t() for e, r in [(0, 0), (0, 1), (0, 2)] +
                      [(2, r) for r in range(3, 8)]]) * weight.double()[pair.long()][:, None]  # weight[C row]
    assert_close(y[pair.long()], rows, TOL[torch.float32], "GEMM2 (weight, scatter)")


# ---- bad input ----

BAD_OFFS = [
    ("decreasing", [10, 5, 20], ValueError, "non-decreasing"),
    ("negative", [-1, 5, 20], ValueError, "non-decreasing"),
    ("overrun", [10, 20, 31], ValueError, "offs must be at most 30"),
]


@pytest.mark.parametrize("name,values,exc,match", BAD_OFFS, ids=[c[0] for c in BAD_OFFS])
def test_bad_offs_values(name, values, exc, match, device):
    a = rand(30, 8, device=device)
    b = expert_weights(3, 8, 4, torch.float32, device)
    offs = torch.tensor(values, dtype=torch.int32, device=device)
    with pytest.raises(exc, match=match):
        onegemm.grouped_matmul(a, b, offs, check_offs=True)


@pytest.mark.parametrize("name,values,exc,match", BAD_OFFS, ids=[c[0] for c in BAD_OFFS])
def test_bad_offs_unchecked_give_nan(name, values, exc, match, device):
    """Without the host check (a GPU's default: no sync) the kernel refuses to trust offs."""
    a = rand(30, 8, device=device)
    b = expert_weights(3, 8, 4, torch.float32, device)
    offs = torch.tensor(values, dtype=torch.int32, device=device)
    out = onegemm.grouped_matmul(a, b, offs, check_offs=False)
    assert torch.isnan(out).all()


def test_offs_values_read_by_default_only_on_the_cpu(device):
    """check_offs=None reads offs' values where that costs no sync (offs on the CPU, the
    interpreter's case), never on a GPU, whose kernel turns bad offs into NaN instead."""
    a = rand(30, 8, device=device)
    b = expert_weights(3, 8, 4, torch.float32, device)
    offs = torch.tensor([10, 5, 20], dtype=torch.int32, device=device)
    if offs.is_cpu:
        with pytest.raises(ValueError, match="offs must be non-decreasing"):
            onegemm.grouped_matmul(a, b, offs)
    else:
        assert torch.isnan(onegemm.grouped_matmul(a, b, offs)).all()


# Each mode that takes offs: a and b where the dimension offs cuts has 30 elements (no other
# dimension does), and that dimension's name in check_offs' message.
OFFS_MODES = [
    ("2Dx3D", lambda d: (rand(30, 8, device=d), rand(3, 8, 4, device=d)), "a's rows \\(2D x 3D\\)"),
    ("2Dx2D", lambda d: (rand(4, 30, device=d), rand(30, 5, device=d)), "the reduction dimension K \\(2D x 2D\\)"),
    ("3Dx2D", lambda d: (rand(3, 4, 8, device=d), rand(8, 30, device=d)), "b's columns \\(3D x 2D\\)"),
]


@pytest.mark.parametrize("name,make,what", OFFS_MODES, ids=[c[0] for c in OFFS_MODES])
def test_offs_end_bounded_by_the_dimension_cut(name, make, what, device):
    """check_offs bounds offs[-1] by the size of the dimension offs cuts in the call's mode: an
    end at 30 is accepted, 31 refused naming that dimension."""
    a, b = make(device)
    onegemm.grouped_matmul(a, b, offs_of([10, 10, 10], device), check_offs=True)
    with pytest.raises(ValueError, match=f"offs must be at most 30 \\(the grouped dimension of {what}\\) at its end"):
        onegemm.grouped_matmul(a, b, offs_of([10, 10, 11], device), check_offs=True)


BAD_CALLS = [
    ("offs int64", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, device=d), torch.tensor([3, 6], device=d)), {}, TypeError, "int32"),
    ("offs too short", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, device=d), offs_of([6], d)), {}, ValueError, "2 entries"),
    ("offs 2-D", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, device=d), offs_of([3, 3], d)[None]), {}, ValueError, "1-D"),
    ("offs missing", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, device=d), None), {}, ValueError, "offs must be int32 \\[G\\] cumulative end offsets"),
    ("offs given to 3Dx3D", lambda d: (rand(2, 6, 8, device=d), rand(2, 8, 4, device=d), offs_of([3, 3], d)), {}, ValueError, "None"),
    ("K mismatch", lambda d: (rand(6, 9, device=d), rand(2, 8, 4, device=d), offs_of([3, 3], d)), {}, ValueError, "b must be \\[G, K, N\\] with K = 9"),
    ("G mismatch 3Dx3D", lambda d: (rand(3, 6, 8, device=d), rand(2, 8, 4, device=d), None), {}, ValueError, r"\[3, 8, N\]"),
    ("dtype mismatch", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, dtype=torch.float16, device=d), offs_of([3, 3], d)), {}, TypeError, "same dtype"),
    ("bias shape", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, device=d), offs_of([3, 3], d)), {"bias": "bad"}, ValueError, r"bias must be of shape \(2, 4\)"),
    ("1-D a", lambda d: (rand(8, device=d), rand(2, 8, 4, device=d), offs_of([3, 3], d)), {}, ValueError, "a must be 2-D or 3-D"),
    ("activation", lambda d: (rand(6, 8, device=d), rand(2, 8, 4, device=d), offs_of([3, 3], d)), {"activation": "tanh"}, ValueError, "activation"),
]


@pytest.mark.parametrize("name,make,kwargs,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input(name, make, kwargs, exc, match, device):
    a, b, offs = make(device)
    if kwargs.get("bias") == "bad":
        kwargs = {"bias": rand(4, device=device)}
    with pytest.raises(exc, match=match):
        onegemm.grouped_matmul(a, b, offs, **kwargs)


# ---- list mode ----

LIST_CASES = [
    # (M, N, K) per pair: mixed shapes, a pair with M = 0, K = 1, one-row and one-column pairs.
    [(17, 33, 65), (1, 300, 7), (127, 1, 40), (0, 5, 9), (40, 45, 1)],
    [(64, 64, 64)],
    [(5, 6, 7)] * 9,
]


@pytest.mark.parametrize("shapes", LIST_CASES, ids=["mixed", "one", "many"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_list_mode(shapes, dtype, device):
    As = [rand(m, k, dtype=dtype, device=device) for m, n, k in shapes]
    # Mix layouts: every other b is a transposed view, the first a is a strided slice.
    Bs = [rand(k, n, dtype=dtype, device=device) if i % 2 else rand(n, k, dtype=dtype, device=device).t() for i, (m, n, k) in enumerate(shapes)]
    if shapes[0][0] > 0:
        m, n, k = shapes[0]
        As[0] = rand(2 * m, k + 3, dtype=dtype, device=device)[::2, 1 : 1 + k]
    outs = onegemm.grouped_matmul(As, Bs)
    assert isinstance(outs, list) and len(outs) == len(shapes)
    for i, (x, w, o) in enumerate(zip(As, Bs, outs)):
        assert o.dtype == dtype
        assert_close(o, matmul_ref(x, w), TOL[dtype], what=f"pair {i} {tuple(x.shape)} @ {tuple(w.shape)}")


def test_list_mode_activation_and_fp8(device):
    As = [rand(20, 48, device=device).to(torch.float8_e4m3fn), rand(33, 70, device=device).to(torch.float8_e4m3fn)]
    Bs = [rand(30, 48, device=device).to(torch.float8_e4m3fn).t(), rand(17, 70, device=device).to(torch.float8_e4m3fn).t()]
    outs = onegemm.grouped_matmul(As, Bs, activation="relu")
    for x, w, o in zip(As, Bs, outs):
        assert o.dtype == torch.bfloat16
        assert_close(o, matmul_ref(x, w, activation="relu"), TOL[torch.bfloat16])


def test_list_mode_bad_input(device):
    a = rand(4, 8, device=device)
    with pytest.raises(ValueError, match="as many b's"):
        onegemm.grouped_matmul([a, a], [a.t()])
    with pytest.raises(ValueError, match=r"b\[1\] must be \[K, N\]"):
        onegemm.grouped_matmul([a, a], [a.t(), a])
    with pytest.raises(TypeError, match="share one dtype"):
        onegemm.grouped_matmul([a, a.half()], [a.t(), a.t().half()])
    with pytest.raises(ValueError, match="offs must be None in list mode"):
        onegemm.grouped_matmul([a], [a.t()], offs_of([4], device))
    assert onegemm.grouped_matmul([], []) == []


# ---- GPU only ----


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_offs(device):
    """No host sync: the call captures in a CUDA graph and replays with new offs contents."""
    G, K, N, M = 8, 256, 384, 1000
    a = rand(M, K, dtype=torch.bfloat16, device=device)
    b = expert_weights(G, K, N, torch.bfloat16, device)
    offs = offs_of([100] * 8, device)
    onegemm.grouped_matmul(a, b, offs)  # autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = onegemm.grouped_matmul(a, b, offs)
    for sizes in ([0, 300, 1, 0, 250, 49, 200, 100], [1000, 0, 0, 0, 0, 0, 0, 0], [10] * 8):
        offs.copy_(offs_of(sizes, device))
        a.copy_(rand(M, K, dtype=torch.bfloat16, device=device))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.bfloat16], what=str(sizes))
        assert (out[sum(sizes):] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("rows_per_group", [4, 600])  # decode-like and prefill-like tiles
def test_gpu_chosen_config_moe_shapes(dtype, rows_per_group, device):
    """The config the shipped table or the heuristic chooses for ragged groups of MoE sizes."""
    G, K, N = 16, 1024, 768
    sizes = torch.randint(0, 2 * rows_per_group, (G,)).tolist()
    sizes[3] = 0
    a = rand(sum(sizes), K, dtype=dtype, device=device)
    b = expert_weights(G, K, N, dtype, device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs)
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.bfloat16 if dtype != torch.float16 else dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GROUPED_CONFIGS, ids=lambda c: str(c).replace(" ", ""))
def test_gpu_every_grouped_config(cfg, device):
    """Each config the ragged kernel may tune to, forced, in the flavour it names: ragged
    groups with partial tiles (row lengths are 16-byte multiples so TMA is allowed)."""
    dtype = torch.float8_e4m3fn if cfg.kwargs["BLOCK_K"] == 128 else torch.bfloat16
    sizes = [300, 0, 1, 77, 129]
    a = rand(sum(sizes) + 3, 784, dtype=dtype, device=device)
    b = expert_weights(len(sizes), 784, 560, dtype, device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs, config=cfg)
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_matches_torch_grouped_mm(device):
    G, K, N = 8, 512, 256
    sizes = [64, 0, 200, 33, 1, 90, 128, 7]
    a = rand(sum(sizes), K, dtype=torch.bfloat16, device=device)
    b = expert_weights(G, K, N, torch.bfloat16, device)
    offs = offs_of(sizes, device)
    ref = torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
    assert_close(onegemm.grouped_matmul(a, b, offs), ref.float(), 1e-2)


@pytest.mark.gpu
def test_gpu_int64_group_offsets(device):
    """Group starts past 2^31 / K elements: offsets must be int64 in the kernel."""
    K, N = 128, 64
    M = (1 << 31) // K + 1000
    a = torch.empty(M, K, dtype=torch.float16, device=device).normal_()
    b = expert_weights(2, K, N, torch.float16, device)
    offs = offs_of([M - 64, 64], device)
    out = onegemm.grouped_matmul(a, b, offs)
    assert_close(out[-64:], matmul_ref(a[-64:], b[1]), TOL[torch.float16])
    del a, out


@pytest.mark.gpu
def test_gpu_bad_offs_nan_without_sync(device):
    a = rand(300, 64, dtype=torch.bfloat16, device=device)
    b = expert_weights(3, 64, 64, torch.bfloat16, device)
    offs = torch.tensor([100, 50, 300], dtype=torch.int32, device=device)
    assert torch.isnan(onegemm.grouped_matmul(a, b, offs).float()).all()
    with pytest.raises(ValueError, match="non-decreasing"):
        onegemm.grouped_matmul(a, b, offs, check_offs=True)


@pytest.mark.gpu
def test_gpu_list_mode_large(device):
    shapes = [(1000, 512, 256), (17, 4096, 1024), (4096, 129, 300)]
    As = [rand(m, k, dtype=torch.bfloat16, device=device) for m, n, k in shapes]
    Bs = [rand(n, k, dtype=torch.bfloat16, device=device).t() for m, n, k in shapes]
    for x, w, o in zip(As, Bs, onegemm.grouped_matmul(As, Bs)):
        assert_close(o, matmul_ref(x, w), TOL[torch.bfloat16])



# ---- core's TMA flavour (descriptors run under the interpreter too) ----


# 2D x 2D (offs over K, the weight gradient): which of a [M, sum_K] and b [sum_K, N] keep K
# contiguous. A token-major step gives a = x.t() and b = dy (neither); the others start each
# group at any element, which the descriptors read from the group's start.
WGRAD_LAYOUTS = {"a M-major, b N-major": (False, False), "a K-major, b N-major": (True, False),
                 "a K-major, b K-major": (True, True), "a M-major, b K-major": (False, True)}


def wgrad_operands(M, N, sizes, k_major_a, k_major_b, dtype, device):
    """a [M, sum_K] and b [sum_K, N] in the layout asked for; 3 to 10 columns of K past offs[-1],
    so that a K-major operand's rows stay 16-byte aligned (TMA's strides)."""
    K = (sum(sizes) + 3 + 7) // 8 * 8
    a = rand(M, K, dtype=dtype, device=device) if k_major_a else rand(K, M, dtype=dtype, device=device).t()
    b = rand(N, K, dtype=dtype, device=device).t() if k_major_b else rand(K, N, dtype=dtype, device=device)
    return a, b


@pytest.mark.parametrize("mode", ["2d_3d", "3d_3d", "2d_2d"])
def test_tma_flavour(mode, device):
    G, K, N = 3, 72, 80  # rows of 144 / 160 bytes: 16-byte aligned, as TMA needs
    b = expert_weights(G, K, N, torch.float16, device)
    if mode == "2d_3d":
        sizes = [37, 0, 50]
        a = rand(sum(sizes) + 3, K, dtype=torch.float16, device=device)
        offs = offs_of(sizes, device)
    elif mode == "2d_2d":
        # The weight-gradient layout of a token-major step (odd group sizes, an empty group,
        # K past offs[-1]); every layout: test_wgrad_layouts_through_descriptors.
        sizes = [37, 0, 50]
        a, b = wgrad_operands(40, N, sizes, False, False, torch.float16, device)
        offs = offs_of(sizes, device)
    else:
        a = rand(G, 45, K, dtype=torch.float16, device=device)
        offs = None
    bias = rand(G, N, device=device)
    out = onegemm.grouped_matmul(a, b, offs, bias=bias, activation="gelu", tma=True)
    assert_close(out, grouped_mm_ref(a, b, offs, bias, "gelu"), TOL[torch.float16])
    if mode == "2d_3d":
        assert (out[sum(sizes):] == 0).all()


@pytest.mark.parametrize("layout", WGRAD_LAYOUTS)
@pytest.mark.parametrize("sizes", [[40, 0, 48], [37, 0, 50], [3, 61, 5]], ids=["aligned starts", "odd starts", "heads only"])
def test_wgrad_layouts_through_descriptors(layout, sizes, device):
    """2D x 2D in the TMA flavour, in every layout: the descriptors keep the matrices' bases and
    end at each group's end. TMA reads a K-major operand from 16-byte aligned columns only (the
    H200 faults otherwise), so a group starting between them sums its first columns through
    pointers (a group of 3 or 5: nothing but that head)."""
    a, b = wgrad_operands(24, 40, sizes, *WGRAD_LAYOUTS[layout], torch.bfloat16, device)
    offs = offs_of(sizes, device)
    out = onegemm.grouped_matmul(a, b, offs, tma=True)
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.bfloat16])
    assert all((out[g] == 0).all() for g, size in enumerate(sizes) if size == 0)


@pytest.mark.parametrize("use_tma", [False, True])
def test_config_names_its_flavour(use_tma, device):
    """A config that carries USE_TMA (as tuned table entries do) runs that
    flavour; one asking for TMA where the operands cannot use it is refused, not ignored."""
    G, K, N = 3, 72, 80
    b = expert_weights(G, K, N, torch.float16, device)
    sizes = [37, 0, 50]
    a = rand(sum(sizes), K, dtype=torch.float16, device=device)
    offs = offs_of(sizes, device)
    cfg = _cfg(32, 64, 64, 1, 1, group_m=4)
    cfg = type(cfg)({**cfg.kwargs, "USE_TMA": use_tma}, num_warps=1, num_stages=1)
    out = onegemm.grouped_matmul(a, b, offs, config=cfg, tma=True if use_tma else None)
    assert_close(out, grouped_mm_ref(a, b, offs), TOL[torch.float16])
    if use_tma:  # offs over N shift the output's group bases by single elements: no TMA
        a_n = rand(2, 20, 16, dtype=torch.float16, device=device)
        b_n = rand(16, 24, dtype=torch.float16, device=device)
        with pytest.raises(ValueError, match="config must be free of USE_TMA=True"):
            onegemm.grouped_matmul(a_n, b_n, offs_of([8, 16], device), config=cfg)


def test_tma_refused_where_group_bases_misalign(device):
    a = rand(20, 16, dtype=torch.float16, device=device)
    b = rand(16, 24, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="tma must be None .automatic. or False for these operands, got True: offs over N"):
        onegemm.grouped_matmul(rand(2, 20, 16, dtype=torch.float16, device=device), b, offs_of([8, 16], device), tma=True)
    b3 = expert_weights(2, 16, 24, torch.float16, device)
    with pytest.raises(ValueError, match="row-major"):
        onegemm.grouped_matmul(rand(16, 24, dtype=torch.float16, device=device).t(), b3, offs_of([8, 12], device), tma=True)


# ---- offs given as a strided view (read in place through its stride) ----

OFFS_VIEW_CASES = ["2d_3d", "2d_2d", "3d_2d"]


@pytest.mark.parametrize("mode", OFFS_VIEW_CASES)
def test_strided_offs_view(mode, device):
    """offs = base[::2], a valid 1-D int32 view with stride 2: every group must use its own
    offsets (reading offs_ptr + g would take every other element's neighbour)."""
    sizes = [3, 0, 17, 5]
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    base = torch.full((2 * len(sizes),), 10**6, dtype=torch.int32)
    base[::2] = ends
    offs = base.to(device)[::2]
    assert offs.stride(0) == 2
    total, G = int(ends[-1]) + 2, len(sizes)
    if mode == "2d_3d":
        a, b = rand(total, 24, device=device), rand(G, 24, 20, device=device)
    elif mode == "2d_2d":
        a, b = rand(12, total, device=device), rand(total, 20, device=device)
    else:
        a, b = rand(G, 12, 24, device=device), rand(24, total, device=device)
    out = onegemm.grouped_matmul(a, b, offs)
    assert_close(out, grouped_mm_ref(a, b, offs.contiguous()), TOL[torch.float32])


# ---- FP8 (2D x 3D with dequantisation scales) ----

# (scale_a granularity, scale_b granularity, rows of each group): K = 200 and N = 136 are not
# multiples of 128; an empty group and 3 rows past offs[-1] in every case.
FP8_CASES = [
    ("1x128", "128x128", [37, 0, 50]),
    ("row", "col", [37, 0, 50]),
    ("1x128", "col", [1, 0, 2]),
    ("row", "128x128", [5, 0, 17]),
]


@pytest.mark.parametrize("kind_a,kind_b,sizes", FP8_CASES)
def test_fp8_grouped(kind_a, kind_b, sizes, device):
    qa, qb, sa, sb, offs, a_deq, b_deq = fp8_grouped_inputs(kind_a, kind_b, sizes, 200, 136, device)
    bias = torch.randn(len(sizes), 136, device=device)
    out = onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb, bias=bias, activation="silu")
    assert out.dtype == torch.bfloat16
    assert_close(out, grouped_mm_ref(a_deq, b_deq, offs, bias, "silu"), TOL[torch.bfloat16])
    assert (out[sum(sizes):] == 0).all()


def test_fp8_grouped_bad_input(device):
    qa, qb, sa, sb, offs, _, _ = fp8_grouped_inputs("1x128", "128x128", [3, 5], 200, 300, device)
    with pytest.raises(ValueError, match="scale_b must be an fp32 tensor given with scale_a"):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa)
    with pytest.raises(ValueError, match="scale_a must be .sum_M, ceil.K/128.. = .11, 2."):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa[:, :1].t(), scale_b=sb)
    with pytest.raises(ValueError, match="scale_b must be .G, ceil.K/128., ceil.N/128.. = .2, 2, 3."):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb.transpose(1, 2))
    with pytest.raises(TypeError, match="a must be float8_e4m3fn or float8_e5m2"):
        onegemm.grouped_matmul(qa.to(torch.bfloat16), qb.to(torch.bfloat16), offs, scale_a=sa, scale_b=sb)
    with pytest.raises(ValueError, match="scale_a must be None except in the 2D x 3D mode"):
        onegemm.grouped_matmul(qa[:4].unsqueeze(0).expand(2, 4, 200), qb, scale_a=sa, scale_b=sb)
    with pytest.raises(ValueError, match="config must be a config with BLOCK_K = 128"):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb, config=_cfg(32, 64, 64, 1, 1))
    with pytest.raises(ValueError, match="scale_a must be free of requires_grad"):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa.clone().requires_grad_(), scale_b=sb)


@pytest.mark.parametrize("kind_a,kind_b,sizes", FP8_CASES)
def test_fp8_grouped_scale_of_no_granularity(kind_a, kind_b, sizes, device):
    """Beside a scale of each granularity, a scale whose shape fits none is refused by its
    argument's name, with both shapes it may take for the operand it scales."""
    qa, qb, sa, sb, offs, _, _ = fp8_grouped_inputs(kind_a, kind_b, sizes, 200, 136, device)
    M, G = qa.shape[0], len(sizes)
    want = (f"scale_a must be [sum_M, ceil(K/128)] = [{M}, 2] (1x128 per token) or [sum_M, 1] = [{M}, 1] (row-wise) "
            f"for a [sum_M, K] = [{M}, 200], got shape (1, {M})")
    with pytest.raises(ValueError, match=re.escape(want)):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa[:, :1].t(), scale_b=sb)
    want = (f"scale_b must be [G, ceil(K/128), ceil(N/128)] = [{G}, 2, 2] (128x128) or [G, 1, N] = [{G}, 1, 136] "
            f"(per output channel) for b [G, K, N] = [{G}, 200, 136], got shape ({G}, {sb.shape[1]}, 1)")
    with pytest.raises(ValueError, match=re.escape(want)):
        onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb[..., :1])


def test_fp8_grouped_ambiguous_scales_read_as_blocks():
    """K <= 128: [sum_M, 1] is both 1x128 and row-wise; with N == 1 too, [G, 1, 1] is both
    128x128 and per-channel. grouped_matmul takes the block reading (the K loop's path), the
    first in its table; either gives every element the same multiplier."""
    assert read_granularity("scale_a", torch.ones(7, 1), SCALES_A, "a", ("sum_M", "K"), (7, 100)) == ROW_BLOCKS
    assert read_granularity("scale_b", torch.ones(2, 1, 1), SCALES_B, "b", ("G", "K", "N"), (2, 100, 1)) == BLOCKS
