"""What only the persistent schedule has: its grid size, two programs per SM, matmul's
schedule knob and its pruning, persistent_matmul's own options; against float64 torch.

matmul's contract itself (shapes, layouts, dtypes, the epilogue, split-K, bad input) runs on
both schedules in tests/test_core.py, and the TMA flavour in tests/test_tma.py.
"""

import pytest
import torch
import triton

import onegemm
from onegemm.core import configs, launch
from onegemm.core.configs import ANY_SCHEDULE, PER_TILE, PERSISTENT_CONFIGS, PERSISTENT_ONLY, with_meta
from onegemm.core.configs import MATMUL_INTERPRET as INTERPRET_CONFIG
from onegemm.core.configs import cfg as _cfg
from onegemm.core.runtime import default_programs
from onegemm.testing import TOL, assert_close, matmul_ref

from helpers import make, split_cfg, tol_for


class _MatmulLaunches:
    """A live view of a recording: (grid, plan) of each matmul_kernel launch so far."""

    def __init__(self, every):
        self.every = every

    def __iter__(self):
        return iter([(x.grid, x.plan) for x in self.every if x.family == "matmul"])


@pytest.fixture
def launched():
    """(grid, plan) of each matmul_kernel launch in the test."""
    with launch.recording() as every:
        yield _MatmulLaunches(every)


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


@pytest.mark.parametrize("num_programs,loops", [(5, True), (11, True), (12, False), (40, False)])
def test_one_unit_per_program_runs_the_per_tile_kernel(num_programs, loops, launched, device):
    """With no more units than programs each program has one unit: the launch runs
    launch-per-tile's kernel (the same schedule without the unit loop) on one program per
    unit; with more, the persistent walk. 96 x 128 in 32 x 32 tiles is 12 units."""
    cfg = _cfg(32, 32, 32, 4, 2, group_m=2)
    a = make((96, 64), torch.float32, device)
    b = make((64, 128), torch.float32, device)
    for _ in range(3):  # the record's later calls (core/dispatch.py Launch) launch the same plan
        out = onegemm.persistent_matmul(a, b, num_programs=num_programs, config=cfg)
        assert_close(out, matmul_ref(a, b), TOL[torch.float32])
    got = onegemm.matmul(a, b, persistent=True, config=cfg)
    assert_close(got, matmul_ref(a, b), TOL[torch.float32])
    assert [(g, p.meta["PERSISTENT"]) for g, p in launched][:3] == [((min(num_programs, 12),), loops)] * 3


@pytest.mark.parametrize("M", [7 * 32, 5 * 32 + 3])
@pytest.mark.parametrize("num_programs", [3, 5])
def test_persistent_short_last_group(M, num_programs, device):
    """num_pid_m % GROUP_M != 0 and a program count that divides neither the tile count nor a
    group: the strided walk over grouped tile ids must still cover every tile."""
    a = make((M, 50), torch.float32, device)
    b = make((50, 100), torch.float32, device)
    out = onegemm.persistent_matmul(a, b, num_programs=num_programs, config=INTERPRET_CONFIG)
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])


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
    # More tiles than programs of a persistent grid (4 interpreted, one per SM on a GPU), so
    # the two schedules launch different grids; 136 columns leave a partial column block.
    M, N = (160, 136) if onegemm.INTERPRET else (512, 392)
    a = make((M, 96), torch.float32, device)
    b = make((96, N), torch.float32, device, "transposed")
    out = onegemm.matmul(a, b, config=cfg, persistent=persistent)
    tiles = triton.cdiv(M, 32) * triton.cdiv(N, 32)
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
        (grid, plan), = launched
        units = (triton.cdiv(200, plan.meta["BLOCK_M"]) * triton.cdiv(72, plan.meta["BLOCK_N"])
                 * plan.meta.get("SPLIT_K", 1))
        # persistent=True with one unit per program runs launch-per-tile's kernel (same schedule)
        assert plan.meta["PERSISTENT"] == (persistent and grid[0] < units)


