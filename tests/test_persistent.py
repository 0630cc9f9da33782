"""onegemm.persistent_matmul and the TMA flavour of core's tile helpers, against float64 torch.

The persistent kernel must give onegemm.matmul's results on every case core's tests use
(the case lists are imported from test_core.py, not copied), whatever the grid size: 1
program, 3, the default (SM count; a few under the interpreter), or more than there are tiles.
The TMA flavour runs under the interpreter too (it executes tensor descriptors), so its CPU
tests force it with tma=True; the automatic choice (tma=None) is pointer loads there.
"""

import threading

import pytest
import torch
import triton

import onegemm
from onegemm.core import configs
from onegemm.core import tma as core_tma
from onegemm.core.checks import ACTIVATIONS
from onegemm.core.configs import ANY_SCHEDULE, PER_TILE, PERSISTENT_CONFIGS, PERSISTENT_ONLY, warp_specialized, with_meta
from onegemm.core.configs import MATMUL_INTERPRET as INTERPRET_CONFIG
from onegemm.core.configs import cfg as _cfg
from onegemm.core.matmul import MATMUL
from onegemm.core.runtime import default_programs
from onegemm.testing import TOL, assert_close, matmul_ref
from test_core import DTYPES, FP8, LAYOUTS, SHAPES, SPLIT_CASES, _bad_cases, make, split_cfg, tol_for

# num_programs cases: None is the default (SM count on a GPU, INTERPRET_PROGRAMS here);
# 10**6 is more than any test's tile count (the grid is clamped to the tiles).
PROGRAMS = [1, 3, None, 10**6]


@pytest.mark.parametrize("num_programs", PROGRAMS)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("layout_a,layout_b", LAYOUTS)
def test_persistent_shapes_and_layouts(M, N, K, layout_a, layout_b, num_programs, device):
    a = make((M, K), torch.float16, device, layout_a)
    b = make((K, N), torch.float16, device, layout_b)
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs)
    assert out.dtype == torch.float16 and out.shape == (M, N)
    assert_close(out, matmul_ref(a, b), TOL[torch.float16])


@pytest.mark.parametrize("num_programs", PROGRAMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", [(17, 33, 65), (127, 96, 300)])
def test_persistent_dtypes(dtype, M, N, K, num_programs, device):
    a = make((M, K), dtype, device)
    b = make((N, K), dtype, device).t()  # W.t(): K-major B
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs)
    assert out.dtype == (torch.bfloat16 if dtype in FP8 else dtype)
    assert_close(out, matmul_ref(a, b), tol_for(dtype))


@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16])
def test_persistent_fp8_mixed_and_out_dtype(out_dtype, device):
    a = make((40, 70), torch.float8_e4m3fn, device)
    b = make((70, 33), torch.float8_e5m2, device)
    out = onegemm.persistent_matmul(a, b, out_dtype=out_dtype, num_programs=3)
    assert out.dtype == (out_dtype or torch.bfloat16)
    # tol_for, as core's fp8 test: an fp32 output of fp8 inputs carries the MMA's rounding.
    assert_close(out, matmul_ref(a, b), tol_for(a.dtype, out.dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_persistent_epilogue(activation, with_bias, dtype, device):
    M, N, K = 45, 70, 50
    a = make((M, K), dtype, device)
    b = make((K, N), dtype, device)
    bias = torch.randn(N, device=device).to(dtype) if with_bias else None
    out = onegemm.persistent_matmul(a, b, bias=bias, activation=activation, num_programs=3)
    assert_close(out, matmul_ref(a, b, bias, activation), tol_for(dtype))


def test_persistent_strided_bias_and_k_zero(device):
    a = make((20, 40), torch.float32, device)
    b = make((40, 30), torch.float32, device)
    bias = torch.randn(30, 2, device=device)[:, 1]  # stride 2
    out = onegemm.persistent_matmul(a, b, bias=bias, activation="relu", num_programs=2)
    assert_close(out, matmul_ref(a, b, bias, "relu"), TOL[torch.float32])
    a0, b0 = torch.randn(6, 0, device=device), torch.randn(0, 9, device=device)
    out = onegemm.persistent_matmul(a0, b0, bias=bias[:9], activation="silu")
    assert_close(out, matmul_ref(a0, b0, bias[:9], "silu"), TOL[torch.float32])


@pytest.mark.parametrize("M,N,K", [(0, 5, 7), (5, 0, 7), (0, 0, 0)])
def test_persistent_empty_output(M, N, K, device):
    out = onegemm.persistent_matmul(torch.randn(M, K, device=device), torch.randn(K, N, device=device))
    assert out.shape == (M, N)


@pytest.fixture
def launched(monkeypatch):
    """(grid, plan) of each matmul_kernel launch in the test."""
    seen = []
    launch = MATMUL.launch

    def spy(plan, grid, args):
        seen.append((grid, plan))
        return launch(plan, grid, args)

    monkeypatch.setattr(MATMUL, "launch", spy)
    return seen


@pytest.fixture
def launched_grids(launched):
    """The grid of each matmul_kernel launch in the test, as the op computes it from the plan."""
    class Grids:
        def __eq__(self, other):
            return [g for g, _ in launched] == other

        def __repr__(self):
            return repr([g for g, _ in launched])

    return Grids()


@pytest.mark.parametrize("num_programs,want", [(1, 1), (3, 3), (12, 12), (13, 12), (10**6, 12)])
def test_grid_is_min_of_programs_and_tiles(num_programs, want, launched_grids, device):
    """The launched grid is min(num_programs, tiles): 96 x 128 with 32 x 32 tiles is 12 tiles."""
    cfg = _cfg(32, 32, 32, 4, 2, group_m=2)
    a = make((96, 64), torch.float32, device)
    b = make((64, 128), torch.float32, device)
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs, config=cfg)
    assert launched_grids == [(want,)]
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])


