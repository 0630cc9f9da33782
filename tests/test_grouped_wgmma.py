"""The grouped flavour of core's Gluon FP8 body (core/hopper_fp8.py, GROUPED / SWIGLU) and
what grouped/ builds for it: the row-tile table (row_tiles), the expert-sorted fp8 rows
(gather_quantize) and the dispatch rule (grouped/wgmma.py gluon_grouped_mode).

Gluon has no interpreter: the kernels run on the H200 (``sm90`` tests); on CPU the table, the
quantised gather and the rule are checked against torch.
"""

import pytest
import torch

import onegemm
from helpers import fp8_grouped_inputs, fp8_layer_diff_bound, fp8_moe_inputs, offs_of
from onegemm.core import hopper_configs, hopper_fp8
from onegemm.core.configs import cfg
from onegemm.grouped import configs, wgmma
from onegemm.core.launch import clear_plans, plans
from onegemm.core.scaling import Granularity, Scaling
from onegemm.grouped.ops import combine, gather_quantize, row_tiles, swiglu_forward, swiglu_quantize
from onegemm.testing import (
    assert_close,
    assert_moe_fp8_close,
    calc_diff,
    dequantize_ref,
    grouped_mm_ref,
    launched,
    moe_ref,
    quantize_fp8_ref,
)

E4M3 = torch.float8_e4m3fn


