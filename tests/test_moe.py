"""MoE: route, the device-side sort, moe_ffn and MoEFFN, on random and on the stored layer."""

import pytest
import torch
from safetensors.torch import load_file, save_file

import onegemm
from helpers import capture, fp8_layer_diff_bound, fp8_moe_inputs, moe_inputs
from onegemm.grouped import STORED_FP8_LAYER, STORED_LAYER, sort_by_expert
from onegemm.core.launch import reload_tables
from onegemm.grouped import configs as grouped_configs
from onegemm.grouped.kernels import RowTiles
from onegemm.grouped.moe_steps import prep_step
from onegemm.grouped.ops import row_tiles
from onegemm.testing import (
    TOL,
    assert_close,
    assert_moe_fp8_close,
    calc_diff,
    launched,
    moe_ffn_torch,
    moe_fp8_train_ref,
    moe_ref,
    quantize_experts_ref,
    quantize_fp8_ref,
    route_ref,
)

E4M3 = torch.float8_e4m3fn


# ---- routing ----


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 8, 2), (64, 128, 8), (5, 3, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(T, E, k, renormalize, device):
    logits = torch.randn(T, E, device=device).to(torch.bfloat16)  # continuous: no ties
    w, ids = onegemm.route(logits, k, renormalize)
    w_ref, ids_ref = route_ref(logits, k, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    assert_close(w, w_ref, 1e-6)
    if renormalize:
        assert torch.allclose(w.sum(-1), torch.ones(T, device=device))


def test_route_bad_input(device):
    with pytest.raises(ValueError, match="top_k"):
        onegemm.route(torch.randn(4, 8, device=device), 9)
    with pytest.raises(ValueError, match="logits must be 2-D"):
        onegemm.route(torch.randn(8, device=device), 2)


@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (50, 8, 2), (33, 16, 4)])
def test_sort_by_expert(T, E, k, device):
    ids = torch.randint(0, E, (T, k), device=device, dtype=torch.int32)
    pair, token, offs = sort_by_expert(ids, E)
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    assert torch.equal(offs.long(), counts.cumsum(0))
    assert torch.equal(token.long(), pair.long() // k)
    assert sorted(pair.tolist()) == list(range(T * k))  # a permutation of the pairs
    sorted_ids = flat[pair.long()]
    assert (sorted_ids[1:] >= sorted_ids[:-1]).all()
    # stable: pairs of one expert keep their original order
    for e in range(E):
        run = pair[offs[e] - counts[e] : offs[e]].tolist()
        assert run == sorted(run)


# (T, k, E, H, ids): one pair; more pairs than a program's 64 and H not a multiple of 128;
# ids of other ranks (outside [0, E)); int64 ids; more pairs than the one launch takes
# (SORT_MAX_PAIRS: torch.sort, gather_quantize and row_tiles instead); 2400 pairs: several
# histogram steps and table programs, E = 15 whose out-of-range bin is the padding's bin
PREP_CASES = [
    pytest.param(1, 1, 4, 128, "in-range", id="one-pair"),
    pytest.param(3, 6, 40, 200, "other-ranks", id="18-pairs"),  # a 32-pair program, 14 rows of padding
    pytest.param(300, 8, 15, 136, "other-ranks", id="2400-pairs-E15"),
    pytest.param(17, 8, 16, 300, "in-range", id="136-pairs"),
    pytest.param(40, 4, 8, 256, "other-ranks", id="other-ranks"),
    pytest.param(33, 2, 5, 136, "int64", id="int64-ids"),
    pytest.param(1100, 4, 6, 128, "other-ranks", id="past-one-launch"),
]


@pytest.mark.parametrize("sorted_x", [True, False], ids=["sorted-rows", "token-rows"])
@pytest.mark.parametrize("T,k,E,H,ids_kind", PREP_CASES)
def test_moe_prep(T, k, E, H, ids_kind, sorted_x, device):
    """The step before the expert GEMMs (moe_steps.prep_step): the stable sort by expert, x's
    rows in that order quantised in 1x128 blocks (quantize_fp8 of each row), the rows of other
    ranks' pairs left unwritten (``sorted_x`` False: x's T rows in token order, each once, every
    one written), the row-tile tables of two heights (row_tiles' tables without the tail
    group), and zeros where asked (GEMM2's combine tickets)."""
    low, high = (-2, E + 3) if ids_kind == "other-ranks" else (0, E)
    ids = torch.randint(low, high, (T, k), device=device, dtype=torch.int64 if ids_kind == "int64" else torch.int32)
    x = torch.randn(T, H, device=device).to(torch.bfloat16) * 4
    P, kb = T * k, -(-H // 128)
    rows = P if sorted_x else T
    poison = lambda *shape, dtype=torch.int32: torch.full(shape, -7, dtype=dtype, device=device)  # noqa: E731
    pair, token, offs = poison(P), poison(P), poison(E)
    q = torch.full((rows, H), float("nan"), device=device).to(E4M3)
    s = torch.full((kb, rows), float("nan"), device=device).t()
    tables = [RowTiles(poison(-(-P // m) + E + 1, 4), poison(1)) for m in (16, 64)]
    zeros = poison(3000)  # GEMM2's combine tickets: more than one program's slice
    prep_step(ids, E, x, E4M3, (16, 64), sorted_x=sorted_x)(ids, pair, token, offs, x, q, s, zeros, tables)

    flat = ids.reshape(-1)
    expert = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.sort(expert, stable=True).indices
    assert pair.tolist() == order.tolist() and token.tolist() == (order // k).tolist()
    assert offs.tolist() == torch.bincount(expert, minlength=E + 1)[:E].cumsum(0).tolist()
    live = int(offs[-1]) if sorted_x else T  # sorted rows past offs[-1] are other ranks' pairs
    want_q, want_s = quantize_fp8_ref(x[order // k] if sorted_x else x, (1, 128))
    assert torch.equal(q[:live].float(), want_q[:live].float()) and torch.equal(s[:live], want_s[:live])
    assert q[live:].float().isnan().all() and s[live:].isnan().all()
    assert not zeros.any()
    for (sched, count), block_m in zip(tables, (16, 64)):
        want_sched, want_count = row_tiles(offs, E, P, block_m, tail=False)
        assert count.tolist() == want_count.tolist()
        assert sched[:int(count)].tolist() == want_sched[:int(count)].tolist()


# ---- moe_ffn ----

MOE_CASES = [
    # T, H, I, E, k
    (1, 32, 48, 4, 1),
    (17, 64, 40, 8, 2),
    (64, 48, 64, 16, 4),
    (127, 40, 33, 5, 2),
]


@pytest.mark.parametrize("T,H,I,E,k", MOE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_ffn_matches_reference(T, H, I, E, k, dtype, device):
    x, w_gate_up, w_down, weights, ids = moe_inputs(T, H, I, E, k, dtype, device)
    y = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)
    assert y.dtype == dtype and y.shape == (T, H)
    # The [P, I] intermediate is stored in x's dtype (as in production MoE kernels): one more
    # rounding than the plain GEMM, hence 2x the GEMM bound for bf16.
    tol = 1e-5 if dtype == torch.float32 else 2 * TOL[dtype]
    assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), tol)


def test_moe_ffn_skewed_and_empty_experts(device):
    """All tokens on two of eight experts; six experts get no rows."""
    T, H, I, E = 40, 32, 48, 8
    x, w_gate_up, w_down, weights, _ = moe_inputs(T, H, I, E, 2, torch.float32, device)
    ids = torch.stack([torch.full((T,), 6), torch.full((T,), 1)], dim=1).to(device, torch.int32)
    y = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)
    assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), 1e-5)


def test_moe_ffn_ids_outside_range_contribute_nothing(device):
    """Expert-parallel convention: an id outside [0, E) (an expert on another rank) is skipped."""
    T, H, I, E = 20, 32, 40, 4
    x, w_gate_up, w_down, weights, ids = moe_inputs(T, H, I, E, 2, torch.float32, device)
    ids[::3, 1] = E
    ids[1::4, 0] = -1
    y = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)
    assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), 1e-5)


def test_moe_ffn_is_deterministic(device):
    x, w_gate_up, w_down, weights, ids = moe_inputs(100, 64, 48, 8, 2, torch.bfloat16, device)
    first = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)
    for _ in range(2):
        assert torch.equal(onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids), first)