@pytest.mark.parametrize("M", [7 * 32, 5 * 32 + 3])
@pytest.mark.parametrize("num_programs", [3, 5])
def test_persistent_short_last_group(M, num_programs, device):
    """num_pid_m % GROUP_M != 0 and a program count that divides neither the tile count nor a
    group: the strided walk over grouped tile ids must still cover every tile."""
    a = make((M, 50), torch.float32, device)
    b = make((50, 100), torch.float32, device)
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs, config=INTERPRET_CONFIG)
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])


@pytest.mark.parametrize("num_programs", [1, 3, 10**6])
@pytest.mark.parametrize("M,N,K,split,dtype,layout_a,layout_b,tma,activation", SPLIT_CASES)
def test_persistent_split_k(M, N, K, split, dtype, layout_a, layout_b, tma, activation, num_programs, device):
    """core's split-K cases with the persistent walk over (tile, split) units: one program
    running every split of every tile in turn, fewer programs than one tile's splits, and one
    program per unit."""
    a = make((M, K), dtype, device, layout_a)
    b = make((K, N), dtype, device, layout_b)
    bias = torch.randn(N, device=device)
    out = onegemm.persistent_matmul(a, b, bias=bias, activation=activation, num_programs=num_programs,
                                    config=split_cfg(split, dtype), tma=tma)
    assert_close(out, matmul_ref(a, b, bias, activation), tol_for(dtype))


def test_persistent_grid_counts_split_units(launched_grids, device):
    """With SPLIT_K the grid is min(num_programs, tiles * SPLIT_K): 96 x 128 with 32 x 32 tiles
    and 3 splits is 36 units."""
    cfg = split_cfg(3)
    a = make((96, 64), torch.float32, device)
    b = make((64, 128), torch.float32, device)
    tiles = triton.cdiv(96, cfg.kwargs["BLOCK_M"]) * triton.cdiv(128, cfg.kwargs["BLOCK_N"])
    for programs in (5, 10**6):
        out = onegemm.persistent_matmul(a, b, num_programs=programs, config=cfg)
        assert_close(out, matmul_ref(a, b), TOL[torch.float32])
    assert launched_grids == [(5,), (tiles * 3,)]


@pytest.mark.parametrize("num_programs,per_sm", [(None, 1), (None, 2), (3, 2)])
def test_programs_per_sm_sizes_the_default_grid(num_programs, per_sm, launched_grids, device):
    """A config's PROGRAMS_PER_SM multiplies the default grid (SM count; INTERPRET_PROGRAMS
    here) and leaves an explicit num_programs alone; 320 x 256 in 32 x 32 tiles is 80 tiles,
    more than either grid."""
    cfg = _cfg(32, 32, 32, 4, 2, group_m=2) if onegemm.INTERPRET else _cfg(64, 64, 64, 4, 5)
    cfg = with_meta(cfg, PROGRAMS_PER_SM=per_sm)
    a = make((320, 64), torch.float32, device)
    b = make((64, 256), torch.float32, device)
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs, config=cfg)
    default = default_programs(a.device.index)
    tiles = triton.cdiv(320, cfg.kwargs["BLOCK_M"]) * triton.cdiv(256, cfg.kwargs["BLOCK_N"])
    assert launched_grids == [(min(tiles, 3 if num_programs else default * per_sm),)]
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])


