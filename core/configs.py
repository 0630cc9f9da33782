"""What runs for a shape: the tuning mechanism, and core's own families' policy.

The mechanism every family uses: config builders (``cfg``, ``with_meta``, ``flavoured``),
split-K rules, ``Family`` and the ``FAMILIES`` registry. core's policy: the dense kernel's
family ("matmul"); the Gluon FP8 body's ("blockscaled_wgmma") sits beside it in
core/hopper_configs.py. Each package keeps its own
families' policy beside its ops and registers them: grouped/configs.py (ragged, list, sort,
route and the MoE helpers), blockscaled/configs.py (the Triton body's fp8 tiles, the
quantisers, the transpose). For each call the launcher (core/launch.py) asks, in order, for

the config the caller forced (``config=``); a tuned config for the call's key (the table
shipped for this GPU, core/tuned/<GPU>.json, or the user's tuning cache); with autotuning on,
the fastest of ``candidates(key)`` in GPU time (then cached); else ``heuristic(key)``, at once.
Under Triton's interpreter every family runs its one small ``interpret`` config.

A key is a NamedTuple of what the choice depends on (dtype, M bucket, N, K, layout, the load
flavours and schedules the call allows); its ``str`` names it in the tables. A config is a
``triton.Config`` of the kernel's tile constexprs plus the options a family takes (USE_TMA,
PERSISTENT, PROGRAMS_PER_SM, SPLIT_K, WARP_SPECIALIZE). docs/tuning.md says how these choices
were measured.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from . import checks, triton_abi
from .runtime import cdiv, next_pow2

# ---------------------------------------------------------------------------- helpers


def cfg(bm, bn, bk, warps, stages, group_m=8, **extra) -> triton.Config:
    """A tile config: BLOCK_M x BLOCK_N x BLOCK_K, warps, pipeline stages, GROUP_M, options."""
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, **extra},
        num_warps=warps, num_stages=stages,
    )


def with_meta(c: triton.Config, **kwargs) -> triton.Config:
    """``c`` with ``kwargs`` added to (or replacing) its constexprs."""
    return triton.Config({**c.kwargs, **kwargs}, num_warps=c.num_warps, num_stages=c.num_stages)


def warp_specialized(c, **extra):
    """``c`` with core's warp-specialised K loop on (a TMA producer and two consumer
    warpgroups; tiles.mma_k_loop honours it only with TMA loads)."""
    return with_meta(c, WARP_SPECIALIZE=True, **extra)


def config_id(c: triton.Config) -> tuple:
    """A hashable identity of a config (triton.Config hashes by object)."""
    return (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages, c.num_ctas, c.maxnreg)


def to_json(c: triton.Config) -> dict:
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def from_json(d: dict) -> triton.Config:
    d = dict(d)
    warps, stages = d.pop("num_warps"), d.pop("num_stages")
    return triton.Config(d, num_warps=warps, num_stages=stages)


def label(c: triton.Config) -> str:
    """A config as tables print it, e.g. '128x256x64 w8 s3 pers TMA'."""
    k = c.kwargs
    tile = f"{k['BLOCK_M']}x{k.get('BLOCK_N', '-')}x{k['BLOCK_K']} " if "BLOCK_M" in k and "BLOCK_K" in k else ""
    if "K_GROUP" in k:  # the Gluon body's (core/hopper_fp8.py): its ring depth and K unroll
        regs = f" r{k['CONSUMER_REGS']}/{k['LOADER_REGS']}" if "LOADER_REGS" in k else ""  # a register split of its own
        return f"{tile}s{k['STAGES']} kg{k['K_GROUP']}{' pingpong' if k.get('PINGPONG') else ''}{regs} gluon"
    text = f"{tile}w{c.num_warps} s{c.num_stages}"
    for flag, name in (("WARP_SPECIALIZE", "WS"), ("PERSISTENT", "pers"), ("STREAM_K", "streamK")):
        if k.get(flag):
            text += f" {name}"
    if k.get("SPLIT_K", 1) > 1:
        text += f" splitK{k['SPLIT_K']}"
    if k.get("PROGRAMS_PER_SM", 1) > 1:
        text += f" {k['PROGRAMS_PER_SM']}/SM"
    if "USE_TMA" in k:
        text += " TMA" if k["USE_TMA"] else " ptr"
    return text


_BUCKET_CAP = 32768


def m_bucket(n: int, cap: int = _BUCKET_CAP) -> int:
    """A token-count dimension's key: its next power of two (capped). Decode and MoE calls see
    a new M on every step; tiles that suit M = 3000 suit 4096 too."""
    return min(next_pow2(int(n)), cap)


def bucket_floor(n: int, cap: int = _BUCKET_CAP) -> int:
    """The fewest rows of n's ``m_bucket`` (n itself past the cap): what a dispatch rule reads
    for M, so that its choice holds over the whole bucket, one compiled variant per key (the
    variants ``token_counts`` meets)."""
    if n > cap:
        return n
    top = m_bucket(n, cap)
    return top // 2 + 1 if top > 1 else top


def token_counts(max_tokens: int, multiples=(1,)) -> list[int]:
    """Token counts that between them meet every compiled variant a call of 1 to
    ``max_tokens`` tokens can: per ``m_bucket`` up to max_tokens' one, a count for each
    combination of the ``m_bucket`` and Triton's int class (core/triton_abi.py: 1, a multiple
    of 16, other) of t * m, m in ``multiples`` (the ints a call derives from t, such as
    t * top_k), the first met from the bucket's top down. What a warmup runs."""
    counts, top = [], 1
    while True:
        seen = set()
        for t in range(top, top // 2, -1):
            kind = tuple((triton_abi.int_class(t * m), m_bucket(t * m)) for m in multiples)
            if kind not in seen:
                seen.add(kind)
                counts.append(t)
        if top >= max_tokens or top >= _BUCKET_CAP:
            return sorted(counts)
        top *= 2


def dtype_name(dtype: torch.dtype) -> str:
    """The key's dtype: one name for both fp8 formats (their configs are the same)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


# One K step moves BLOCK_K * itemsize bytes per row: 128 bytes fill a TMA/wgmma swizzle row
# for 16-bit and fp8 inputs; fp32 takes 32 to keep shared memory in budget.
BLOCK_K = {"fp8": 128, "bf16": 64, "fp16": 64, "fp32": 32}


def tile_count(M: int, N: int, bm: int, bn: int) -> int:
    """Output tiles of bm x bn over an [M, N] output."""
    return cdiv(M, bm) * cdiv(N, bn)


# Load flavours a call allows (its key's ``tma``): tma=False or operands TMA cannot read ->
# pointers; tma=True -> TMA; tma=None on operands that allow it -> either.
POINTERS_ONLY, TMA_ONLY, EITHER = 0, 1, 2
# Schedules a call allows (matmul's ``persistent``): one program per tile, persistent, either.
PER_TILE, PERSISTENT_ONLY, ANY_SCHEDULE = 0, 1, 2


def flavour_mode(tma, eligible: bool) -> int:
    if not eligible:
        return POINTERS_ONLY
    return EITHER if tma is None else (TMA_ONLY if tma else POINTERS_ONLY)


def schedule_mode(persistent) -> int:
    checks.check_option("persistent", persistent)
    return ANY_SCHEDULE if persistent is None else (PERSISTENT_ONLY if persistent else PER_TILE)


def flavoured(configs, mode: int):
    """Each config once per load flavour the mode allows (USE_TMA set). Configs that already
    name a flavour (warp-specialised ones are TMA only) are kept when the mode allows it."""
    out = []
    for c in configs:
        if "USE_TMA" in c.kwargs:
            if mode == EITHER or c.kwargs["USE_TMA"] == (mode == TMA_ONLY):
                out.append(c)
            continue
        for t in ((False, True) if mode == EITHER else (mode == TMA_ONLY,)):
            out.append(with_meta(c, USE_TMA=t))
    return out


# ---------------------------------------------------------------------------- split-K

SPLITS = (2, 4, 8)
# Split-K's fp32 workspace is SPLIT_K x M x N; a tuning candidate may split while SPLIT_K x the
# M bucket stays within 512 rows (29 MB at N = 14336). Larger M fills the SMs without it.
WORKSPACE_ROWS = 512
# A split sums at least this many K blocks: shorter loops spend their time on the partials.
MIN_BLOCKS_PER_SPLIT = 8


def with_splits(configs, splits=SPLITS):
    return [with_meta(c, SPLIT_K=s) for c in configs for s in splits]


def split_of(c: triton.Config) -> int:
    return c.kwargs.get("SPLIT_K", 1)


def split_allowed(c: triton.Config, m: int) -> bool:
    return split_of(c) == 1 or split_of(c) * m <= WORKSPACE_ROWS


def fill_split(units: int, K: int, bk: int, sms: int) -> int:
    """The fewest splits (1, 2, 4, 8) that give the SMs a unit each, as far as K allows."""
    split = 1
    while units * split < sms and split < SPLITS[-1] and cdiv(K, bk) >= 2 * split * MIN_BLOCKS_PER_SPLIT:
        split *= 2
    return split


# ---------------------------------------------------------------------------- matmul family
# core's matmul_kernel: onegemm.matmul / linear / persistent_matmul.


class MatmulKey(NamedTuple):
    dtype: str      # dtype_name of a (and b)
    m: int          # m_bucket(M)
    n: int
    k: int
    a_k: bool       # a.stride(1) == 1 (K-contiguous rows)
    b_k: bool       # b.stride(0) == 1 (b = W.t(): K-major)
    tma: int        # flavour_mode
    schedule: int   # schedule_mode
    programs: int   # persistent_matmul's num_programs (0: the default grid)

    def __str__(self):
        return (f"{self.dtype} m={self.m} n={self.n} k={self.k} a_k={int(self.a_k)} b_k={int(self.b_k)} "
                f"tma={self.tma} sched={self.schedule} programs={self.programs}")


# Hopper configs: 128x256 / 256x128 tiles with 8 warps (two consumer warpgroups) are what wgmma
# needs near the bf16 peak; 128x128 and 64-row tiles cover small M and small N. BLOCK_K = 128
# rows are for fp8, 32 for fp32 (see BLOCK_K).
MATMUL_CONFIGS = [
    cfg(128, 256, 64, 8, 3),
    cfg(256, 128, 64, 8, 3),
    cfg(128, 128, 64, 8, 4),
    cfg(128, 128, 64, 4, 4),
    cfg(64, 256, 64, 4, 4),
    cfg(64, 128, 64, 4, 4),
    cfg(128, 64, 64, 4, 5),
    cfg(64, 64, 64, 4, 5),
    cfg(128, 256, 128, 8, 3),
    cfg(256, 128, 128, 8, 3),
    cfg(128, 128, 128, 8, 4),
    cfg(64, 128, 128, 4, 4),
    cfg(64, 64, 128, 4, 4),
    cfg(128, 128, 32, 4, 4),
    cfg(64, 64, 32, 4, 4),
]

# Warp-specialised (core's K loop as a TMA producer and two consumer warpgroups; TMA only).
# 4 warps: Triton 3.6 splits a 4-warp program's tile between the consumers.
WS_CONFIGS = [
    warp_specialized(cfg(128, 256, 64, 4, 3), USE_TMA=True),
    warp_specialized(cfg(256, 128, 64, 4, 3), USE_TMA=True),
    warp_specialized(cfg(128, 128, 64, 4, 4), USE_TMA=True),
]

# Split-K for small M: the 64-row tiles and a 128x128 one (which reads each weight tile once
# per 128 rows) with 2, 4 and 8 splits.
SPLIT_K_CONFIGS = with_splits([
    cfg(64, 64, 64, 4, 5),
    cfg(64, 128, 64, 4, 4),
    cfg(64, 64, 128, 4, 4),
    cfg(64, 128, 128, 4, 4),
    cfg(64, 64, 32, 4, 4),
    cfg(128, 128, 64, 4, 4),
])


# 16-bit tiles for small M with BLOCK_K = 128 and a deep ring (192 KB of shared memory): half
# the K steps of the 64-wide K block, each with twice the loads in flight.
DEEP_K_CONFIGS = [cfg(64, 64, 128, 4, 6), cfg(64, 64, 128, 4, 5)]
DEEP_K_CONFIGS += with_splits(DEEP_K_CONFIGS, (2, 4))


def as_persistent(configs, **extra):
    """``configs`` on the persistent schedule (PERSISTENT=True)."""
    return [with_meta(c, PERSISTENT=True, **extra) for c in configs]


def two_per_sm(configs):
    """The 64 x (64 or 128) tiles with two programs per SM: their pipelines (64-98 KB of shared
    memory) fit twice in an SM, and two resident programs hide each other's load latency."""
    small = [c for c in configs if c.kwargs["BLOCK_M"] == 64 and c.kwargs["BLOCK_N"] <= 128]
    return as_persistent(small, PROGRAMS_PER_SM=2)


def stream_k(configs):
    """``configs`` on the stream-K schedule (core/tiles.py ``stream_k``)."""
    return as_persistent(configs, STREAM_K=True)


def stream_k_tiles(tiles: int, programs: int, k_blocks: int) -> int:
    """How many of a stream-K launch's tiles its programs share out by K blocks: none when
    the last wave of whole tiles fills at least half the programs (its idle half costs less
    than the shared tiles' partial sums) or a tile has fewer than two K blocks; else that
    partial wave and the full one before it (all tiles when there are fewer than programs),
    so each program's run spans about one whole tile or more, instead of a sliver of the last.
    Every program must get at least one K block (tiles.stream_k counts a shared tile's parts
    by consecutive programs), so fewer blocks than programs is none too."""
    tail = tiles % programs
    if k_blocks < 2 or tail == 0 or 2 * tail >= programs:
        return 0
    shared = tail + programs if tiles > programs else tiles
    return shared if shared * k_blocks >= programs else 0


BIG_TILES = [c for c in MATMUL_CONFIGS if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] == 128 * 256]
PERSISTENT_CONFIGS = (as_persistent(MATMUL_CONFIGS + SPLIT_K_CONFIGS) + two_per_sm(MATMUL_CONFIGS + SPLIT_K_CONFIGS)
                      + stream_k(BIG_TILES + [c for c in MATMUL_CONFIGS if c.kwargs["BLOCK_M"] == c.kwargs["BLOCK_N"] == 128]))