def test_moe_ffn_int64_ids_and_strided_x(device):
    T, H, I, E = 30, 32, 40, 4
    x, w_gate_up, w_down, weights, ids = moe_inputs(T, H, I, E, 2, torch.float32, device)
    x = torch.randn(T, 2 * H, device=device)[:, ::2]
    y = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids.long())
    assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), 1e-5)


def test_moe_ffn_bad_input(device):
    x, w_gate_up, w_down, weights, ids = moe_inputs(8, 32, 40, 4, 2, torch.float32, device)
    with pytest.raises(ValueError, match=r"w_down must be \[E, H, I\]"):
        onegemm.moe_ffn(x, w_gate_up, w_down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="w_gate_up must be"):
        onegemm.moe_ffn(x, w_gate_up[:, :, :-1], w_down, weights, ids)
    with pytest.raises(ValueError, match="topk_(weights|ids) must be"):
        onegemm.moe_ffn(x, w_gate_up, w_down, weights[:-1], ids)
    with pytest.raises(TypeError, match="topk_ids"):
        onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids.float())
    with pytest.raises(TypeError, match="w_gate_up"):
        onegemm.moe_ffn(x, w_gate_up.half(), w_down, weights, ids)


# ---- the stored layer and MoEFFN ----


def stored_ref(layer, x):
    """float64 forward of a MoEFFN: router, route_ref, moe_ref."""
    logits = x.double() @ layer.gate_weight.double().t()
    w, ids = route_ref(logits, layer.top_k)
    return moe_ref(x, layer.w_gate_up, layer.w_down, w, ids)


def test_stored_layer_file():
    tensors = load_file(str(STORED_LAYER))
    assert STORED_LAYER.stat().st_size < 8e6
    assert tensors["gate.weight"].shape == (8, 256)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    w1 = tensors["experts.0.w1.weight"].float()
    assert w1.shape == (512, 256)
    # scaled like trained weights, with heavy-tailed outliers (> 6 std) in every matrix
    assert abs(w1.std().item() * 256**0.5 - 1) < 0.05
    assert (w1.abs() > 6 * 256**-0.5).sum() >= 4


@pytest.mark.parametrize("T", [1, 33])
def test_moeffn_stored_layer(T, device):
    layer = onegemm.MoEFFN.from_safetensors(STORED_LAYER, top_k=2, device=device)
    assert layer.num_experts == 8 and layer.w_gate_up.shape == (8, 1024, 256)
    x = torch.randn(T, 256, device=device).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (T, 256)
    assert_close(y, stored_ref(layer, x), 2 * TOL[torch.bfloat16])