def test_two_per_sm_only_for_small_tiles():
    """Two programs per SM only where two pipelines fit in shared memory (64-row tiles up to
    128 wide), and every tuned split config keeps its split."""
    extra = [c for c in PERSISTENT_CONFIGS if c.kwargs.get("PROGRAMS_PER_SM", 1) == 2]
    assert extra and all(c.kwargs["BLOCK_M"] == 64 and c.kwargs["BLOCK_N"] <= 128 for c in extra)
    assert {c.kwargs.get("SPLIT_K", 1) for c in extra} == {1, 2, 4, 8}


# ---- matmul's schedule knob (persistent=None / False / True) ----

# 512 x 384 in 32 x 32 tiles: 192 tiles, more than one program per SM on the H200 (132) or
# under the interpreter (INTERPRET_PROGRAMS), so the two schedules launch different grids.
SCHEDULE_CASES = [
    # (the config's own PERSISTENT, matmul's persistent=, whether the launch is persistent)
    (None, None, False),
    (None, False, False),
    (None, True, True),
    (True, None, True),   # a config tuned persistent (a table entry) keeps its schedule
    (True, False, False),
    (False, True, True),
]


@pytest.mark.parametrize("cfg_persistent,persistent,want_persistent", SCHEDULE_CASES)
def test_matmul_schedule_knob(cfg_persistent, persistent, want_persistent, launched_grids, device):
    cfg = _cfg(32, 32, 32, 4, 2, group_m=2)
    if cfg_persistent is not None:
        cfg = with_meta(cfg, PERSISTENT=cfg_persistent)
    a = make((512, 96), torch.float32, device)
    b = make((96, 384), torch.float32, device, "transposed")
    out = onegemm.matmul(a, b, config=cfg, persistent=persistent)
    tiles = 16 * 12
    assert launched_grids == [(min(default_programs(a.device.index), tiles) if want_persistent else tiles,)]
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])


@pytest.mark.parametrize("persistent", [None, False, True])
def test_matmul_schedule_knob_unforced(persistent, launched, launched_grids, device):
    """Without a config: on the H200 the config chosen (table or heuristic) is on a schedule the
    call allows; the interpreter runs its one config launch-per-tile unless persistent=True."""
    a = make((200, 64), torch.bfloat16, device)
    b = make((64, 72), torch.bfloat16, device)
    out = onegemm.matmul(a, b, persistent=persistent)
    assert_close(out, matmul_ref(a, b), TOL[torch.bfloat16])
    if onegemm.INTERPRET:
        bm, bn = INTERPRET_CONFIG.kwargs["BLOCK_M"], INTERPRET_CONFIG.kwargs["BLOCK_N"]
        tiles = triton.cdiv(200, bm) * triton.cdiv(72, bn)
        assert launched_grids == [(min(default_programs(a.device.index), tiles) if persistent else tiles,)]
    elif persistent is not None:
        (_, plan), = launched
        assert plan.meta["PERSISTENT"] == persistent


def _pruned(dtype, M, schedule):
    """What autotuning would time for a [M, 4096] @ [4096, 4096] call of ``dtype``, TMA allowed."""
    key = configs.MatmulKey(configs.dtype_name(dtype), configs.m_bucket(M), 4096, 4096, True, True, configs.EITHER, schedule, 0)
    return configs.matmul_candidates(key, 132)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_schedule_pruning(dtype):
    """Launch-per-tile keeps no persistent config, persistent keeps only those (two per SM
    included), and automatic scheduling adds just the big persistent tiles to launch-per-tile,
    and none at decode sizes, where 64-row tiles are all that is tuned."""
    def persistent(configs):
        return [c for c in configs if c.kwargs.get("PERSISTENT")]

    bk = 64 if dtype == torch.bfloat16 else 128
    per_tile = _pruned(dtype, 4096, PER_TILE)
    assert per_tile and not persistent(per_tile)
    only = _pruned(dtype, 4096, PERSISTENT_ONLY)
    assert only == persistent(only) and any(c.kwargs.get("PROGRAMS_PER_SM") == 2 for c in only)
    auto = _pruned(dtype, 4096, ANY_SCHEDULE)
    assert [c for c in auto if not c.kwargs.get("PERSISTENT")] == per_tile
    tiles = sorted((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["USE_TMA"]) for c in persistent(auto))
    assert tiles == sorted((m, n, bk, tma) for m, n in ((128, 256), (256, 128)) for tma in (False, True))
    assert not persistent(_pruned(dtype, 16, ANY_SCHEDULE))