def big_persistent(c: triton.Config) -> bool:
    """The persistent 128x256 / 256x128 tiles, one program per SM, unsplit (either walk: whole
    tiles, or stream-K): the only persistent configs matmul's automatic schedule tries (the
    smaller ones tie with launch-per-tile)."""
    k = c.kwargs
    return (k.get("PERSISTENT", False) and k["BLOCK_M"] * k["BLOCK_N"] == 128 * 256
            and split_of(c) == 1 and k.get("PROGRAMS_PER_SM", 1) == 1)


MATMUL_INTERPRET = cfg(32, 32, 32, 1, 1, group_m=4)


def matmul_candidates(key: MatmulKey, sms: int) -> list[triton.Config]:
    """What autotuning times for ``key``: the tiles for its dtype and M, the flavours and
    schedules the call allows; the heuristic's pick is always among them."""
    bk = BLOCK_K[key.dtype]
    pool = MATMUL_CONFIGS + SPLIT_K_CONFIGS + PERSISTENT_CONFIGS

    def few_tiles(c):  # a split that still leaves at most two units per SM
        return split_of(c) <= 4 and tile_count(key.m, key.n, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) * split_of(c) <= 2 * sms

    kept = [c for c in pool if c.kwargs["BLOCK_K"] == bk and (split_allowed(c, key.m) or few_tiles(c))]
    if key.m <= 64:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    if key.schedule == ANY_SCHEDULE:
        kept = [c for c in kept if not c.kwargs.get("PERSISTENT") or big_persistent(c)]
    else:
        kept = [c for c in kept if c.kwargs.get("PERSISTENT", False) == (key.schedule == PERSISTENT_ONLY)]
    kept = flavoured(kept, key.tma)
    if key.schedule != PERSISTENT_ONLY and bk == 64:
        kept += flavoured(WS_CONFIGS, key.tma)
        if key.m <= 128:
            kept += flavoured([c for c in DEEP_K_CONFIGS if split_allowed(c, key.m) or few_tiles(c)], key.tma)
    return with_pick(kept, matmul_heuristic(key, sms))