def test_moe_ffn_stored_layer_explicit_routing(device):
    """moe_ffn on the stored weights with routing decoupled from the router GEMM."""
    layer = onegemm.MoEFFN.from_safetensors(STORED_LAYER, device=device)
    T = 24
    x = torch.randn(T, 256, device=device).to(torch.bfloat16)
    w, ids = onegemm.route(torch.randn(T, 8, device=device), 2)
    y = onegemm.moe_ffn(x, layer.w_gate_up, layer.w_down, w, ids)
    assert_close(y, moe_ref(x, layer.w_gate_up, layer.w_down, w, ids), 2 * TOL[torch.bfloat16])


def _small_layer(E=3, H=16, I=24):
    t = {"model.moe.gate.weight": torch.randn(E, H)}
    for e in range(E):
        t[f"model.moe.experts.{e}.w1.weight"] = torch.randn(I, H)
        t[f"model.moe.experts.{e}.w3.weight"] = torch.randn(I, H)
        t[f"model.moe.experts.{e}.w2.weight"] = torch.randn(H, I)
    return t


def _renamed(tensors, names):
    """The same layer under another model's expert key names (gate, up, down)."""
    old = ("w1", "w3", "w2")
    out = {}
    for k, v in tensors.items():
        for o, n in zip(old, names):
            k = k.replace(f".{o}.weight", f".{n}.weight")
        out[k] = v
    return out


@pytest.mark.parametrize("names", [("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")], ids=["mixtral", "qwen3"])
def test_from_safetensors_prefix(names, tmp_path, device):
    """Mixtral's key names and Qwen3-MoE's / DeepSeek-V3's load the same layer."""
    path = tmp_path / "layer.safetensors"
    tensors = _small_layer()
    save_file(_renamed(tensors, names), str(path))
    layer = onegemm.MoEFFN.from_safetensors(path, prefix="model.moe.", top_k=1, device=device)
    x = torch.randn(9, 16, device=device)
    assert_close(layer(x), stored_ref(layer, x), 1e-5)
    assert torch.equal(layer.w_gate_up[1, :24].cpu(), tensors["model.moe.experts.1.w1.weight"])  # gate rows first
    assert torch.equal(layer.w_down[2].cpu(), tensors["model.moe.experts.2.w2.weight"])


BAD_FILES = [
    ("missing expert", lambda t: t.pop("model.moe.experts.2.w3.weight"), "missing tensor 'model.moe.experts.2.w3.weight'"),
    ("wrong shape", lambda t: t.__setitem__("model.moe.experts.1.w2.weight", torch.randn(16, 23)), r"experts.1.w2.weight' has shape \(16, 23\), expected \(16, 24\)"),
    ("wrong dtype", lambda t: t.__setitem__("model.moe.experts.0.w3.weight", torch.randn(24, 16).half()), "dtype"),
    ("no router", lambda t: t.pop("model.moe.gate.weight"), "missing tensor 'model.moe.gate.weight'"),
]