def test_matmul_bad_schedule(device):
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 8, device=device)
    with pytest.raises(TypeError, match="persistent must be None"):
        onegemm.matmul(a, b, persistent="yes")


# ---- TMA flavour. Under the interpreter it runs when forced (tma=True). ----

# Shapes whose row lengths are multiples of 16 bytes for every dtype (TMA-eligible whether an
# operand is row- or column-major), with partial tiles on every edge (32 x 32 x 32 here).
TMA_SHAPES = [(80, 48, 96), (16, 112, 48), (48, 64, 16)]
TMA_LAYOUTS = [("contig", "contig"), ("transposed", "contig"), ("contig", "transposed"), ("transposed", "transposed")]


@pytest.mark.parametrize("op", ["persistent", "matmul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout_a,layout_b", TMA_LAYOUTS)
def test_tma_flavour_layouts_and_dtypes(op, dtype, layout_a, layout_b, device):
    M, N, K = TMA_SHAPES[0]
    a = make((M, K), dtype, device, layout_a)
    b = make((K, N), dtype, device, layout_b)
    c_like = torch.empty(M, N, device=device, dtype=torch.bfloat16 if dtype in FP8 else dtype)
    layout = core_tma.tma_layout(a, b, c_like)
    assert layout == (layout_a == "contig", layout_b == "transposed")
    fn = onegemm.persistent_matmul if op == "persistent" else onegemm.matmul
    kwargs = dict(num_programs=3) if op == "persistent" else {}
    bias = torch.randn(N, device=device)
    out = fn(a, b, bias=bias, activation="gelu", tma=True, **kwargs)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), tol_for(dtype))


