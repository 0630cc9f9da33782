"""The dense GEMM against float64 torch: onegemm.matmul, onegemm.persistent_matmul (the same
contract on the persistent schedule), onegemm.linear and core's tile helpers.

Every case of matmul's contract runs through each op in ``OPS``; tests/test_persistent.py keeps
what only the persistent schedule has (grid sizes, the schedule knob) and tests/test_tma.py the
TMA flavour.
"""

from functools import partial

import pytest
import torch
import triton
import triton.language as tl

import onegemm
from onegemm.core import configs, launch, scratch, splitk
from onegemm.core.checks import ACTIVATIONS
from onegemm.core.configs import DEEP_K_CONFIGS, MATMUL_CONFIGS, SPLIT_K_CONFIGS, WS_CONFIGS
from onegemm.core.configs import MATMUL_INTERPRET as INTERPRET_CONFIG
from onegemm.core.configs import cfg as _cfg
from onegemm.core.tiles import swizzle_tile
from onegemm.testing import TF32_TOL, TOL, assert_close, matmul_ref

from helpers import DTYPES, FP8, FP8_MMA_TOL, make, split_cfg, tol_for

# (M, N, K): edge sizes of 1, odd sizes, K below / not a multiple of BLOCK_K, more than one group.
SHAPES = [
    (1, 1, 1),
    (1, 300, 127),
    (17, 33, 65),
    (127, 1, 300),
    (300, 127, 17),
    (64, 64, 64),
    (200, 100, 96),
]
LAYOUTS = [("contig", "contig"), ("transposed", "contig"), ("contig", "transposed"), ("sliced", "sliced")]

# matmul's contract through every op that offers it: one program per tile, and the persistent
# schedule at several grid sizes: 1 program, 3, the default (the SM count; a few under the
# interpreter) and more programs than there are tiles (the launch clamps the grid).
OPS = {
    "matmul": onegemm.matmul,
    "persistent": onegemm.persistent_matmul,
    "persistent-1": partial(onegemm.persistent_matmul, num_programs=1),
    "persistent-3": partial(onegemm.persistent_matmul, num_programs=3),
    "persistent-many": partial(onegemm.persistent_matmul, num_programs=10**6),
}
# Where the grid size cannot matter: one op per schedule.
BOTH = ["matmul", "persistent-3"]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("layout_a,layout_b", LAYOUTS)
def test_shapes_and_layouts(op, M, N, K, layout_a, layout_b, device):
    a = make((M, K), torch.float16, device, layout_a)
    b = make((K, N), torch.float16, device, layout_b)
    out = OPS[op](a, b)
    assert out.dtype == torch.float16 and out.shape == (M, N)
    assert_close(out, matmul_ref(a, b), TOL[torch.float16])


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", [(17, 33, 65), (127, 96, 300)])
def test_dtypes(op, dtype, M, N, K, device):
    a = make((M, K), dtype, device)
    b = make((N, K), dtype, device).t()  # W.t(): K-major B, the nn.Linear layout
    out = OPS[op](a, b)
    assert out.dtype == (torch.bfloat16 if dtype in FP8 else dtype)
    assert_close(out, matmul_ref(a, b), tol_for(dtype))


@pytest.mark.parametrize("op", BOTH)
@pytest.mark.parametrize("a_dtype,b_dtype", [(torch.float8_e4m3fn, torch.float8_e5m2), (torch.float8_e5m2, torch.float8_e4m3fn)], ids=str)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16])
def test_fp8_mixed_and_out_dtype(op, a_dtype, b_dtype, out_dtype, device):
    a = make((40, 70), a_dtype, device)
    b = make((70, 33), b_dtype, device)
    out = OPS[op](a, b, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or torch.bfloat16)
    assert_close(out, matmul_ref(a, b), tol_for(a_dtype, out.dtype))


@pytest.mark.parametrize("op", BOTH)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_epilogue(op, activation, with_bias, dtype, device):
    M, N, K = 45, 70, 50
    a = make((M, K), dtype, device)
    b = make((K, N), dtype, device)
    bias = torch.randn(N, device=device).to(dtype) if with_bias else None
    out = OPS[op](a, b, bias=bias, activation=activation)
    assert_close(out, matmul_ref(a, b, bias, activation), tol_for(dtype))