@pytest.mark.parametrize("name,corrupt,match", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_from_safetensors_bad_file(name, corrupt, match, tmp_path, device):
    t = _small_layer()
    corrupt(t)
    path = tmp_path / "bad.safetensors"
    save_file(t, str(path))
    with pytest.raises(ValueError, match=match):
        onegemm.MoEFFN.from_safetensors(path, prefix="model.moe.", device=device)


def test_from_safetensors_wrong_prefix(device):
    with pytest.raises(ValueError, match="missing tensor 'layers.0.gate.weight'"):
        onegemm.MoEFFN.from_safetensors(STORED_LAYER, prefix="layers.0.", device=device)


# ---- FP8 experts (DeepSeek-V3 format: e4m3 weights, 128x128 scales; 1x128 activations) ----


def test_fp8_flip_steps_mark_only_midpoints():
    """assert_moe_fp8_close's allowance: a value on an FP8 rounding midpoint (to within
    FP8_MIDPOINT_REL) may take either neighbour, so its step counts; others count 0."""
    from onegemm.testing import FP8_MIDPOINT_REL, _fp8_flip_steps

    eps = FP8_MIDPOINT_REL / 4
    # 448 sets the row's scale to 1; then midpoints of normal and subnormal neighbours, and exact values
    row = [448.0, 1.0625, 1.0625 * (1 + eps), 1.0625 * (1 + 4 * FP8_MIDPOINT_REL), 1.03, 1.5 * 2**-9, 2**-9,
           -54.0, 0.0]
    want = [0.0, 0.125, 0.125, 0.0, 0.0, 2**-9, 0.0, 4.0, 0.0]  # -54: between -52 and -56
    h = torch.tensor(row, dtype=torch.float64)[None]
    assert _fp8_flip_steps(h, torch.float8_e4m3fn).tolist() == [want]
    # a scale other than 1: the steps are in h's units
    assert _fp8_flip_steps(h * 3, torch.float8_e4m3fn).tolist() == [[w * 3 for w in want]]


# (T, H, I, E, k, x dtype, extra): H, I not multiples of 128 (partial scale blocks; the up
# half's blocks start after the gate's partial one), a single token, empty experts, foreign ids.
BF16, FP32 = torch.bfloat16, torch.float32
FP8_MOE_CASES = [
    (1, 128, 128, 4, 2, BF16, ""),
    (37, 200, 136, 5, 2, BF16, ""),
    (29, 256, 300, 3, 3, FP32, ""),
    (17, 130, 64, 8, 1, FP32, "foreign ids"),
    (3, 256, 256, 16, 2, BF16, "empty experts"),
]


@pytest.mark.parametrize("T,H,I,E,k,dtype,extra", FP8_MOE_CASES,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-E{c[3]}k{c[4]}-{str(c[5])[6:]}" for c in FP8_MOE_CASES])
def test_moe_ffn_fp8_matches_reference(T, H, I, E, k, dtype, extra, device):
    x, w13, w2, weights, ids, scales, (w13_hp, w2_hp) = fp8_moe_inputs(T, H, I, E, k, dtype, device,
                                                                       bad_ids=extra == "foreign ids")
    y = onegemm.moe_ffn(x, w13, w2, weights, ids, **scales)
    assert y.dtype == dtype and y.shape == (T, H)
    # The FP8 pipeline in float64 (x and the SwiGLU output quantised alike): only the fp32
    # accumulation order and fp8 roundings at block-scale boundaries differ.
    assert_moe_fp8_close(y, x, w13, w2, weights, ids, **scales)
    # ... and against the unquantised layer, DeepSeek's measure.
    assert calc_diff(y, moe_ref(x, w13_hp, w2_hp, weights, ids)) < fp8_layer_diff_bound(y)
    assert torch.equal(onegemm.moe_ffn(x, w13, w2, weights, ids, **scales), y)


def test_moe_ffn_fp8_views_and_empty(device):
    """fp16 x as a transposed view, scales with transposed strides, int64 ids, no tokens."""
    x, w13, w2, weights, ids, scales, _ = fp8_moe_inputs(11, 200, 136, 3, 2, torch.float16, device)
    x = x.t().contiguous().t()
    strided = {k: v.transpose(1, 2).contiguous().transpose(1, 2) for k, v in scales.items()}
    y = onegemm.moe_ffn(x, w13, w2, weights, ids.long(), **strided)
    assert y.dtype == torch.float16
    assert_moe_fp8_close(y, x, w13, w2, weights, ids, **scales)
    empty = onegemm.moe_ffn(x[:0], w13, w2, weights[:0], ids[:0], **scales)
    assert empty.shape == (0, 200) and empty.dtype == torch.float16


def test_moe_ffn_fp8_prequantised_x(device):
    """x quantised by the caller (expert parallelism sends it so): the same bits as moe_ffn
    quantising a bf16 x itself, with the scales outer-dim-major or row-major; bf16 out."""
    x, w13, w2, weights, ids, scales, _ = fp8_moe_inputs(7, 200, 136, 2, 2, torch.bfloat16, device)
    xq, xs = onegemm.quantize_fp8(x)
    y = onegemm.moe_ffn(xq, w13, w2, weights, ids, **scales, x_scale=xs)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, onegemm.moe_ffn(x, w13, w2, weights, ids, **scales))
    assert torch.equal(onegemm.moe_ffn(xq, w13, w2, weights, ids, **scales, x_scale=xs.contiguous()), y)
    empty = onegemm.moe_ffn(xq[:0], w13, w2, weights[:0], ids[:0], **scales, x_scale=xs[:0])
    assert empty.shape == (0, 200) and empty.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"x_scale must be \[T, ceil\(H/128\)\] = \[7, 2\]"):
        onegemm.moe_ffn(xq, w13, w2, weights, ids, **scales, x_scale=xs[:, :1])
    with pytest.raises(TypeError, match=r"x_scale must be of dtype in \(float32\)"):
        onegemm.moe_ffn(xq, w13, w2, weights, ids, **scales, x_scale=xs.bfloat16())
    with pytest.raises(TypeError, match=r"x must be of dtype in \(float8_e4m3fn\)"):  # x_scale with an unquantised x
        onegemm.moe_ffn(x, w13, w2, weights, ids, **scales, x_scale=xs)


def test_quantize_experts_matches_reference(device):
    _, w13, w2, *_ = moe_inputs(1, 200, 136, 3, 1, torch.bfloat16, device)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
    gate_q, gate_s = quantize_experts_ref(w13[:, :136])
    up_q, up_s = quantize_experts_ref(w13[:, 136:])
    assert s13.shape == (3, 4, 2) and s2.shape == (3, 2, 2)
    assert torch.equal(q13.float(), torch.cat([gate_q, up_q], 1).float()) and torch.equal(s13, torch.cat([gate_s, up_s], 1))
    ref_q2, ref_s2 = quantize_experts_ref(w2)
    assert torch.equal(q2.float(), ref_q2.float()) and torch.equal(s2, ref_s2)


def test_stored_fp8_layer_is_the_bf16_layer_quantised():
    bf16, fp8 = load_file(str(STORED_LAYER)), load_file(str(STORED_FP8_LAYER))
    assert STORED_FP8_LAYER.stat().st_size < 4e6
    assert torch.equal(fp8["gate.weight"], bf16["gate.weight"])
    for e in (0, 7):
        for old, new in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            q, s = quantize_fp8_ref(bf16[f"experts.{e}.{old}.weight"], (128, 128))
            assert fp8[f"experts.{e}.{new}.weight"].dtype == torch.float8_e4m3fn
            assert torch.equal(fp8[f"experts.{e}.{new}.weight"].float(), q.float())
            assert torch.equal(fp8[f"experts.{e}.{new}.weight_scale_inv"], s)