@pytest.mark.parametrize("M,N,K", TMA_SHAPES)
@pytest.mark.parametrize("epi_split,flatten", [(1, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize("num_programs", [1, 3, 10**6])
@pytest.mark.parametrize("split_k", [1, 3])
def test_tma_epilogue_split_and_flatten(M, N, K, epi_split, flatten, num_programs, split_k, device):
    """The options the benchmark sweeps: two half-width TMA stores, and the flattened loop;
    with and without split-K (its partial-sum combine then runs inside the flattened loop, and
    the 1-3 K blocks of these shapes leave some of the 3 splits empty)."""
    a = make((M, K), torch.bfloat16, device)
    b = make((N, K), torch.bfloat16, device).t()
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    if device == "cuda":
        cfg = _cfg(128, 128, 64, 8, 3)
    else:
        cfg = INTERPRET_CONFIG
    cfg = with_meta(cfg, EPI_SPLIT=epi_split, FLATTEN=flatten, SPLIT_K=split_k)
    out = onegemm.persistent_matmul(a, b, bias=bias, activation="gelu", num_programs=num_programs, config=cfg, tma=True)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.bfloat16])


def _views(device, dtype=torch.bfloat16):
    """(name, a, b, TMA-eligible?) for C = a @ b with M = 64, K = 96, N = 80."""
    M, K, N = 64, 96, 80
    big = torch.randn(M + 1, K + 8, device=device).to(dtype)
    b = torch.randn(K, N, device=device).to(dtype)
    return [
        ("contiguous", torch.randn(M, K, device=device).to(dtype), b, True),
        ("odd element offset (base not 16-byte aligned)", big[1:, 1 : K + 1], b, False),
        ("row stride of K + 8 elements (16-byte multiple)", big[:M, :K], b, True),
        ("odd row stride (K + 1)", torch.randn(M, K + 1, device=device).to(dtype)[:, :K], b, False),
        ("strided in both dims", torch.randn(2 * M, 2 * K, device=device).to(dtype)[::2, ::2], b, False),
        ("transposed a (column-major)", torch.randn(K, M, device=device).to(dtype).t(), b, True),
        ("transposed a with an odd leading dim", torch.randn(K, M + 1, device=device).to(dtype)[:, 1:].t(), b, False),
        ("b = W.t() (K-major)", big[:M, :K], torch.randn(N, K, device=device).to(dtype).t(), True),
        ("b sliced at an odd column", big[:M, :K], torch.randn(K, N + 1, device=device).to(dtype)[:, 1:], False),
    ]


@pytest.mark.parametrize("case", range(9))
@pytest.mark.parametrize("op", ["persistent", "matmul"])
def test_tma_eligibility_and_automatic_fallback(case, op, device):
    """Ineligible views are detected, and tma=None gives the right answer for every view (on
    a GPU: TMA where eligible, pointer loads otherwise; on the interpreter: pointer loads)."""
    name, a, b, eligible = _views(device)[case]
    c_like = torch.empty(a.shape[0], b.shape[1], device=device, dtype=a.dtype)
    assert (core_tma.tma_layout(a, b, c_like) is not None) == eligible, name
    fn = onegemm.persistent_matmul if op == "persistent" else onegemm.matmul
    assert_close(fn(a, b, activation="silu"), matmul_ref(a, b, None, "silu"), TOL[torch.bfloat16], name)
    if eligible:
        assert_close(fn(a, b, tma=True), matmul_ref(a, b), TOL[torch.bfloat16], name)
    else:
        with pytest.raises(ValueError, match="tma must be None .automatic. or False for these operands"):
            fn(a, b, tma=True)


def test_matmul_config_names_its_flavour(device):
    """matmul with a config that carries USE_TMA (as table entries do): True runs the TMA
    flavour, and is refused on a view TMA cannot read (an odd column offset)."""
    a = make((40, 64), torch.bfloat16, device)
    b = make((64, 48), torch.bfloat16, device)
    cfg = with_meta(INTERPRET_CONFIG, USE_TMA=True)
    assert_close(onegemm.matmul(a, b, config=cfg, tma=True), matmul_ref(a, b), TOL[torch.bfloat16])
    odd = make((40, 65), torch.bfloat16, device)[:, 1:]
    with pytest.raises(ValueError, match="config must be free of USE_TMA=True"):
        onegemm.matmul(odd, b, config=cfg)


@pytest.mark.parametrize("op", ["persistent", "matmul"])
def test_warp_specialize_switch(op, device):
    """A config with WARP_SPECIALIZE reaches core's K loop in both schedules and gives the same
    product (the interpreter runs the loop as written; the H200 compiles it warp-specialised)."""
    a = make((70, 96), torch.bfloat16, device)
    b = make((80, 96), torch.bfloat16, device).t()
    base = _cfg(128, 128, 64, 4, 4) if not onegemm.INTERPRET else INTERPRET_CONFIG
    fn = onegemm.persistent_matmul if op == "persistent" else onegemm.matmul
    bias = torch.randn(80, device=device, dtype=torch.bfloat16)
    out = fn(a, b, bias=bias, activation="silu", config=warp_specialized(base), tma=True)
    assert_close(out, matmul_ref(a, b, bias, "silu"), TOL[torch.bfloat16])


def test_tma_output_row_not_16_byte_multiple(device):
    """N = 17 fp16: the output's rows are 34 bytes, so C cannot take a descriptor."""
    a = make((32, 64), torch.float16, device)
    b = make((64, 17), torch.float16, device, "transposed")
    with pytest.raises(ValueError, match="output"):
        onegemm.persistent_matmul(a, b, tma=True)
    assert_close(onegemm.persistent_matmul(a, b), matmul_ref(a, b), TOL[torch.float16])


# ---- bad input ----


@pytest.mark.parametrize("case", range(12))
def test_persistent_bad_input_like_matmul(case, device):
    match, kwargs, exc = _bad_cases(device)[case]
    with pytest.raises(exc, match=match):
        onegemm.persistent_matmul(**kwargs)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_programs=0), ValueError, "num_programs must be an int >= 1"),
        (dict(num_programs=-3), ValueError, "num_programs must be an int >= 1"),
        (dict(num_programs=2.5), TypeError, "num_programs must be an int"),
        (dict(num_programs=True), TypeError, "num_programs must be an int"),
        (dict(tma="yes"), TypeError, "tma must be None"),
    ],
)
def test_persistent_bad_options(kwargs, exc, match, device):
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 8, device=device)
    with pytest.raises(exc, match=match):
        onegemm.persistent_matmul(a, b, **kwargs)