def _pruned(dtype, M, schedule):
    """What autotuning would time for a [M, 4096] @ [4096, 4096] call of ``dtype``, TMA allowed."""
    key = configs.MatmulKey(configs.dtype_name(dtype), configs.m_bucket(M), 4096, 4096, True, True, configs.EITHER, schedule, 0)
    return configs.matmul_candidates(key, 132)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_schedule_pruning(dtype):
    """Launch-per-tile keeps no persistent config, persistent keeps only those (two per SM
    included), and automatic scheduling adds just the big persistent tiles (whole-tile and
    stream-K walks) to launch-per-tile,
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
    tiles = sorted((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["USE_TMA"],
                    c.kwargs.get("STREAM_K", False)) for c in persistent(auto))
    assert tiles == sorted((m, n, bk, tma, sk) for m, n in ((128, 256), (256, 128)) for tma in (False, True)
                           for sk in (False, True))
    assert not persistent(_pruned(dtype, 16, ANY_SCHEDULE))


def test_matmul_bad_schedule(device):
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 8, device=device)
    with pytest.raises(TypeError, match="persistent must be None"):
        onegemm.matmul(a, b, persistent="yes")


# ---- bad input ----


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


# (M, N, K, num_programs, a transposed): 32 x 32 interpreter tiles, so 96 x 128 is 12 tiles.
STREAM_K_CASES = [
    (96, 128, 160, 5, False),   # 12 tiles on 5: 7 shared (the partial wave and one full), 5 whole
    (96, 128, 160, 30, True),   # fewer tiles than programs: all shared, 2 K blocks per program
    (33, 70, 300, 13, False),   # partial tiles on both edges, 6 tiles shared by 13
    (300, 17, 127, 7, True),    # 10 tiles, every one shared; K not a multiple of BLOCK_K
    (1, 17, 127, 3, False),     # one tile cut in three
]


@pytest.mark.parametrize("M,N,K,programs,a_t", STREAM_K_CASES)
def test_stream_k(M, N, K, programs, a_t, launched, device):
    """The stream-K walk (STREAM_K): tiles shared out by K blocks, some parts starting and
    ending inside a tile, against float64 with the epilogue; twice, so the tile counters
    must come back to zero; a transposed a view."""
    cfg = with_meta(INTERPRET_CONFIG if onegemm.INTERPRET else _cfg(32, 32, 32, 4, 2), PERSISTENT=True, STREAM_K=True)
    tiles = triton.cdiv(M, 32) * triton.cdiv(N, 32)
    assert configs.stream_k_tiles(tiles, programs, triton.cdiv(K, 32)) > 0  # the case shares tiles
    a = make((K, M), torch.float32, device).t() if a_t else make((M, K), torch.float32, device)
    b = make((N, K), torch.float32, device).t()
    bias = torch.randn(N, device=device)
    for _ in range(2):
        out = onegemm.persistent_matmul(a, b, bias=bias, activation="gelu", num_programs=programs, config=cfg)
        assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.float32])
    assert [g for g, _ in launched] == [(programs,)] * 2


def test_stream_k_without_shared_tiles_runs_the_plain_walk(launched, device):
    """A stream-K config on a shape with no tile to share (12 tiles on 7 programs: the last
    wave is over half full) launches the plain persistent walk of the same config."""
    cfg = with_meta(INTERPRET_CONFIG if onegemm.INTERPRET else _cfg(32, 32, 32, 4, 2), PERSISTENT=True, STREAM_K=True)
    a = make((96, 160), torch.float32, device)
    b = make((128, 160), torch.float32, device).t()
    out = onegemm.persistent_matmul(a, b, num_programs=7, config=cfg)
    assert_close(out, matmul_ref(a, b), TOL[torch.float32])
    assert [(g, p.meta["STREAM_K"], p.meta["PERSISTENT"], p.source) for g, p in launched] == [((7,), False, True, "forced")]


@pytest.mark.parametrize("tiles,programs,k_blocks,want", [
    (133, 132, 64, 133),   # one tile past a wave: it and the wave before it
    (265, 132, 64, 133),   # two waves and one tile: the last full wave and the tile
    (200, 132, 64, 0),     # the last wave over half full: whole tiles only
    (264, 132, 64, 0),     # exact waves
    (40, 132, 64, 40),     # fewer tiles than programs: all shared
    (40, 132, 3, 0),       # ... but fewer K blocks than programs: none
    (133, 132, 1, 0),      # one K block per tile: nothing to share
])
def test_stream_k_tiles_policy(tiles, programs, k_blocks, want):
    assert configs.stream_k_tiles(tiles, programs, k_blocks) == want


@pytest.mark.parametrize("kwargs", [dict(persistent=False), dict(split=2)])
def test_stream_k_bad_config(kwargs, device):
    cfg = with_meta(INTERPRET_CONFIG, PERSISTENT=True, STREAM_K=True)
    if kwargs.pop("split", None):
        cfg = with_meta(cfg, SPLIT_K=2)
    a = make((64, 64), torch.float32, device)
    with pytest.raises(ValueError, match="config must be persistent and unsplit with STREAM_K"):
        onegemm.matmul(a, a, config=cfg, **kwargs)


# ---- GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 4096), (300, 1000, 512), (896, 4864, 4096), (4096, 4096, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_gpu_chosen_config_large(M, N, K, dtype, tma, device):
    """The config the shipped table or the heuristic chooses, one program per SM, both flavours;
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
    if "PROGRAMS_PER_SM" not in cfg.kwargs and "STREAM_K" not in cfg.kwargs:
        out = onegemm.matmul(a, b, bias=bias, activation="gelu", config=cfg, tma=tma, persistent=False)
        assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("M,N,K", [(896, 4864, 4096), (640, 13568, 4096), (1000, 1000, 3072)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_gpu_stream_k(M, N, K, dtype, tma, device):
    """The stream-K configs on shapes one tile past a wave of 128 x 256 tiles (133 and 265
    tiles; 1000^2 is 32 tiles, all shared; K = 3072 keeps fp8 rows 16-byte aligned for TMA), where they share tiles out by K blocks."""
    a = make((M, K), dtype, device)
    b = make((N, K), dtype, device).t()
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    for c in PERSISTENT_CONFIGS:
        if c.kwargs.get("STREAM_K") and c.kwargs["BLOCK_K"] == (128 if dtype.itemsize == 1 else 64):
            tiles = triton.cdiv(M, c.kwargs["BLOCK_M"]) * triton.cdiv(N, c.kwargs["BLOCK_N"])
            out = onegemm.persistent_matmul(a, b, bias=bias, activation="gelu", config=c, tma=tma)
            assert_close(out, matmul_ref(a, b, bias, "gelu"), tol_for(dtype), f"{configs.label(c)} {tiles} tiles")


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