@pytest.mark.parametrize("T", [1, 33])
def test_moeffn_stored_fp8_layer(T, device):
    """The FP8 twin against the unquantised float64 layer (the accuracy target) and against
    the float64 FP8 pipeline; with gradients enabled, as a user calls a frozen layer."""
    fp8 = onegemm.MoEFFN.from_safetensors(STORED_FP8_LAYER, top_k=2, device=device)
    bf16 = onegemm.MoEFFN.from_safetensors(STORED_LAYER, top_k=2, device=device)
    assert fp8.w_gate_up.dtype == torch.float8_e4m3fn and fp8.w_gate_up_scale.shape == (8, 8, 2)
    assert not any(p.requires_grad for p in fp8.parameters())
    x = torch.randn(T, 256, device=device).to(torch.bfloat16)
    y = fp8(x)
    with torch.no_grad():
        weights, ids = onegemm.route(fp8.router_logits(x), 2)
    assert calc_diff(y, moe_ref(x, bf16.w_gate_up, bf16.w_down, weights, ids)) < fp8_layer_diff_bound(y)
    assert_moe_fp8_close(y, x, fp8.w_gate_up, fp8.w_down, weights, ids, fp8.w_gate_up_scale, fp8.w_down_scale)


def _fp8_file(tmp_path, I=24):
    """_small_layer under DeepSeek-V3's names with fp8 experts and their weight_scale_inv."""
    t = _renamed(_small_layer(I=I), ("gate_proj", "up_proj", "down_proj"))
    for key in [k for k in t if "experts" in k]:
        t[key], t[key + "_scale_inv"] = quantize_fp8_ref(t[key], (128, 128))
    path = tmp_path / "fp8.safetensors"
    return t, path


def test_from_safetensors_fp8_experts(tmp_path, device):
    t, path = _fp8_file(tmp_path)
    t["model.moe.experts.1.up_proj.weight_scale_inv"] = t["model.moe.experts.1.up_proj.weight_scale_inv"].bfloat16()
    save_file(t, str(path))
    layer = onegemm.MoEFFN.from_safetensors(path, prefix="model.moe.", top_k=2, device=device)
    assert layer.w_gate_up.dtype == torch.float8_e4m3fn and layer.w_gate_up_scale.dtype == torch.float32
    assert torch.equal(layer.w_gate_up[1, 24:].cpu().float(), t["model.moe.experts.1.up_proj.weight"].float())
    assert torch.equal(layer.w_gate_up_scale[2, 1:].cpu(), t["model.moe.experts.2.up_proj.weight_scale_inv"])
    assert torch.equal(layer.w_down_scale[0].cpu(), t["model.moe.experts.0.down_proj.weight_scale_inv"])
    x = torch.randn(9, 16, device=device)
    weights, ids = onegemm.route(layer.router_logits(x).detach(), 2)
    assert_moe_fp8_close(layer(x), x, layer.w_gate_up, layer.w_down, weights, ids, layer.w_gate_up_scale,
                         layer.w_down_scale)


BAD_FP8_FILES = [
    ("no scale", lambda t: t.pop("model.moe.experts.2.down_proj.weight_scale_inv"),
     "missing tensor 'model.moe.experts.2.down_proj.weight_scale_inv'"),
    ("scale shape", lambda t: t.__setitem__("model.moe.experts.1.gate_proj.weight_scale_inv", torch.ones(2, 1)),
     r"experts.1.gate_proj.weight_scale_inv' has shape \(2, 1\), expected \(1, 1\)"),
    ("scale dtype", lambda t: t.__setitem__("model.moe.experts.0.up_proj.weight_scale_inv", torch.ones(1, 1, dtype=torch.int32)),
     "has dtype torch.int32, expected float32, bfloat16 .the 128x128 block scales."),
    ("mixed experts", lambda t: t.__setitem__("model.moe.experts.2.up_proj.weight", torch.randn(24, 16)),
     "experts.2.up_proj.weight' has dtype torch.float32, expected float8_e4m3fn .FP8 experts are e4m3."),
]


@pytest.mark.parametrize("name,corrupt,match", BAD_FP8_FILES, ids=[c[0] for c in BAD_FP8_FILES])
def test_from_safetensors_bad_fp8_file(name, corrupt, match, tmp_path, device):
    t, path = _fp8_file(tmp_path)
    corrupt(t)
    save_file(t, str(path))
    with pytest.raises(ValueError, match=match):
        onegemm.MoEFFN.from_safetensors(path, prefix="model.moe.", device=device)