# ---- GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (300, 1000, 512), (896, 4864, 4096), (4096, 4096, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_gpu_autotuned_large(M, N, K, dtype, tma, device):
    """Autotuned (every surviving config launched), one program per SM, both flavours;
    896 x 4864 is 133 tiles of 128 x 256 (one past a wave)."""
    a = make((M, K), dtype, device)
    b = make((N, K), dtype, device).t()
    out = onegemm.persistent_matmul(a, b, tma=tma)
    assert_close(out, matmul_ref(a, b), tol_for(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("num_programs", [1, 7, 131, 133, 1000])
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_program_counts(num_programs, tma, device):
    """Grid sizes below, around and above the SM count on 133 tiles (a forced config keeps the
    autotuner, which is keyed on the program count, out of it)."""
    a = make((896, 4096), torch.bfloat16, device)
    b = make((4864, 4096), torch.bfloat16, device).t()
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs, tma=tma, config=_cfg(128, 256, 64, 8, 3))
    assert_close(out, matmul_ref(a, b), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("cfg", PERSISTENT_CONFIGS, ids=lambda c: str(c).replace(" ", ""))
def test_gpu_every_config(cfg, tma, device):
    """Each Hopper config, forced, with partial tiles on every edge (TMA needs the 16-byte
    multiple row lengths: K = 784 and N = 560); the split configs' 64-row tiles make 54 x
    SPLIT_K units, more than one pass of 132 programs (or 264 at two per SM). Launch-per-tile
    (persistent=False) runs each tile but the two-per-SM ones, which only a persistent grid reads."""
    dtype = torch.float8_e4m3fn if cfg.kwargs["BLOCK_K"] == 128 else torch.bfloat16
    a = make((333, 784), dtype, device)
    b = make((560, 784), dtype, device).t()
    bias = torch.randn(560, device=device, dtype=torch.bfloat16)
    out = onegemm.persistent_matmul(a, b, bias=bias, activation="gelu", config=cfg, tma=tma)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.bfloat16])
    if "PROGRAMS_PER_SM" not in cfg.kwargs:
        out = onegemm.matmul(a, b, bias=bias, activation="gelu", config=cfg, tma=tma, persistent=False)
        assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("layout_a,layout_b", TMA_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_gpu_tma_orientations(layout_a, layout_b, dtype, device):
    """Column-major A and row-major B are read through transposed descriptors."""
    a = make((1008, 2048), dtype, device, layout_a)  # 1008: partial tiles, and 16-byte rows in fp8
    b = make((2048, 1536), dtype, device, layout_b)
    for fn in (onegemm.persistent_matmul, onegemm.matmul):
        assert_close(fn(a, b, tma=True), matmul_ref(a, b), tol_for(dtype))


@pytest.mark.gpu
def test_gpu_from_a_new_thread(device):
    """triton.set_allocator is per thread (a ContextVar): the TMA flavour in a fresh thread
    must set it there, or the launch fails with 'no allocator was set'."""
    a = make((512, 1024), torch.bfloat16, device)
    b = make((1024, 768), torch.bfloat16, device)
    results, errors = {}, []

    def work():
        try:
            results["persistent"] = onegemm.persistent_matmul(a, b, tma=True)
            results["matmul"] = onegemm.matmul(a, b, tma=True)
            torch.cuda.synchronize()
        except Exception as e:  # re-raised in the main thread below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    for name, out in results.items():
        assert_close(out, matmul_ref(a, b), TOL[torch.bfloat16], name)


@pytest.mark.gpu
def test_gpu_int64_offsets(device):
    """A [M, K] with M * K > 2^31 elements, both flavours (TMA coordinates are row indices,
    the pointer flavour's offsets need int64)."""
    M, K, N = 2**31 // 512 + 4096, 512, 64
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
    tail = slice(M - 3000, M)
    for tma in (False, True):
        out = onegemm.persistent_matmul(a, b, tma=tma)
        assert_close(out[tail], matmul_ref(a[tail], b), TOL[torch.bfloat16], f"tma={tma}")
        del out
    del a
    torch.cuda.empty_cache()