def matmul_heuristic(key: MatmulKey, sms: int) -> triton.Config:
    """One config from the shape (no timing). Large outputs: 128x256 tiles, persistent with TMA
    loads where allowed; a few hundred tiles: launch-per-tile, warp-specialised on TMA;
    small M: 64-row tiles, as wide as still fills the SMs, then split-K until it does."""
    bk = BLOCK_K[key.dtype]
    M, N, K = key.m, key.n, key.k
    tma = key.tma != POINTERS_ONLY
    big = tile_count(M, N, 128, 256)
    if key.dtype != "fp32" and M >= 1024 and big >= sms // 2:
        if key.schedule != PER_TILE and (big >= sms or key.schedule == PERSISTENT_ONLY):
            return with_meta(cfg(128, 256, bk, 8, 3), PERSISTENT=True, STREAM_K=True, USE_TMA=tma)
        if tma and bk == 64:
            wide = (128, 256) if N >= M else (256, 128)
            return warp_specialized(cfg(*wide, bk, 4, 3), USE_TMA=True)
        base = cfg(128, 256, bk, 8, 3)
    elif key.dtype == "fp32":
        base = cfg(128, 128, 32, 4, 4) if tile_count(M, N, 128, 128) >= sms else cfg(64, 64, 32, 4, 4)
    elif M > 64 and tile_count(M, N, 128, 128) >= sms:
        base = cfg(128, 128, bk, 8, 4)
    elif tile_count(M, N, 64, 128) >= sms:
        base = cfg(64, 128, bk, 4, 4)
    else:
        base = cfg(64, 64, bk, 4, 5 if bk == 64 else 4)
    kw = {"USE_TMA": key.tma == TMA_ONLY}
    bm, bn = base.kwargs["BLOCK_M"], base.kwargs["BLOCK_N"]
    split = fill_split(tile_count(M, N, bm, bn), K, bk, sms) if bm == 64 else 1
    if split > 1:
        kw["SPLIT_K"] = split
    if key.schedule == PERSISTENT_ONLY:
        kw["PERSISTENT"] = True
        if bm == 64 and bn <= 128 and not key.programs:
            kw["PROGRAMS_PER_SM"] = 2
    return with_meta(base, **kw)