def test_moe_ffn_fp8_bad_input(device):
    x, w13, w2, weights, ids, scales, (w13_hp, w2_hp) = fp8_moe_inputs(5, 200, 136, 3, 2, torch.bfloat16, device)
    s13, s2 = scales["w_gate_up_scale"], scales["w_down_scale"]
    with pytest.raises(ValueError, match="w_gate_up_scale must be the fp32 128x128 block scales of the fp8 w_gate_up"):
        onegemm.moe_ffn(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="w_down_scale must be the fp32"):
        onegemm.moe_ffn(x, w13, w2, weights, ids, w_gate_up_scale=s13)
    with pytest.raises(ValueError, match=r"w_gate_up_scale must be \[E, 2 \* ceil\(I/128\), ceil\(H/128\)\] = \[3, 4, 2\]"):
        onegemm.moe_ffn(x, w13, w2, weights, ids, w_gate_up_scale=s13[:, :2], w_down_scale=s2)
    with pytest.raises(ValueError, match=r"w_down_scale must be \[E, ceil\(H/128\), ceil\(I/128\)\] = \[3, 2, 2\]"):
        onegemm.moe_ffn(x, w13, w2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2[:, :, :1])
    with pytest.raises(TypeError, match=r"w_gate_up_scale must be of dtype in \(float32\), got torch.bfloat16"):
        onegemm.moe_ffn(x, w13, w2, weights, ids, w_gate_up_scale=s13.bfloat16(), w_down_scale=s2)
    with pytest.raises(TypeError, match=r"w_gate_up must be of dtype in \(float8_e4m3fn\)"):  # scales given with bf16 experts
        onegemm.moe_ffn(x, w13_hp.bfloat16(), w2_hp.bfloat16(), weights, ids, **scales)
    with pytest.raises(TypeError, match=r"w_down must be of dtype in \(float8_e4m3fn\)"):
        onegemm.moe_ffn(x, w13, w2_hp.bfloat16(), weights, ids, **scales)
    with pytest.raises(ValueError, match="x must be free of requires_grad: moe_ffn with fp8 experts has no gradient"):
        onegemm.moe_ffn(x.requires_grad_(), w13, w2, weights, ids, **scales)


# ---- FP8 training (moe_ffn(..., fp8_training=True)) ----

FP8_TRAIN_CASES = [
    # T, H, I, E, k, dtype, extra
    (1, 128, 64, 4, 2, FP32, ""),
    (17, 128, 64, 3, 2, FP32, ""),
    (64, 128, 192, 8, 2, BF16, ""),
    (30, 128, 64, 8, 2, FP32, "empty experts"),
    (40, 256, 128, 4, 3, FP32, "foreign ids"),
]


def _fp8_train_case(T, H, I, E, k, dtype, extra, device):
    x, w13, w2, weights, ids = moe_inputs(T, H, I, E, k, dtype, device)
    if extra == "empty experts":
        ids = ids % (E // 2)  # the upper half of the experts gets no rows
    if extra == "foreign ids":
        ids[::3, 0] = E
        ids[1::4, -1] = -1
    return [t.requires_grad_() for t in (x, w13, w2, weights)], ids


@pytest.mark.parametrize("T,H,I,E,k,dtype,extra", FP8_TRAIN_CASES,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-E{c[3]}k{c[4]}-{str(c[5])[6:]}-{c[6] or 'plain'}"
                              for c in FP8_TRAIN_CASES])
def test_moe_ffn_fp8_training_gradients(T, H, I, E, k, dtype, extra, device):
    """Forward and every gradient against the recipe in float64 (the same operands quantised
    alike). With fp32 x only the accumulation order differs, which moves an fp8 rounding of
    the few values that sit on a rounding boundary (up to ~2e-4 seen); with bf16 x the intermediates
    stored in bf16 round differently under the interpreter (it truncates), and fp8 roundings
    of their quantisation follow: about 2% on 8192 outputs (the FP8 error itself, against
    moe_ref, is about 6%), too noisy for a handful of outputs, so bf16 runs a larger case."""
    leaves, ids = _fp8_train_case(T, H, I, E, k, dtype, extra, device)
    y = onegemm.moe_ffn(*leaves, ids, fp8_training=True)
    assert y.dtype == dtype and y.shape == (T, H)
    dy = torch.randn_like(y)
    y.backward(dy)
    want = moe_fp8_train_ref(*leaves, ids, dy)
    tol = 3e-2 if dtype == BF16 else 1e-3
    for got, like, ref, what in zip((y, *(t.grad for t in leaves)), (y, *leaves), want,
                                    ("y", "dx", "dw_gate_up", "dw_down", "dweights")):
        assert got.dtype == like.dtype, what
        assert_close(got, ref, tol, what)
    # ... and close to the unquantised layer's (the FP8 error, not a wrong layout or scale)
    assert calc_diff(y, moe_ref(*leaves, ids)) < fp8_layer_diff_bound(y)