@pytest.mark.parametrize("op", BOTH)
def test_strided_bias(op, device):
    a = make((20, 40), torch.float32, device)
    b = make((40, 30), torch.float32, device)
    bias = torch.randn(30, 2, device=device)[:, 1]  # stride 2
    assert_close(OPS[op](a, b, bias=bias, activation="relu"), matmul_ref(a, b, bias, "relu"), TOL[torch.float32])


@pytest.mark.parametrize("op", BOTH)
@pytest.mark.parametrize("M,N,K", [(0, 5, 7), (5, 0, 7), (0, 0, 0)])
def test_empty_output(op, M, N, K, device):
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    out = OPS[op](a, b)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16 and out.device == a.device
    out = OPS[op](a, b, out_dtype=torch.float32)
    assert out.shape == (M, N) and out.dtype == torch.float32


@pytest.mark.parametrize("op", BOTH)
def test_k_zero_gives_act_bias(op, device):
    """K == 0: the product is all zeros, so the output is act(bias) (as in torch.addmm)."""
    a = torch.randn(6, 0, device=device)
    b = torch.randn(0, 9, device=device)
    bias = torch.randn(9, device=device)
    out = OPS[op](a, b, bias=bias, activation="silu")
    assert_close(out, matmul_ref(a, b, bias, "silu"), TOL[torch.float32])


# ---- Tutorial 03's four classic mistakes: each test fails if the mistake comes back. ----


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 64), (64, 32)])
def test_pitfall_grid_follows_chosen_config(block_m, block_n, device):
    """A grid built from one fixed BLOCK_M leaves tiles unwritten (NaN-poisoned) or runs off the
    end when another config runs. The grid lambda reads the config actually launched."""
    M, N, K = 150, 90, 40
    a = make((M, K), torch.float32, device)
    b = make((K, N), torch.float32, device)
    cfg = _cfg(block_m, block_n, 32, 4, 2, group_m=2)
    out = onegemm.matmul(a, b, config=cfg)
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])


@pytest.mark.parametrize("K", [33, 65, 100])
def test_pitfall_k_tail_is_masked(K, device):
    """K not a multiple of BLOCK_K: A and B are windows into larger buffers whose columns/rows
    past K hold NaN. An unmasked last K block of either operand puts NaN in the result (a
    finite pad would hide a missing mask on one side: pad * 0 from the other side is 0)."""
    M, N = 40, 24
    big_a = torch.full((M, K + 40), float("nan"), device=device)
    big_b = torch.full((K + 40, N), float("nan"), device=device)
    big_a[:, :K] = torch.randn(M, K, device=device)
    big_b[:K] = torch.randn(K, N, device=device)
    a, b = big_a[:, :K], big_b[:K]
    assert_close(onegemm.matmul(a, b), matmul_ref(a, b), TOL[torch.float32])


def test_pitfall_fp32_accumulator_at_large_k(device):
    """fp16 inputs, K = 4096, all-positive terms: the sum grows to ~1000, where an fp16
    accumulator's spacing is 0.5 to 1 and most products (~0.25) would round away (errors of
    10% and more). The fp32 accumulator stays within 1e-4 of float64 (output in fp32):
    1e-7 on the interpreter, 2.4e-5 measured on the H200, whose tensor cores add into fp32
    with truncation rather than round-to-nearest."""
    M, N, K = 32, 32, 4096
    a = torch.rand(M, K, device=device).half()
    b = torch.rand(K, N, device=device).half()
    out = onegemm.matmul(a, b, out_dtype=torch.float32)
    assert_close(out, matmul_ref(a, b), 1e-4)


