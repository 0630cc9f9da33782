"""INT4 weight-only experts (compressed-tensors' symmetric pack-quantized format): the quantiser
and its inverse against a float64 decode written here, grouped_matmul 2D x 3D and moe_ffn /
MoEFFN on INT4 experts and linear_4bit against float64 of the dequantised weights, both ways the packed bytes
are read (pointers, descriptors), and what is refused."""

import pytest
import torch

import onegemm
from helpers import int4_experts, mxfp4_experts, offs_of
from onegemm.blockscaled.quantize import dequantize_int4, quantize_int4, quantize_mxfp4
from onegemm.testing import (TOL, assert_close, grouped_mm_ref, int4_dequantize_ref, assert_layer_close_to_twin, moe_ref,
                             mxfp4_dequantize_ref, mxfp4_quantize_ref)

# ---- the format


def test_int4_dequantize_ref_decodes_every_code(device):
    """Each of the 16 codes at each of the 8 positions of a word: value j in bits 4j..4j+3 as
    value + 8 (the reference every kernel is checked against)."""
    codes = torch.arange(16, device=device).repeat(4)[torch.randperm(64, device=device)].view(8, 8)
    words = (codes.long() << torch.arange(0, 32, 4, device=device)).sum(-1)
    packed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(1, 8)  # one row, K = 64
    scales = torch.tensor([[0.5, -3.0]], device=device, dtype=torch.float64)
    got = int4_dequantize_ref(packed, scales)
    expected = (codes.flatten().double() - 8) * torch.tensor([0.5] * 32 + [-3.0] * 32, device=device).double()
    assert torch.equal(got[0], expected)