def test_moe_ffn_fp8_training_is_deterministic(device):
    leaves, ids = _fp8_train_case(33, 128, 64, 4, 2, BF16, "", device)
    dy = torch.randn(33, 128, device=device, dtype=BF16)
    runs = []
    for _ in range(2):
        for t in leaves:
            t.grad = None
        y = onegemm.moe_ffn(*leaves, ids, fp8_training=True)
        y.backward(dy)
        runs.append([y.detach(), *(t.grad for t in leaves)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_moe_ffn_fp8_training_bad_input(device):
    x, w13, w2, weights, ids = moe_inputs(8, 128, 64, 4, 2, BF16, device)
    with pytest.raises(TypeError, match="fp8_training must be a bool"):
        onegemm.moe_ffn(x, w13, w2, weights, ids, fp8_training=1)
    x2, w13_2, w2_2, weights2, ids2 = moe_inputs(8, 96, 64, 4, 2, BF16, device)
    with pytest.raises(ValueError, match="w_gate_up must be \\[E, 2I, H\\] with 2I and H multiples of 128"):
        onegemm.moe_ffn(x2, w13_2, w2_2, weights2, ids2, fp8_training=True)
    x3, w13_3, w2_3, weights3, ids3 = moe_inputs(8, 128, 32, 4, 2, BF16, device)
    with pytest.raises(ValueError, match="w_gate_up must be \\[E, 2I, H\\] with 2I and H multiples of 128"):
        onegemm.moe_ffn(x3, w13_3, w2_3, weights3, ids3, fp8_training=True)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
    with pytest.raises(ValueError, match="fp8_training must be False with fp8 experts"):
        onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2, fp8_training=True)
    y = onegemm.moe_ffn(x, w13.requires_grad_(), w2, weights, ids, fp8_training=True)
    with pytest.raises(ValueError, match="create_graph"):
        (g,) = torch.autograd.grad(y.float().square().sum(), w13, create_graph=True)
        g.sum().backward()


def test_fp8_training_converts_moeffn_layers(device):
    """onegemm.fp8_training switches an MoEFFN's experts to moe_ffn(fp8_training=True), keeps
    its Parameters, and refuses layers whose experts cannot train in FP8 unless filtered out."""
    E, H, I = 4, 128, 64
    gate = torch.randn(E, H, device=device, dtype=BF16)
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(BF16)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(BF16)
    layer = onegemm.MoEFFN(gate, w13, w2, top_k=2)
    params = list(layer.parameters())
    model = onegemm.fp8_training(torch.nn.Sequential(layer))
    assert model[0] is layer and layer.fp8_training and list(layer.parameters()) == params
    assert "fp8_training=True" in repr(layer)
    x = torch.randn(24, H, device=device, dtype=BF16)
    weights, ids = layer.route(x)
    assert torch.equal(layer(x), onegemm.moe_ffn(x, layer.w_gate_up, layer.w_down, weights, ids, fp8_training=True))
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
    fp8_layer = onegemm.MoEFFN(gate, q13, q2, top_k=2, w_gate_up_scale=s13, w_down_scale=s2)
    with pytest.raises(ValueError, match="module must be MoEFFN layers with 16/32-bit experts"):
        onegemm.fp8_training(fp8_layer)
    asked = []
    onegemm.fp8_training(torch.nn.Sequential(fp8_layer), moe_filter_fn=lambda m, fqn: asked.append(fqn) or fqn != "0")
    assert not fp8_layer.fp8_training and asked == ["0"]
    odd = onegemm.MoEFFN(gate[:, :96].contiguous(), w13[:, :, :96].contiguous(), w2[:, :96].contiguous(), top_k=2)
    with pytest.raises(ValueError, match="2I and H multiples of 128"):
        onegemm.fp8_training(odd)


# ---- GPU only ----


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [(4096, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (2048, 4096, 1024, 8, 2)], ids=str)
def test_gpu_moe_ffn_real_sizes(T, H, I, E, k, device):
    x, w_gate_up, w_down, weights, ids = moe_inputs(T, H, I, E, k, torch.bfloat16, device)
    y = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)
    assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), 2 * TOL[torch.bfloat16])
    assert torch.equal(onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids), y)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [(4096, 2048, 768, 128, 8), (1024, 4096, 1024, 8, 2), (8, 2048, 768, 128, 8)],
                         ids=str)
def test_gpu_moe_ffn_fp8_training_real_sizes(T, H, I, E, k, device):
    """Qwen3-30B-A3B and a Mixtral-shaped layer in FP8 training against the recipe in float64;
    at prefill sizes the four FP8 GEMMs run on the Gluon body (the backward's two on the
    experts side by side along K), at 8 tokens (0.5 rows per expert) on core's Triton body."""
    leaves, ids = _fp8_train_case(T, H, I, E, k, BF16, "", device)
    dy = torch.randn(T, H, device=device, dtype=BF16)
    out = []
    kernels = launched(lambda: out.append(onegemm.moe_ffn(*leaves, ids, fp8_training=True)) or out[0].backward(dy))
    want = moe_fp8_train_ref(*leaves, ids, dy)
    for got, ref, what in zip((out[0], *(t.grad for t in leaves)), want, ("y", "dx", "dw_gate_up", "dw_down", "dweights")):
        assert_close(got, ref, 1e-2, what)
    gluon = sum(x["family"] == "blockscaled_wgmma" for x in kernels)
    assert gluon == (4 if T * k / E >= grouped_configs.WGMMA_MIN_GROUP_ROWS else 0), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_moeffn_cuda_graph(fp8, device):
    """The stored layer (or its FP8 twin) captured in a CUDA graph and replayed on new tokens."""
    layer = onegemm.MoEFFN.from_safetensors(STORED_FP8_LAYER if fp8 else STORED_LAYER, device=device)
    x = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    graph, y = capture(lambda: layer(x))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    if not fp8:
        assert_close(y, stored_ref(layer, x), 2 * TOL[torch.bfloat16])
        return
    with torch.no_grad():
        weights, ids = onegemm.route(layer.router_logits(x), 2)
    assert_moe_fp8_close(y, x, layer.w_gate_up, layer.w_down, weights, ids, layer.w_gate_up_scale,
                         layer.w_down_scale)