@pytest.mark.parametrize("M", [7 * 32, 5 * 32 + 3])
def test_pitfall_short_last_group(M, device):
    """num_pid_m % GROUP_M != 0 (7 or 6 row blocks with GROUP_M=4): the last group is shorter.
    Mapping it with the full GROUP_M would send tiles past the matrix and skip others."""
    cfg = INTERPRET_CONFIG
    assert triton.cdiv(M, cfg.kwargs["BLOCK_M"]) % cfg.kwargs["GROUP_M"] != 0
    a = make((M, 50), torch.float32, device)
    b = make((50, 100), torch.float32, device)
    assert_close(onegemm.matmul(a, b, config=cfg), matmul_ref(a, b), TOL[torch.float32])


@triton.jit
def _tile_map_kernel(out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = swizzle_tile(pid, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_n)


@pytest.mark.parametrize("num_pid_m,num_pid_n,group_m", [(7, 5, 4), (1, 9, 8), (9, 1, 8), (16, 3, 8), (5, 5, 1)])
def test_swizzle_tile_is_a_bijection(num_pid_m, num_pid_n, group_m, device):
    """Every (pid_m, pid_n) is visited exactly once, in GROUP_M-tall column-major groups."""
    n = num_pid_m * num_pid_n
    out = torch.full((n, 2), -1, dtype=torch.int32, device=device)
    _tile_map_kernel[(n,)](out, num_pid_m, num_pid_n, group_m)
    pairs = [tuple(p) for p in out.cpu().tolist()]
    assert sorted(pairs) == [(m, k) for m in range(num_pid_m) for k in range(num_pid_n)]
    # Inside the first full group, pid_m runs fastest.
    if num_pid_m >= group_m and num_pid_n > 1:
        assert pairs[: group_m] == [(m, 0) for m in range(group_m)]


# ---- linear ----


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(lead, with_bias, device):
    K, N = 40, 24
    x = torch.randn(*lead, K, device=device)
    w = torch.randn(N, K, device=device)
    bias = torch.randn(N, device=device) if with_bias else None
    out = onegemm.linear(x, w, bias, activation="gelu")
    ref = matmul_ref(x.reshape(-1, K), w.t(), bias, "gelu").reshape(*lead, N)
    assert out.shape == (*lead, N)
    assert_close(out, ref, TOL[torch.float32])


def test_linear_sliced_input(device):
    x = torch.randn(10, 3, 64, device=device)[:, 1, 8:40]  # gaps in both leading and K dims
    w = torch.randn(20, 32, device=device)
    assert_close(onegemm.linear(x, w), matmul_ref(x, w.t()), TOL[torch.float32])


# ---- bad input: ValueError / TypeError naming the argument ----


# ---- Split-K (core/splitk.py, tiles.split_k_combine) ----

# (M, N, K, SPLIT_K, dtype, layout_a, layout_b, tma, activation): the K blocks (32 deep under
# the interpreter's config, 32/64/128 by dtype on the H200) dealt unevenly (10 blocks over 3),
# splits left empty (2 blocks over 4), K == 1, K == 0 (every split empty: the output is
# act(bias)), transposed and sliced operands, 16-bit and fp8 inputs, and the TMA flavour.
# The 1x1 output has no activation: one gelu value near its zero has no relative accuracy.
SPLIT_CASES = [
    (17, 33, 300, 3, torch.float32, "contig", "transposed", None, "gelu"),
    (5, 40, 40, 4, torch.float32, "contig", "contig", None, "gelu"),
    (1, 1, 1, 2, torch.float32, "contig", "contig", None, None),
    (6, 9, 0, 2, torch.float32, "contig", "contig", None, "gelu"),
    (40, 70, 129, 2, torch.float32, "transposed", "sliced", None, "silu"),
    (70, 20, 200, 8, torch.float16, "sliced", "transposed", None, "gelu"),
    (33, 50, 160, 3, torch.float8_e4m3fn, "contig", "transposed", None, "relu"),
    (20, 48, 96, 3, torch.float32, "contig", "transposed", True, "gelu"),
]


@pytest.mark.parametrize("op", ["matmul", "persistent-1", "persistent-3", "persistent-many"])
@pytest.mark.parametrize("M,N,K,split,dtype,layout_a,layout_b,tma,activation", SPLIT_CASES)
def test_split_k(op, M, N, K, split, dtype, layout_a, layout_b, tma, activation, device):
    """Each split sums its own K blocks; the last one adds all partials, then bias and the
    activation run once (twice, or on a partial, would show), and every tile is written. The
    persistent walk over (tile, split) units: one program running every split of every tile in
    turn, fewer programs than one tile's splits, and one program per unit."""
    a = make((M, K), dtype, device, layout_a)
    b = make((K, N), dtype, device, layout_b)
    bias = torch.randn(N, device=device)
    out = OPS[op](a, b, bias=bias, activation=activation, config=split_cfg(split, dtype), tma=tma)
    assert_close(out, matmul_ref(a, b, bias, activation), tol_for(dtype))


def test_split_k_buffers_are_reusable_and_deterministic(device):
    """The last split puts its tile's counter back to 0, so the cached buffers serve launch
    after launch (and CUDA-graph replays) as they are; the partials are added in split order,
    so every launch gives the same bits. A counter left at 1 would leave the second launch's
    tiles unwritten (NaN)."""
    launch.reset()
    a = make((37, 300), torch.float32, device)
    b = make((300, 70), torch.float32, device)
    first = onegemm.matmul(a, b, activation="relu", config=split_cfg(3))
    held = dict(scratch._held)
    second = onegemm.matmul(a, b, activation="relu", config=split_cfg(3))
    assert_close(first, matmul_ref(a, b, None, "relu"), TOL[torch.float32])
    assert torch.equal(first, second)
    assert len(held) == 2 and all(scratch._held[k] is held[k] for k in held)  # reused, not re-allocated
    (counters,) = [buf for key, buf in scratch._held.items() if key[2] == "split_k_counters"]
    assert int(counters.abs().sum()) == 0  # every counter back at zero


def test_split_k_buffers_grow_and_stay_zeroed(device):
    """A launch that needs more workspace or counters than the cached buffers gets larger
    ones (zeroed counters); a smaller one reuses what is there."""
    launch.reset()
    dev = torch.device(device)
    ws, counters = splitk.buffers(dev, 100, 3)
    assert ws.numel() >= 100 and counters.numel() >= 3 and int(counters.abs().sum()) == 0
    again = splitk.buffers(dev, 50, 2)
    assert again[0] is ws and again[1] is counters
    bigger = splitk.buffers(dev, 1000, 40)
    assert bigger[0].numel() >= 1000 and bigger[1].numel() >= 40 and int(bigger[1].abs().sum()) == 0
    assert bigger[0].dtype == torch.float32 and bigger[1].dtype == torch.int32


def test_split_k_tuned_only_for_small_m():
    """Autotuning tries split configs while SPLIT_K x the M bucket <= 512 (the workspace's
    rows), and the heuristic splits only when the tiles leave SMs idle and K is long."""
    def splits(m):
        key = configs.MatmulKey("bf16", m, 4096, 4096, True, True, configs.EITHER, configs.ANY_SCHEDULE, 0)
        return sorted({configs.split_of(c) for c in configs.matmul_candidates(key, 132)})

    assert splits(16) == [1, 2, 4, 8]
    assert splits(128) == [1, 2, 4]
    assert splits(1024) == [1]

    def pick(m, n, k):
        key = configs.MatmulKey("bf16", m, n, k, True, True, configs.EITHER, configs.ANY_SCHEDULE, 0)
        return configs.matmul_heuristic(key, 132)

    assert configs.split_of(pick(16, 4096, 4096)) == 4  # 64 tiles of 64x64
    assert configs.split_of(pick(16, 14336, 4096)) == 1  # 224 tiles: the SMs are busy
    assert configs.split_of(pick(16, 4096, 256)) == 1  # 4 K blocks: too short to split
    assert configs.split_of(pick(4096, 4096, 4096)) == 1


# (match, kwargs(t), exception): t(*shape) is a random fp32 tensor on the test's device.
BAD_CASES = [
    pytest.param("a", lambda t: dict(a=t(3), b=t(3, 4)), ValueError, id="a 1-D"),
    pytest.param("b", lambda t: dict(a=t(3, 4), b=t(2, 4, 5)), ValueError, id="b 3-D"),
    pytest.param("b must be \\[K, N\\]", lambda t: dict(a=t(3, 4), b=t(5, 6)), ValueError, id="K mismatch"),
    pytest.param("a and b must be of the same dtype", lambda t: dict(a=t(3, 4), b=t(4, 5).half()), TypeError,
                 id="fp32 x fp16"),
    pytest.param("a must be of dtype", lambda t: dict(a=t(3, 4).to(torch.int32), b=t(4, 5)), TypeError, id="int32"),
    pytest.param("b must be float8_e4m3fn when a is float8_e5m2", lambda t: dict(a=t(3, 4).to(torch.float8_e5m2), b=t(4, 5).to(torch.float8_e5m2)),
                 TypeError, id="e5m2 x e5m2"),
    pytest.param("bias must be of shape", lambda t: dict(a=t(3, 4), b=t(4, 5), bias=t(4)), ValueError, id="bias [M]"),
    pytest.param("bias must be", lambda t: dict(a=t(3, 4), b=t(4, 5), bias=[1.0] * 5), TypeError, id="bias a list"),
    pytest.param("activation must be one of", lambda t: dict(a=t(3, 4), b=t(4, 5), activation="tanh"), ValueError,
                 id="activation tanh"),
    pytest.param("out_dtype", lambda t: dict(a=t(3, 4), b=t(4, 5), out_dtype=torch.int8), TypeError, id="out_dtype int8"),
    pytest.param("a must be a", lambda t: dict(a=torch.empty(3, 4, device="meta"), b=t(4, 5)), ValueError, id="a on meta"),
    pytest.param("a must be a torch.Tensor", lambda t: dict(a=[[1.0]], b=t(1, 5)), TypeError, id="a a list"),
]


@pytest.mark.parametrize("op", BOTH)
@pytest.mark.parametrize("match,kwargs,exc", BAD_CASES)
def test_bad_input(op, match, kwargs, exc, device):
    with pytest.raises(exc, match=match):
        OPS[op](**kwargs(lambda *shape: torch.randn(*shape, device=device)))


def test_linear_bad_input(device):
    with pytest.raises(ValueError, match="weight must be \\[out_features, 8\\]"):
        onegemm.linear(torch.randn(3, 8, device=device), torch.randn(4, 7, device=device))


# ---- GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (300, 1000, 513), (4096, 4096, 4096), (3000, 14336, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_gpu_chosen_config_large(M, N, K, dtype, device):
    """The config the shipped table or the heuristic chooses (autotuning is opt-in), on a
    NaN-poisoned output."""
    a = make((M, K), dtype, device)
    b = make((N, K), dtype, device).t()
    out = onegemm.matmul(a, b)
    assert_close(out, matmul_ref(a, b), tol_for(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MATMUL_CONFIGS + SPLIT_K_CONFIGS, ids=lambda c: str(c).replace(" ", ""))
def test_gpu_every_config(cfg, device):
    """Each Hopper config, forced, on a shape with partial tiles on every edge."""
    dtype = torch.float8_e4m3fn if cfg.kwargs["BLOCK_K"] == 128 else torch.bfloat16
    a = make((333, 777), dtype, device)
    b = make((555, 777), dtype, device).t()
    bias = torch.randn(555, device=device, dtype=torch.bfloat16)
    out = onegemm.matmul(a, b, bias=bias, activation="gelu", config=cfg)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", DEEP_K_CONFIGS, ids=lambda c: str(c).replace(" ", ""))
def test_gpu_deep_k_configs(cfg, dtype, tma, device):
    """The 16-bit small-M tiles with BLOCK_K = 128, forced, on M = 17 and 127 with partial
    tiles on every edge and a K that is no multiple of 128 (TMA: row lengths it can take)."""
    for M in (17, 127):
        a = make((M, 1000), dtype, device)
        b = make((304, 1000), dtype, device).t()
        bias = torch.randn(304, device=device, dtype=dtype)
        out = onegemm.matmul(a, b, bias=bias, activation="gelu", config=cfg, tma=tma)
        assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cfg", WS_CONFIGS, ids=lambda c: str(c).replace(" ", ""))
def test_gpu_warp_specialized_configs(cfg, dtype, device):
    """The tuned warp-specialised configs (TMA only), forced, with partial tiles on every edge
    (K = 784 and N = 560: row lengths TMA can take), bias and activation."""
    a = make((333, 784), dtype, device)
    b = make((560, 784), dtype, device).t()
    bias = torch.randn(560, device=device, dtype=dtype)
    out = onegemm.matmul(a, b, bias=bias, activation="gelu", config=cfg)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[dtype])


# fp32 outputs of 16-bit inputs at the sizes whose heuristic tiles are the large TMA ones (an
# fp32 C tile for the TMA store did not fit beside their pipelines): a DeepSeek-V3 router's
# logits at prefill, and a square GEMM.
FP32_OUT_CASES = [(16384, 256, 7168), (4096, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", FP32_OUT_CASES, ids=lambda v: str(v))
def test_gpu_fp32_out_large(M, N, K, device):
    a = make((M, K), torch.bfloat16, device)
    b = make((N, K), torch.bfloat16, device).t()
    out = onegemm.matmul(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, matmul_ref(a, b), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_int64_offsets(device):
    """A [M, K] with M * K > 2^31 elements: row offsets need int64 arithmetic."""
    M, K, N = 2**31 // 512 + 4096, 512, 64
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    out = onegemm.matmul(a, b)
    tail = slice(M - 3000, M)  # rows whose offsets pass 2^31
    assert_close(out[tail], matmul_ref(a[tail], b), TOL[torch.bfloat16])
    del a
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_fp32_tf32_follows_torch(device):
    a = make((256, 512), torch.float32, device)
    b = make((512, 128), torch.float32, device)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert_close(onegemm.matmul(a, b), matmul_ref(a, b), 1e-5)
        torch.set_float32_matmul_precision("high")
        assert_close(onegemm.matmul(a, b), matmul_ref(a, b), TF32_TOL)
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.gpu
def test_gpu_graph_bench_falls_back_to_eager(capsys, device):
    """A function that cannot be captured (it syncs with the host) is timed eagerly, and
    graph_bench says so rather than failing."""
    from onegemm.core.runtime import graph_bench

    x = torch.randn(1000, device=device)
    ms = graph_bench(lambda: x.sum().item(), warmup=1, rep=5)
    assert 0 < ms < float("inf")
    assert "timing eagerly" in capsys.readouterr().out


# ---- fp8 values the interpreter cannot load (it gets an fp16 copy; exact) ----


@pytest.mark.parametrize("case", ["e4m3 NaN", "e5m2 subnormals"])
def test_fp8_special_values(case, device):
    """An e4m3fn NaN in a gives NaN in its output row (not a finite product of +-480), and
    e5m2 subnormals (below 2^-14) count at their value (not as zero)."""
    if case == "e4m3 NaN":
        a = torch.randn(20, 64, device=device).to(torch.float8_e4m3fn)
        a[7, 5] = float("nan")
        b = torch.randn(64, 16, device=device).to(torch.float8_e5m2)
    else:
        # e5m2's subnormals are the multiples of 2^-16 below 2^-14.
        sign = torch.randint(0, 2, (20, 64), device=device) * 2 - 1
        a = (torch.randint(1, 4, (20, 64), device=device) * sign * 2.0**-16).to(torch.float8_e5m2)
        b = torch.randn(64, 16, device=device).to(torch.float8_e4m3fn)
        assert (a.float().abs() < 2**-14).all() and (a.float() != 0).all()
    out = onegemm.matmul(a, b, out_dtype=torch.float32)
    ref = matmul_ref(a, b)
    rows = torch.isnan(ref).any(1)
    assert torch.equal(torch.isnan(out).any(1), rows)
    assert_close(out[~rows], ref[~rows], FP8_MMA_TOL)


def test_example_bias_gelu_epilogue_runs():
    """examples/bias_gelu_epilogue.py (the fused bias + GELU exercise) runs and checks itself
    against float64 (on the interpreter: a small problem, no timing)."""
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(onegemm.__file__).parent / "examples" / "bias_gelu_epilogue.py"), run_name="__main__")