# ---------------------------------------------------------------------------- families


def with_pick(candidates, pick):
    """``candidates`` with the heuristic's ``pick`` added when it is not among them (autotuning
    then always times the config an untuned call would run)."""
    ids = {config_id(c) for c in candidates}
    return candidates + ([pick] if config_id(pick) not in ids else [])


class PrepKey(NamedTuple):
    """The key of a memory-light helper kernel (grouped/'s row tables, gathers, combines;
    blockscaled/'s transpose), whose config is a block size and warps from one number."""

    what: str       # the helper: its family's name
    size: int       # a size bucket the config follows (its family's policy says which)

    def __str__(self):
        return f"{self.what} {self.size}"


class Family(NamedTuple):
    """One kernel family's policy, as the launcher reads it."""

    name: str
    candidates: object      # (key, sms) -> list[triton.Config]
    heuristic: object       # (key, sms) -> triton.Config
    interpret: object        # the interpreter's triton.Config, or key -> triton.Config


# By name (launchers name their family, the tables file configs under it): core's dense one
# here; core/hopper_configs.py, grouped/configs.py and blockscaled/configs.py register theirs.
FAMILIES = {f.name: f for f in (
    Family("matmul", matmul_candidates, matmul_heuristic, MATMUL_INTERPRET),
)}


def register(*families: Family) -> None:
    """Add a package's families to ``FAMILIES`` (at its import, before any launcher names them)."""
    for family in families:
        FAMILIES[family.name] = family