@pytest.mark.parametrize("use_grouped_mm", [False, True])
def test_moe_ffn_torch_peer_matches_reference(use_grouped_mm, device):
    """The plain-torch peer (benchmarks, python -m onegemm) computes the same function, in
    torch alone: no onegemm kernel runs (a peer running onegemm would measure onegemm)."""
    dtype = torch.bfloat16 if use_grouped_mm else torch.float64
    x, w_gate_up, w_down, weights, ids = moe_inputs(50, 32, 48, 6, 2, dtype, device)
    ids = ids.long()
    ids[0, 1] = 6  # an id outside [0, E): contributes nothing
    ids[3, 0] = 2**32 + 1  # however wide (range-checked before any narrowing)
    out = []
    assert launched(lambda: out.append(moe_ffn_torch(x, w_gate_up, w_down, weights, ids, use_grouped_mm=use_grouped_mm))) == []
    (y,) = out
    assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), 1e-12 if dtype == torch.float64 else 2e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moe_ffn_decode_is_three_launches(fp8, device):
    """A decode call on core's Triton body: the prep (sort, and x's fp8 rows), GEMM1 with
    SwiGLU, GEMM2 with the weighted top-k combine; other ranks' ids included."""
    args = (fp8_moe_inputs(4, 256, 128, 8, 2, torch.bfloat16, device, bad_ids=True) if fp8 else
            moe_inputs(4, 64, 32, 8, 2, torch.bfloat16, device))
    scales = args[5] if fp8 else {}
    onegemm.moe_ffn(*args[:5], **scales)  # the record
    out = []
    kernels = launched(lambda: out.append(onegemm.moe_ffn(*args[:5], **scales)))
    assert [x["family"] for x in kernels] == ["sort", "ragged", "ragged"]
    if fp8:
        assert_moe_fp8_close(out[0], *args[:5], **scales)
    else:
        assert_close(out[0], moe_ref(*args[:5]), TOL[torch.bfloat16])


@pytest.mark.parametrize("bad_id", [2**32 + 1, 2**40, -(2**33), -1])
def test_int64_ids_outside_the_experts_contribute_nothing(bad_id, device):
    """An int64 id outside [0, E) contributes nothing, however large: it must be range-checked
    in its own width (narrowed to int32 first, 2**32 + 1 would become expert 1)."""
    T, H, I, E, k = 9, 32, 16, 4, 2
    x = torch.randn(T, H, device=device)
    w_gate_up = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w_down = torch.randn(E, H, I, device=device) * I**-0.5
    ids = torch.randint(0, E, (T, k), device=device, dtype=torch.int64)
    ids[2, 0] = bad_id
    ids[5, 1] = bad_id
    weights = torch.rand(T, k, device=device)
    out = onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)
    assert_close(out, moe_ref(x, w_gate_up, w_down, weights, ids), TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k", [(4096, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (1, 7168, 2048, 32, 8),
                                       (333, 4096, 1000, 8, 2)], ids=str)
def test_gpu_moe_ffn_fp8_real_sizes(T, H, I, E, k, device):
    """Qwen3-30B-A3B prefill and decode, DeepSeek-V3's EP8 experts at one token, and an I that
    is not a multiple of 128, against the float64 FP8 pipeline and the unquantised layer."""
    x, w13, w2, weights, ids, scales, (w13_hp, w2_hp) = fp8_moe_inputs(T, H, I, E, k, torch.bfloat16, device)
    y = onegemm.moe_ffn(x, w13, w2, weights, ids, **scales)
    assert_moe_fp8_close(y, x, w13, w2, weights, ids, **scales)
    assert calc_diff(y, moe_ref(x, w13_hp, w2_hp, weights, ids)) < fp8_layer_diff_bound(y)
    assert torch.equal(onegemm.moe_ffn(x, w13, w2, weights, ids, **scales), y)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_moe_ffn_autotunes_on_its_own_routing(fp8, tmp_path, monkeypatch, device):
    """Autotuning at a decode size (no table: shipped tables off, an empty cache) times GEMM1
    and GEMM2 on this call's routing: on a workspace of stale memory GEMM2's trials scattered
    rows to garbage indices (an illegal address on the GPU). Freed int32 junk is the stale memory."""
    monkeypatch.setenv("ONEGEMM_CACHE_DIR", str(tmp_path))
    T, H, I, E, k = 1, 2048, 768, 128, 8
    if fp8:
        x, w13, w2, weights, ids, scales, _ = fp8_moe_inputs(T, H, I, E, k, torch.bfloat16, device)
    else:
        x, w13, w2, weights, ids = moe_inputs(T, H, I, E, k, torch.bfloat16, device)
        scales = {}
    junk = [torch.full((n,), 2**30, dtype=torch.int32, device=device) for n in (256, 4096, 65536, 1 << 20) for _ in range(8)]
    del junk
    reload_tables(shipped=False)
    try:
        with onegemm.autotune():
            y = onegemm.moe_ffn(x, w13, w2, weights, ids, **scales)
        torch.cuda.synchronize()
    finally:
        reload_tables()
    if fp8:
        assert_moe_fp8_close(y, x, w13, w2, weights, ids, **scales)
    else:
        assert_close(y, moe_ref(x, w13, w2, weights, ids), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_moe_ffn_fp8_non_finite(device):
    """A token holding inf or NaN gives non-finite output rows (inf scale -> NaN), the others
    stay exact; the interpreter casts NaN to fp8 wrongly, so this runs on the GPU only."""
    x, w13, w2, weights, ids, scales, _ = fp8_moe_inputs(16, 256, 256, 4, 2, torch.bfloat16, device)
    x[3, 7] = float("nan")
    x[9, 100] = float("inf")
    y = onegemm.moe_ffn(x, w13, w2, weights, ids, **scales)
    bad = torch.zeros(16, dtype=torch.bool, device=device)
    bad[[3, 9]] = True
    assert not torch.isfinite(y[bad]).any(dim=1).any()
    assert torch.isfinite(y[~bad]).all()
    assert_moe_fp8_close(y[~bad], x[~bad], w13, w2, weights[~bad], ids[~bad], **scales)