def row_tiles_ref(sizes, M, block_m):
    """(group, first row, end row, fill) of every row tile, group after group, then the rows
    past the last offset (fill 1, group clamped to G - 1)."""
    G, rows, start = len(sizes), [], 0
    for g, size in enumerate(list(sizes) + [M - sum(sizes)]):
        for t in range(-(-size // block_m)):
            rows.append((min(g, G - 1), start + t * block_m, start + size, int(g == G)))
        start += size
    return rows


# (group sizes, rows M, tile height): empty groups, one row, sizes around a tile, rows past
# offs[-1], more groups than a CHUNK of tiles
ROW_TILE_CASES = [
    pytest.param([0, 1, 127, 129, 300], 560, 128, id="odd-sizes"),
    pytest.param([64, 0, 0, 65], 140, 64, id="empty-groups-and-tail"),
    pytest.param([5] * 40, 200, 64, id="40-groups"),
    pytest.param([0, 0], 0, 128, id="no-rows"),
]


@pytest.mark.parametrize("sizes,M,block_m", ROW_TILE_CASES)
def test_row_tiles(sizes, M, block_m, device):
    offs = offs_of(sizes, device)
    sched, count = row_tiles(offs, len(sizes), M, block_m)
    want = row_tiles_ref(sizes, M, block_m)
    assert int(count.item()) == len(want)
    assert sched[: len(want)].tolist() == [list(r) for r in want]


def test_row_tiles_without_tail(device):
    """tail=False (the MoE's rows of experts on other ranks): the table ends with the last group."""
    sizes = [3, 0, 130]
    sched, count = row_tiles(offs_of(sizes, device), 3, 300, 64, tail=False)
    want = [r for r in row_tiles_ref(sizes, 300, 64) if r[3] == 0]
    assert int(count.item()) == len(want) == 4
    assert sched[:4].tolist() == [list(r) for r in want]


def test_row_tiles_bad_offs(device):
    """Decreasing offs: the whole of M is one NaN-filled group (fill 2), as the ragged kernel does."""
    sched, count = row_tiles(torch.tensor([50, 20, 90], dtype=torch.int32, device=device), 3, 100, 64)
    assert int(count.item()) == 2
    assert sched[:2].tolist() == [[2, 0, 100, 2], [2, 64, 100, 2]]


# (tokens T, hidden H, rows P, x dtype, layout): H not a multiple of 128, a transposed x
GATHER_CASES = [
    pytest.param(7, 300, 17, torch.float32, "contig", id="fp32"),
    pytest.param(5, 256, 12, torch.bfloat16, "contig", id="bf16"),
    pytest.param(9, 136, 1, torch.float16, "transposed", id="fp16-transposed"),
]


@pytest.mark.parametrize("T,H,P,dtype,layout", GATHER_CASES)
def test_gather_quantize_is_quantize_fp8_of_the_rows(T, H, P, dtype, layout, device):
    x = (torch.randn(T, H, device=device) * 3).to(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()
    x[0, :5] = 0.0  # a partly zero block
    rows = torch.randint(0, T, (P,), device=device, dtype=torch.int32)
    q, s = gather_quantize(x, rows)
    want_q, want_s = quantize_fp8_ref(x[rows.long()], (1, 128))
    assert q.dtype == E4M3 and s.shape == want_s.shape and s.stride(0) == 1
    assert torch.equal(q.float(), want_q.float())
    assert torch.equal(s, want_s)


def test_gather_quantize_stops_at_the_last_offset(device):
    """With offs, rows past offs[-1] (experts on other ranks) are left as they were (poisoned)."""
    x = torch.randn(6, 256, device=device)
    rows = torch.randint(0, 6, (10,), device=device, dtype=torch.int32)
    q, s = gather_quantize(x, rows, offs=torch.tensor([4, 7], dtype=torch.int32, device=device))
    want_q, want_s = quantize_fp8_ref(x[rows.long()], (1, 128))
    assert torch.equal(q[:7].float(), want_q[:7].float()) and torch.equal(s[:7], want_s[:7])
    assert s[7:].isnan().all()  # runtime.empty poisons outputs in tests


@pytest.mark.parametrize("P,I,dtype", [(17, 300, torch.float32), (5, 128, torch.bfloat16), (1, 64, torch.float16)],
                         ids=["fp32", "bf16", "fp16"])
def test_swiglu_quantize_is_quantize_fp8_of_the_swiglu(P, I, dtype, device):
    """The FP8 training forward's GEMM2 operand: quantize_fp8(silu(gate) * up) with the
    product rounded to h_pre's dtype first, in one pass (the fp32 SwiGLU of the kernel and of
    torch may differ in the last bit, which can move an fp8 rounding: close, not equal)."""
    h_pre = (torch.randn(P, 2 * I, device=device) * 3).to(dtype)
    q, s = swiglu_quantize(h_pre)
    g, u = h_pre.float().chunk(2, dim=1)
    h = (torch.nn.functional.silu(g) * u).to(dtype)
    want_q, want_s = quantize_fp8_ref(h, (1, 128))
    assert q.dtype == E4M3 and s.shape == want_s.shape and s.stride(0) == 1
    torch.testing.assert_close(s, want_s, rtol=1e-2, atol=0)
    assert_close(dequantize_ref(q, s, 1, 128), h, 0.05, "dequantised h")
    assert (q.float() == want_q.float()).float().mean() > 0.9  # (the interpreter truncates a bf16 cast)


@pytest.mark.parametrize("P,I,dtype", [(17, 300, torch.float32), (5, 128, torch.bfloat16), (1, 64, torch.float16)],
                         ids=["fp32", "bf16", "fp16"])
def test_swiglu_is_silu_gate_times_up(P, I, dtype, device):
    """moe_ffn's training forward: silu(gate) * up of fp32 GEMM1 sums, stored in x's dtype (the
    interpreter truncates a 16-bit store: up to one ulp)."""
    h_pre = torch.randn(P, 2 * I, device=device) * 3
    h = swiglu_forward(h_pre, dtype)
    g, u = h_pre.chunk(2, dim=1)
    assert h.dtype == dtype and h.shape == (P, I)
    assert_close(h, torch.nn.functional.silu(g.double()) * u.double(), 1e-6 if dtype == torch.float32 else 1e-2)


# (tokens, k, H, out dtype, ids): ids of other ranks (-1, E and past) are skipped
COMBINE_CASES = [
    pytest.param(5, 2, 300, torch.float32, "foreign", id="fp32-foreign-ids"),
    pytest.param(3, 4, 128, torch.bfloat16, "local", id="bf16-k4"),
    pytest.param(1, 1, 17, torch.float16, "foreign", id="one-token"),
]


@pytest.mark.parametrize("T,k,H,dtype,ids_kind", COMBINE_CASES)
def test_combine_skips_foreign_slots(T, k, H, dtype, ids_kind, device):
    E = 4
    ids = torch.randint(0, E, (T, k), device=device)
    if ids_kind == "foreign":
        ids[0, 0], ids[-1, -1] = -1, E + 3
    y_pairs = torch.randn(T * k, H, device=device).to(dtype)
    valid = (ids >= 0) & (ids < E)
    y_pairs[~valid.reshape(-1)] = float("nan")  # never written rows
    out = combine(y_pairs, ids, E, dtype)
    want = torch.where(valid[..., None], y_pairs.double().view(T, k, H), 0.0).sum(1)
    assert out.dtype == dtype
    assert_close(out, want, 1e-2 if dtype != torch.float32 else 1e-6)


def _expert_weights(G, N, K, dtype=E4M3):
    return torch.empty(G, N, K, dtype=dtype)


# (what changes from 512 rows per group of K = 256 over 8 experts of N = 512, the rule's
# answer: the flavour's mode, or None for core's Triton body), with the thresholds at
# 256 rows per group for "grouped", 64 for "decode" where a call reads 8 experts' weights, and
# experts of 512 x 128 weights at least (the tuned ones differ). The rule reads M at its
# bucket's floor: M = 2^n covers 2^(n-1) + 1 to 2^n rows.
ROWS, DECODE_ROWS = 256, 64
GROUPED_DISPATCH_CASES = [
    pytest.param({}, "grouped", id="eligible"),
    pytest.param({"M": 8 * ROWS + 1}, "grouped", id="bucket-floor-at-grouped-rows"),
    pytest.param({"M": 8 * ROWS}, None, id="bucket-floor-under-grouped-rows"),
    pytest.param({"M": 8 * DECODE_ROWS}, "decode", id="decode-rows-per-group"),
    pytest.param({"M": 8 * DECODE_ROWS + 1}, None, id="bucket-floor-over-decode-rows"),
    pytest.param({"M": 16}, "decode", id="two-rows-per-group"),
    pytest.param({"M": 9}, "decode", id="bucket-floor-reads-8-experts"),
    pytest.param({"M": 8}, None, id="bucket-floor-reads-5-of-8-experts"),
    pytest.param({"M": 0}, None, id="no-rows"),
    pytest.param({"kind_a": "row"}, None, id="row-wise-scale_a"),
    pytest.param({"kind_b": "col"}, None, id="per-channel-scale_b"),
    pytest.param({"kind_a": "row", "kind_b": "col"}, "grouped", id="row-wise-epilogue-scales"),
    pytest.param({"kind_a": "row", "kind_b": "col", "M": 16}, "decode", id="row-wise-decode"),
    pytest.param({"tma": False}, None, id="tma-False"),
    pytest.param({"config": cfg(64, 128, 128, 4, 3)}, None, id="forced-triton-config"),
    pytest.param({"K": 200}, None, id="rows-of-200-bytes"),
    pytest.param({"w": "sliced"}, None, id="experts-not-evenly-spaced"),
    pytest.param({"w": "n_major"}, None, id="experts-n-major"),
    pytest.param({"a": "transposed"}, None, id="a-column-major"),
    pytest.param({"dtype": torch.float8_e5m2}, None, id="e5m2"),
    pytest.param({"N": 16}, None, id="small-experts"),
]


@pytest.mark.parametrize("change,expected", GROUPED_DISPATCH_CASES)
def test_wgmma_grouped_dispatch_rule(change, expected, monkeypatch):
    """On an sm_90 GPU (stood in for here): e4m3 with 1x128 x 128x128 scales (or row-wise x
    per-channel ones, the epilogue's), TMA-readable rows and experts, enough rows per group
    take the Gluon body; anything else the Triton body."""
    monkeypatch.setattr(wgmma, "on_sm90", lambda t: True)
    monkeypatch.setattr(configs, "WGMMA_MIN_GROUP_ROWS", ROWS)
    monkeypatch.setattr(configs, "WGMMA_GEMM_DECODE_MAX_ROWS", DECODE_ROWS)
    monkeypatch.setattr(configs, "WGMMA_DECODE_MIN_ELEMENTS", 8 * 512 * 256)
    monkeypatch.setattr(configs, "WGMMA_MIN_EXPERT_ELEMENTS", 512 * 128)
    args = dict(M=2 * 8 * ROWS, K=256, N=512, G=8, kind_a="1x128", kind_b="128x128", tma=None, config=None, w="plain",
                a="contig", dtype=E4M3)
    args.update(change)
    M, K, N, G = args["M"], args["K"], args["N"], args["G"]
    w = {"plain": lambda: _expert_weights(G, N, K, args["dtype"]),
         "sliced": lambda: _expert_weights(G, N + 16, K, args["dtype"])[:, :N],
         "n_major": lambda: _expert_weights(G, K, N, args["dtype"]).transpose(1, 2)}[args["w"]]()
    a = torch.empty(M, K, dtype=args["dtype"]) if args["a"] == "contig" else torch.empty(K, M, dtype=args["dtype"]).t()
    scaling = Scaling(Granularity.parse(args["kind_a"]), Granularity.parse(args["kind_b"]))
    assert wgmma.gluon_grouped_mode(w, M, G, scaling, a=a, tma=args["tma"],
                                    config=args["config"]) == expected


@pytest.mark.parametrize("rows,tall", [(512, True), (256, True), (128, False)])
def test_wgmma_grouped_tall_candidates(rows, tall):
    """256-row tiles are autotuning candidates of the grouped flavour where groups hold that many
    rows, with the register split that compiles spill-free, and fit shared memory."""
    key = hopper_configs.WgmmaKey(rows, 4096, 7168, Scaling.parse("1x128,128x128"), "bf16", "grouped")
    found = hopper_configs.wgmma_candidates(key, 132)
    talls = [c for c in found if c.kwargs["BLOCK_M"] == 256]
    assert bool(talls) == tall
    assert all(c.kwargs["CONSUMER_REGS"] == 224 and c.kwargs["LOADER_REGS"] == 56 for c in talls)
    assert all(hopper_configs._wgmma_fits(c, "bf16", "grouped") for c in found)
    assert hopper_configs.wgmma_heuristic(key, 132).kwargs["BLOCK_M"] == 128


def test_wgmma_decode_form_only_in_moe_pipeline(monkeypatch):
    """Under the shipped thresholds a decode-sized call takes the SWAP form inside moe_ffn's
    pipeline and core's Triton body as a plain grouped GEMM, where the form never won
    (bench/results/moe_decode_bodies.md); 32 rows per group take the tiles either way."""
    monkeypatch.setattr(wgmma, "on_sm90", lambda t: True)
    w = _expert_weights(8, 1024, 4096, E4M3)  # 8 experts read: 2^25 weights, the decode form's floor
    assert wgmma.gluon_grouped_mode(w, 64, 8, moe=True) == "decode"
    assert wgmma.gluon_grouped_mode(w, 64, 8) is None
    assert wgmma.gluon_grouped_mode(w, 8, 8, moe=True) is None  # M = 5 to 8 read 5 experts at least: too few
    assert wgmma.gluon_grouped_mode(w, 8 * 64, 8) == "grouped" == wgmma.gluon_grouped_mode(w, 8 * 64, 8, moe=True)


# (N, K, G) of the stored layers' FP8 GEMMs: Qwen3-30B-A3B's, Mixtral's, DeepSeek-V3 EP8's
# gate_up and down experts, and gpt-oss-120b's
BAND_SHAPES = [(1536, 2048, 128), (2048, 768, 128), (28672, 4096, 8), (4096, 14336, 8), (4096, 7168, 32),
               (7168, 2048, 32), (5760, 2880, 128), (2880, 2880, 128)]


@pytest.mark.parametrize("N,K,G", BAND_SHAPES)
@pytest.mark.parametrize("moe", [True, False])
def test_grouped_band_holds_over_each_bucket(N, K, G, moe):
    """The band is one over every M of an M bucket (the compiled variants' key), so that the
    counts a warmup runs (configs.token_counts) meet the body each M of the bucket takes."""
    for top in (2**n for n in range(16)):
        bands = {wgmma.grouped_band(N, K, m, G, moe) for m in range(top // 2 + 1, top + 1)}
        assert len(bands) == 1, (top, bands)


def test_wgmma_grouped_off_sm90(device):
    """Off sm_90 (the interpreter, a CPU tensor, another GPU) the grouped GEMMs run core's Triton body."""
    w = torch.empty(8, 512, 256, dtype=E4M3, device=device)
    if hopper_fp8.on_sm90(w):
        pytest.skip("this GPU is sm_90: the GPU tests below cover it")
    assert wgmma.gluon_grouped_mode(w, 4096, 8) is None and wgmma.gluon_grouped_mode(w, 8, 8) is None


# ---------------------------------------------------------------- on the H200

def _runs_wgmma(fn, mode):
    """Whether fn() launches the Gluon body, with a plan of ``mode`` ("grouped" or "swiglu")."""
    families = [x["family"] for x in launched(fn)]
    return "blockscaled_wgmma" in families and any(k[0].mode == mode for k in plans("blockscaled_wgmma"))


@pytest.fixture(params=["grouped", "decode"])
def flavour(request, monkeypatch):
    """Both forms of the flavour on any group size: the rule picks them by rows per group for
    speed, not for correctness, so the kernels' tests force each."""
    big = 10**9
    monkeypatch.setattr(configs, "WGMMA_MIN_EXPERT_ELEMENTS", 0)
    if request.param == "grouped":
        monkeypatch.setattr(configs, "WGMMA_MIN_GROUP_ROWS", 0)
    else:
        monkeypatch.setattr(configs, "WGMMA_MIN_GROUP_ROWS", big)
        monkeypatch.setattr(configs, "WGMMA_DECODE_MAX_ROWS", big)
        monkeypatch.setattr(configs, "WGMMA_GEMM_DECODE_MAX_ROWS", big)
        monkeypatch.setattr(configs, "WGMMA_DECODE_MIN_ELEMENTS", 0)
    clear_plans()  # the calls cached under the tuned thresholds' decisions
    yield request.param
    clear_plans()


# (group sizes, K, N): empty groups, 1, 127, 129, 300 rows; K and N not multiples of 128 (K a
# multiple of 16: TMA rows); skewed (one group holds most rows)
GROUPED_GPU_CASES = [
    pytest.param([0, 1, 127, 129, 300], 400, 200, id="odd-groups-K400-N200"),
    pytest.param([2000, 3, 0, 45, 0, 0, 12, 500], 2048, 768, id="skewed-8-experts"),
    pytest.param([64] * 32, 7168, 256, id="32-experts-deepseek-K"),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("sizes,K,N", GROUPED_GPU_CASES)
@pytest.mark.parametrize("kinds", [("1x128", "128x128"), ("row", "col")], ids=["blockwise", "row-wise"])
@pytest.mark.parametrize("stages", [3, 4], ids=["s3", "s4"])
def test_gpu_grouped_fp8_tall_tiles(sizes, K, N, kinds, stages, device):
    """The grouped flavour's 256-row tiles (SPLIT_M, forced: two consumers of 128 rows, each as
    two promoted 64-row halves) against float64: tiles whose second consumer, or half, lies
    past its group (the next group's rows, or past the last offset), with bias and activation;
    a poisoned output shows an unwritten row."""
    qa, qb, sa, sb, offs, a_deq, b_deq = fp8_grouped_inputs(*kinds, sizes, K, N, device)
    (G, M), scaling = (len(sizes), qa.shape[0]), Scaling.parse(",".join(kinds))
    bias = torch.randn(G, N, device=device)
    key = hopper_configs.WgmmaKey(M // G, N, K, scaling, "bf16", "grouped")
    out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
    wgmma.run_wgmma_grouped(qa, qb.transpose(1, 2), out, lambda bm: row_tiles(offs, G, M, bm), sa, sb, N=N, key=key,
                            bias=bias, activation="silu", config=hopper_configs.tall_cfg(stages))
    assert_close(out[:sum(sizes)], grouped_mm_ref(a_deq, b_deq, offs, bias, "silu")[:sum(sizes)], 1e-2)
    assert (out[sum(sizes):] == 0).all()  # rows past the last offset: a tile of zeros


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("sizes,K,N", GROUPED_GPU_CASES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias-silu"])
@pytest.mark.parametrize("kinds", [("1x128", "128x128"), ("row", "col")], ids=["blockwise", "row-wise"])
def test_gpu_grouped_fp8_on_wgmma(sizes, K, N, with_bias, kinds, device, flavour):
    """Block scales promote each K block in the K loop; row-wise scale_a [M, 1] and
    per-channel scale_b [G, 1, N] (torch._scaled_grouped_mm's) multiply in the epilogue, the
    group's own scale_b row."""
    qa, qb, sa, sb, offs, a_deq, b_deq = fp8_grouped_inputs(*kinds, sizes, K, N, device)
    G = len(sizes)
    bias = torch.randn(G, N, device=device) if with_bias else None
    act = "silu" if with_bias else None
    out = onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb, bias=bias, activation=act)
    assert _runs_wgmma(lambda: onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb, bias=bias, activation=act),
                       flavour), "the Gluon body did not run"
    assert out.dtype == torch.bfloat16
    assert_close(out, grouped_mm_ref(a_deq, b_deq, offs, bias, act), 1e-2)
    assert (out[sum(sizes):] == 0).all()
    again = onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb, bias=bias, activation=act)
    assert torch.equal(out, again)  # bitwise on a rerun
    # the Triton body computes the same products (tma=False takes it)
    triton_body = onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=sb, bias=bias, activation=act, tma=False)
    assert_close(out, triton_body.double(), 1e-2)


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_grouped_fp8_wgmma_bad_offs(device, flavour):
    qa, qb, sa, sb, _, _, _ = fp8_grouped_inputs("1x128", "128x128", [300, 300], 256, 256, device, tail=0)
    bad = torch.tensor([400, 100], dtype=torch.int32, device=device)
    out = onegemm.grouped_matmul(qa, qb, bad, scale_a=sa, scale_b=sb)
    assert out.isnan().all()


# (T, H, I, E, k, routing): I not a multiple of 128 (the up half's scale blocks start after
# the gate's partial one); H not one either; skewed routing; ids of other ranks
MOE_GPU_CASES = [
    pytest.param(512, 512, 384, 8, 2, "uniform", id="T512-E8"),
    pytest.param(700, 400, 208, 4, 2, "skewed", id="odd-H400-I208-skewed"),
    pytest.param(1024, 1024, 256, 16, 4, "foreign", id="foreign-ids"),
    pytest.param(1, 256, 128, 8, 2, "uniform", id="T1"),
    pytest.param(37, 512, 256, 16, 4, "skewed", id="T37-skewed"),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("T,H,I,E,k,routing", MOE_GPU_CASES)
def test_gpu_moe_ffn_fp8_on_wgmma(T, H, I, E, k, routing, device, flavour):
    x, w13, w2, weights, ids, scales, (w13_hp, w2_hp) = fp8_moe_inputs(
        T, H, I, E, k, torch.bfloat16, device, bad_ids=routing == "foreign", skewed=routing == "skewed")
    y = onegemm.moe_ffn(x, w13, w2, weights, ids, **scales)
    gemm1 = "swiglu" if flavour == "grouped" else "decode_swiglu"
    assert _runs_wgmma(lambda: onegemm.moe_ffn(x, w13, w2, weights, ids, **scales), gemm1), "the Gluon body did not run"
    assert_moe_fp8_close(y, x, w13, w2, weights, ids, **scales)
    assert calc_diff(y, moe_ref(x, w13_hp, w2_hp, weights, ids)) < fp8_layer_diff_bound(y)
    assert torch.equal(onegemm.moe_ffn(x, w13, w2, weights, ids, **scales), y)  # bitwise on a rerun