@pytest.mark.parametrize("group", [32, 128])
def test_quantize_int4_is_the_symmetric_rule(group, device):
    """scale = amax / 7.5 rounded to the weights' dtype; codes round(w / scale) (ties to even)
    clamped to -8..7; an all-zero group has scale 1; dequantize_int4 is the reference decode."""
    w = (torch.randn(3, 5, 2 * group, device=device) * 0.02).to(torch.bfloat16)
    w[0, 0, :group] = 0
    w[1, 2, 3] = w[1, 2, :group].abs().max() * 1.0001  # the group's amax lands on code 7 (-7.5 rounds to -8)
    q, s = quantize_int4(w, group)
    assert q.dtype == torch.int32 and q.shape == (3, 5, 2 * group // 8)
    assert s.dtype == torch.bfloat16 and s.shape == (3, 5, 2)
    amax = w.float().unflatten(-1, (2, group)).abs().amax(-1)
    assert torch.equal(s, torch.where(amax > 0, amax / 7.5, 1.0).to(torch.bfloat16))
    codes = torch.round(w.float().unflatten(-1, (2, group)) / s.float()[..., None]).clamp(-8, 7).flatten(-2)
    decoded = int4_dequantize_ref(q, s)
    assert torch.equal(decoded, (codes.double().unflatten(-1, (2, group)) * s.double()[..., None]).flatten(-2))
    assert torch.equal(dequantize_int4(q, s, torch.float32).double(), decoded)
    assert (int4_dequantize_ref(q, s)[0, 0, :group] == 0).all() and s[0, 0, 0] == 1


@pytest.mark.parametrize("group,scale_dtype", [(32, torch.bfloat16), (128, torch.float16)])
def test_quantize_int4_zero_points_are_the_min_max_rule(group, scale_dtype, device):
    """zero_point=True (GPTQ's and AWQ's rule): scale = (max - min) / 15 of the group and 0,
    rounded to the scale dtype; zero = round(-min / scale); codes round(w / scale) + zero in
    0..15; the int32 scale words keep both exactly; a constant zero group has scale 1, zero 0."""
    w = (torch.randn(3, 5, 2 * group, device=device) * 0.02 + 0.01).to(torch.bfloat16)
    w[0, 0, :group] = 0
    q, sz = quantize_int4(w, group, scale_dtype, zero_point=True)
    assert q.dtype == sz.dtype == torch.int32 and sz.shape == (3, 5, 2)
    x = w.float().unflatten(-1, (2, group))
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    scale = torch.where(hi > lo, (hi - lo) / 15, 1.0).to(scale_dtype)
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    s, z = onegemm.unpack_int4_zeros(sz)
    assert torch.equal(s.to(scale_dtype), scale) and torch.equal(s, scale.float()) and torch.equal(z.float(), zero)
    assert torch.equal(onegemm.pack_int4_zeros(scale, z), sz)
    codes = (torch.round(x / scale.float()[..., None]) + zero[..., None]).clamp(0, 15)
    want = ((codes - zero[..., None]).double() * scale.double()[..., None]).flatten(-2)
    decoded = int4_dequantize_ref(q, sz)
    assert torch.equal(decoded, want) and torch.equal(dequantize_int4(q, sz, torch.float32).double(), decoded)
    assert s[0, 0, 0] == 1 and z[0, 0, 0] == 0 and (decoded[0, 0, :group] == 0).all()
    # one-sided groups use all 16 codes where the symmetric rule uses 8: a smaller error
    sym = int4_dequantize_ref(*quantize_int4(w, group, scale_dtype))
    assert (decoded - w.double()).norm() < (sym - w.double()).norm()


def test_pack_int4_zeros_refuses(device):
    s = torch.rand(4, 2, device=device).to(torch.bfloat16)
    with pytest.raises(TypeError, match="scale must be"):
        onegemm.pack_int4_zeros(s.float(), torch.zeros(4, 2, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="zero must be integers in 0..15"):
        onegemm.pack_int4_zeros(s, torch.full((4, 2), 16, device=device))
    with pytest.raises(ValueError, match="zero must be"):
        onegemm.pack_int4_zeros(s, torch.zeros(4, 3, dtype=torch.uint8, device=device))
    with pytest.raises(TypeError, match="scale_dtype must be bfloat16 or float16 with zero_point=True"):
        quantize_int4(torch.randn(4, 64, device=device), 32, torch.float32, zero_point=True)


@pytest.mark.parametrize("quantize", [quantize_int4, quantize_mxfp4], ids=["int4", "mxfp4"])
def test_quantizers_run_on_any_device(quantize):
    """The 4-bit quantisers are torch ops: checkpoints are written from CPU (here: meta) tensors
    on a GPU machine too, where core's kernels would refuse them."""
    q, s = quantize(torch.empty(5, 64, device="meta", dtype=torch.bfloat16))
    assert q.device.type == s.device.type == "meta" and q.shape[:-1] == s.shape[:-1] == (5,)


def test_quantize_int4_refuses(device):
    w = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="group must be a power of two >= 32"):
        quantize_int4(w, 48)
    with pytest.raises(ValueError, match="multiple of group"):
        quantize_int4(w[:, :48], 32)
    with pytest.raises(TypeError, match="w must be"):
        quantize_int4(w.to(torch.int32), 32)
    with pytest.raises(TypeError, match="scale_dtype must be"):
        quantize_int4(w, 32, torch.int8)


# ---- grouped_matmul with INT4 experts

# (group sizes, N, K, group, a dtype, scale dtype, bias and activation): empty groups, 1, 17
# and 127 rows; K not a multiple of the 64-wide K block; groups longer than the K block
INT4_CASES = [
    pytest.param([5, 0, 12], 40, 96, 32, torch.bfloat16, torch.bfloat16, False, id="empty-group-g32"),
    pytest.param([1, 17, 127], 33, 256, 128, torch.bfloat16, torch.bfloat16, True, id="odd-rows-g128-bias-gelu"),
    pytest.param([30, 2], 64, 512, 256, torch.float16, torch.float32, False, id="fp16-fp32-scales-g256"),
    pytest.param([7, 0, 33], 48, 192, 64, torch.bfloat16, "zero", True, id="zero-points-g64-bias-gelu"),
    pytest.param([1, 20], 40, 256, 128, torch.float16, "zero", False, id="zero-points-fp16-g128"),
]
INT4_FLAVOURED = [pytest.param(*case.values, tma, id=f"{case.id}-{name}") for case in INT4_CASES
                  for tma, name in ((None, "auto"), (False, "pointers"), (True, "tma"))]


@pytest.mark.parametrize("sizes,N,K,group,dtype,scale_dtype,with_bias,tma", INT4_FLAVOURED)
def test_grouped_matmul_int4_matches_reference(sizes, N, K, group, dtype, scale_dtype, with_bias, tma, device):
    G = len(sizes)
    b, s, b_ref = int4_experts(G, N, K, group, device, scale_dtype)
    a = torch.randn(sum(sizes) + 3, K, device=device).to(dtype)  # 3 rows past offs[-1]
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    bias = torch.randn(G, N, device=device).to(dtype) if with_bias else None
    act = "gelu" if with_bias else None
    out = onegemm.grouped_matmul(a, b, offs, scale_b=s, bias=bias, activation=act, tma=tma)
    assert out.dtype == dtype and out.shape == (a.shape[0], N)
    # the weights dequantised to a's dtype, as the kernel feeds them to the MMA
    assert_close(out, grouped_mm_ref(a.double(), b_ref.to(dtype).double(), offs, bias, act), TOL[dtype])
    assert (out[sum(sizes):] == 0).all()
    assert torch.equal(onegemm.grouped_matmul(a, b, offs, scale_b=s, bias=bias, activation=act, tma=tma), out)


def test_grouped_matmul_int4_gradients(device):
    """The weights are frozen; a gets its gradient (dx through a 4-bit base) against float64
    autograd of the dequantised experts."""
    G, N, K, sizes = 3, 40, 128, [5, 0, 12]
    b, s, b_ref = int4_experts(G, N, K, 64, device)
    a = torch.randn(sum(sizes), K, device=device).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    out = onegemm.grouped_matmul(a, b, offs, scale_b=s)
    dy = torch.randn_like(out)
    out.backward(dy)
    a64 = a.detach().double().requires_grad_()
    grouped_mm_ref(a64, b_ref.to(torch.bfloat16).double(), offs).backward(dy.double())
    assert_close(a.grad, a64.grad, TOL[torch.bfloat16])


def test_grouped_matmul_int4_under_torch_compile(device):
    """The registered op's fake takes an INT4 b (int32) and its scales: a fullgraph compile
    gives the eager result bit for bit; so does linear_4bit's."""
    b, s, _ = int4_experts(2, 16, 128, 64, device)
    a = torch.randn(8, 128, device=device, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
    compiled = torch.compile(lambda a: onegemm.grouped_matmul(a, b, offs, scale_b=s), fullgraph=True)
    assert torch.equal(compiled(a), onegemm.grouped_matmul(a, b, offs, scale_b=s))
    w, ws = b[0].t(), s[0].t()  # one expert as stored: [N, K/8], [N, K/64]
    linear = torch.compile(lambda a: onegemm.linear_4bit(a, w, ws), fullgraph=True)
    assert torch.equal(linear(a), onegemm.linear_4bit(a, w, ws))


INT4_BAD = [
    (lambda a, b, s: dict(b=b.contiguous()), ValueError, "INT4 b \\[G, K / 8, N\\] with unit stride along K / 8"),
    (lambda a, b, s: dict(scale_b=s[:, :3]), ValueError, "power of two >= 32 dividing K"),
    (lambda a, b, s: dict(scale_b=None), ValueError, "scale_b must be b's group scales"),
    (lambda a, b, s: dict(scale_b=s.to(torch.int8)), TypeError, "scale_b"),
    (lambda a, b, s: dict(scale_a=torch.ones(a.shape[0], 1)), ValueError, "scale_a must be None with an INT4 b"),
    (lambda a, b, s: dict(a=a[:, :64]), ValueError, "INT4 \\[G, K / 8, N\\] with K = 64"),
    (lambda a, b, s: dict(a=a.float()), TypeError, "a must be bfloat16 or float16 with an INT4 b"),
]


@pytest.mark.parametrize("change,error,match", INT4_BAD, ids=[m[:30] for _, _, m in INT4_BAD])
def test_grouped_matmul_int4_refuses(change, error, match, device):
    b, s, _ = int4_experts(2, 16, 128, 32, device)
    a = torch.randn(8, 128, device=device, dtype=torch.bfloat16)
    args = dict(a=a, b=b, offs=torch.tensor([4, 8], device=device, dtype=torch.int32), scale_b=s)
    args.update(change(a, b, s))
    with pytest.raises(error, match=match):
        onegemm.grouped_matmul(args.pop("a"), args.pop("b"), args.pop("offs"), **args)


# ---- moe_ffn and MoEFFN with INT4 experts

def _int4_moe(T, H, I, E, k, groups, dtype, device, foreign=False):
    """x, INT4 experts (gate rows then up rows) with their scales (GEMM1's and GEMM2's groups;
    "z<group>": with zero points),
    routing of random logits (``foreign``: ids of experts on other ranks), and the experts
    decoded in float64."""
    def quantize(w, group):  # "z<group>": asymmetric groups, off-centre weights
        if isinstance(group, str):
            return quantize_int4(w + w.std(), int(group[1:]), dtype, zero_point=True)
        return quantize_int4(w, group, dtype)

    q13, s13 = quantize(torch.randn(E, 2 * I, H, device=device) * H**-0.5, groups[0])
    q2, s2 = quantize(torch.randn(E, H, I, device=device) * I**-0.5, groups[1])
    x = torch.randn(T, H, device=device).to(dtype)
    weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
    if foreign:
        ids[::3, 0] = E + 1
        ids[1::4, -1] = -1
    decoded = (int4_dequantize_ref(q13, s13), int4_dequantize_ref(q2, s2))
    return x, q13, q2, dict(w_gate_up_scale=s13, w_down_scale=s2), weights, ids, decoded


# (T, H, I, E, k, (GEMM1's group, GEMM2's), x dtype, foreign ids): one token; groups longer
# than a K block and unequal; more experts than tokens (empty experts)
INT4_MOE_CASES = [
    pytest.param(1, 64, 32, 4, 2, (32, 32), torch.bfloat16, False, id="T1"),
    pytest.param(37, 256, 160, 6, 2, (128, 32), torch.bfloat16, True, id="T37-foreign-ids-g128-g32"),
    pytest.param(5, 128, 64, 16, 4, (64, 64), torch.float16, False, id="fp16-empty-experts"),
    pytest.param(9, 128, 96, 4, 2, ("z64", "z32"), torch.bfloat16, False, id="zero-points-g64-g32"),
]


@pytest.mark.parametrize("T,H,I,E,k,groups,dtype,foreign", INT4_MOE_CASES)
def test_moe_ffn_int4_matches_reference(T, H, I, E, k, groups, dtype, foreign, w4_flavour, device):
    x, q13, q2, scales, weights, ids, (w13, w2) = _int4_moe(T, H, I, E, k, groups, dtype, device, foreign)
    y = onegemm.moe_ffn(x, q13, q2, weights, ids, **scales)
    assert y.dtype == dtype and y.shape == (T, H)
    # the experts as the kernels feed them (x's dtype); h is stored in x's dtype: twice the bound
    assert_close(y, moe_ref(x, w13.to(dtype), w2.to(dtype), weights, ids), 2 * TOL[dtype])
    assert torch.equal(onegemm.moe_ffn(x, q13, q2, weights, ids, **scales), y)


INT4_MOE_BAD = [
    (lambda x, q13, q2, s: dict(w_down_scale=None), ValueError, "w_down_scale must be the group scales"),
    (lambda x, q13, q2, s: dict(w_down=q2.view(torch.float4_e2m1fn_x2)), TypeError, "w_down must be"),
    (lambda x, q13, q2, s: dict(w_gate_up_scale=torch.cat([s["w_gate_up_scale"]] * 3, 2)[:, :, :3]), ValueError,
     "power of two >= 32"),
    (lambda x, q13, q2, s: dict(w_gate_up=q13.transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "unit stride along the packed dimension"),
    (lambda x, q13, q2, s: dict(x_scale=torch.ones(x.shape[0], 1)), ValueError, "x_scale must be None with INT4"),
]


@pytest.mark.parametrize("change,error,match", INT4_MOE_BAD, ids=[m[:30] for _, _, m in INT4_MOE_BAD])
def test_moe_ffn_int4_refuses(change, error, match, device):
    x, q13, q2, scales, weights, ids, _ = _int4_moe(4, 64, 32, 4, 2, (32, 32), torch.bfloat16, device)
    args = dict(x=x, w_gate_up=q13, w_down=q2, **scales)
    args.update(change(x, q13, q2, scales))
    with pytest.raises(error, match=match):
        onegemm.moe_ffn(args.pop("x"), args.pop("w_gate_up"), args.pop("w_down"), weights, ids, **args)


def test_moeffn_int4_matches_its_dequantised_twin(device):
    """MoEFFN on INT4 experts against float64 of its twin on the dequantised experts (rows
    whose routing differs by a near tie are left out)."""
    E, H, I, k = 6, 64, 96, 2
    x, q13, q2, scales, _, _, (w13, w2) = _int4_moe(9, H, I, E, k, (32, 32), torch.bfloat16, device)
    gate = torch.randn(E, H, device=device).to(torch.bfloat16)
    layer = onegemm.MoEFFN(gate, q13, q2, top_k=k, **scales)
    twin = onegemm.MoEFFN(gate, w13.to(torch.bfloat16), w2.to(torch.bfloat16), top_k=k)
    assert "intermediate=96" in repr(layer)
    assert not any(p.requires_grad for p in (layer.w_gate_up, layer.w_down, layer.gate_weight))
    # resident weights = the packed words and scales as given: no copy, no dequantised twin
    held = (layer.w_gate_up, layer.w_down, layer.w_gate_up_scale, layer.w_down_scale)
    given = (q13, q2, scales["w_gate_up_scale"], scales["w_down_scale"])
    assert all(h.data_ptr() == g.data_ptr() and h.dtype == g.dtype for h, g in zip(held, given))
    assert_layer_close_to_twin(layer, twin, x, 2 * TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="INT4 experts"):
        layer.check_fp8_training()


def test_quantize_experts_int4(device):
    """quantize_experts(format="int4") is quantize_int4 per matrix, and moe_ffn runs it."""
    E, H, I, T, k = 4, 128, 64, 6, 2
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2, format="int4", group=64)
    for (q, s), w in (((q13, s13), w13), ((q2, s2), w2)):
        q_ref, s_ref = quantize_int4(w, 64)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    x = torch.randn(T, H, device=device).to(torch.bfloat16)
    weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
    y = onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2)
    ref = moe_ref(x, int4_dequantize_ref(q13, s13).to(torch.bfloat16), int4_dequantize_ref(q2, s2).to(torch.bfloat16),
                  weights, ids)
    assert_close(y, ref, 2 * TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="multiples of group \\(64\\)"):
        onegemm.quantize_experts(w13[:, :, :96], w2[:, :96], format="int4", group=64)


# ---- split K (an autotuning candidate at decode): 4-bit K blocks dealt to splits

# (format, splits, b read through a descriptor): 2 and 3 splits of 5 K blocks, 8 (empty splits)
W4_SPLITS = [(fmt, split, tma) for fmt in ("mxfp4", "int4") for split, tma in ((2, True), (3, False), (8, True))]


@pytest.mark.parametrize("fmt,split,tma", W4_SPLITS)
def test_grouped_matmul_4bit_split_k(fmt, split, tma, device):
    """A 4-bit b with SPLIT_K: each split decodes its own K blocks' packed bytes and scales, the
    partials meet in split order (bitwise reruns); an empty group, 1 and 3 rows, rows past
    offs[-1] zero."""
    sizes, N, K = [1, 0, 3], 40, 320
    G = len(sizes)
    w4, s4, b_ref = int4_experts(G, N, K, 32, device) if fmt == "int4" else mxfp4_experts(G, N, K, device)
    a = torch.randn(sum(sizes) + 2, K, device=device).to(torch.bfloat16)
    offs = offs_of(sizes, device)
    config = onegemm.core.configs.with_meta(onegemm.core.configs.cfg(16, 32, 64, 4, 1, group_m=1), SPLIT_K=split)
    out = onegemm.grouped_matmul(a, w4, offs, scale_b=s4, config=config, tma=tma)
    assert_close(out, grouped_mm_ref(a.double(), b_ref, offs), TOL[torch.bfloat16])
    assert (out[sum(sizes):] == 0).all()
    assert torch.equal(onegemm.grouped_matmul(a, w4, offs, scale_b=s4, config=config, tma=tma), out)


# ---- linear_4bit: a dense Linear with a 4-bit weight (one group of the same GEMM)

@pytest.mark.parametrize("fmt", ["int4", "int4-zero-points", "mxfp4"])
def test_linear_4bit_matches_reference(fmt, device):
    """x [2, 17, K] @ W.T + bias with W as stored, against float64 of the decoded weight; x's
    gradient (the backward dequantises W, zero points too) against float64 autograd."""
    N, K = 48, 256
    w = torch.randn(N, K, device=device) * K**-0.5
    if fmt.startswith("int4"):
        zero = fmt != "int4"
        q, s = quantize_int4(w + zero * K**-0.5, 128, torch.bfloat16, zero_point=zero)
        decoded = int4_dequantize_ref(q, s)
    else:
        blocks, scales = mxfp4_quantize_ref(w)
        q, s = blocks.flatten(-2).view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e8m0fnu)
        decoded = mxfp4_dequantize_ref(blocks, scales)
    x = torch.randn(2, 17, K, device=device).to(torch.bfloat16).requires_grad_()
    bias = torch.randn(N, device=device).to(torch.bfloat16)
    out = onegemm.linear_4bit(x, q, s, bias, activation="gelu")
    assert out.shape == (2, 17, N) and out.dtype == torch.bfloat16
    x64 = x.detach().double().requires_grad_()
    ref = torch.nn.functional.gelu(x64 @ decoded.to(torch.bfloat16).double().T + bias.double())
    assert_close(out, ref, TOL[torch.bfloat16])
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert_close(x.grad, x64.grad, TOL[torch.bfloat16])


LINEAR_4BIT_BAD = [
    (lambda x, q, s: dict(x=x.float()), TypeError, "x must be"),
    (lambda x, q, s: dict(weight=q.float()), TypeError, "weight must be a 4-bit weight"),
    (lambda x, q, s: dict(x=x[..., :128]), ValueError, "weight must be INT4 \\[out_features, 128 / 8\\]"),
    (lambda x, q, s: dict(weight=q.t().contiguous().t()), ValueError, "weight must be an INT4 weight with unit stride"),
    (lambda x, q, s: dict(weight_scale=s[:5]), ValueError, "weight_scale must be \\[48, K / group\\]"),
    (lambda x, q, s: dict(bias=torch.zeros(3)), ValueError, "bias"),
]


@pytest.mark.parametrize("change,error,match", LINEAR_4BIT_BAD, ids=[m[:30] for _, _, m in LINEAR_4BIT_BAD])
def test_linear_4bit_refuses(change, error, match, device):
    q, s = quantize_int4(torch.randn(48, 256, device=device), 32)
    args = dict(x=torch.randn(3, 256, device=device, dtype=torch.bfloat16), weight=q, weight_scale=s, bias=None)
    args.update(change(args["x"], q, s))
    with pytest.raises(error, match=match):
        onegemm.linear_4bit(args.pop("x"), args.pop("weight"), args.pop("weight_scale"), args.pop("bias"))
