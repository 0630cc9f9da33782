"""MXFP4 experts. The reference codec in onegemm.testing (what the kernels are checked against):
every byte and every scale decoded as the OCP MX format and gpt-oss's checkpoints define them,
against a table written here and against transformers' own decoder; the quantiser's scale
rules, ties, clamping and sign of zero; a round trip of MXFP4 values. Then grouped_matmul with
MXFP4 b (weight-only) against float64 of the dequantised experts, its gradients for a and bias,
and what it refuses; moe_ffn, MoEFFN and quantize_experts with MXFP4 experts."""

import math

import pytest
import torch

import onegemm
from helpers import mxfp4_experts
from onegemm.testing import (
    E2M1_MAGNITUDES,
    MXFP4_BLOCK,
    TOL,
    assert_close,
    assert_layer_close_to_twin,
    grouped_mm_ref,
    moe_ref,
    mxfp4_dequantize_ref,
    mxfp4_quantize_ref,
)

# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (0 or 0.5)
E2M1 = {code: (-1.0 if code & 8 else 1.0) * ((code & 1) * 0.5 if not code & 6 else
                                             2.0 ** (((code >> 1) & 3) - 1) * (1 + (code & 1) / 2))
        for code in range(16)}


def test_e2m1_magnitudes_follow_the_bit_layout():
    assert [E2M1[c] for c in range(8)] == list(E2M1_MAGNITUDES)
    assert [E2M1[c] for c in range(8, 16)] == [-v for v in E2M1_MAGNITUDES]


@pytest.mark.parametrize("scale", [0, 1, 100, 126, 127, 128, 200, 254, 255])
def test_dequantize_every_byte_at_each_scale(scale):
    """All 256 bytes (every pair of codes, the lower nibble first along K) at one e8m0 scale."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # 16 blocks of 32 values
    scales = torch.full((16,), scale, dtype=torch.uint8)
    out = mxfp4_dequantize_ref(blocks, scales).reshape(256, 2)
    if scale == 255:
        assert out.isnan().all()
        return
    factor = 2.0 ** (scale - 127)
    want = torch.tensor([[E2M1[b & 0xF] * factor, E2M1[b >> 4] * factor] for b in range(256)], dtype=torch.float64)
    assert torch.equal(out, want)
    assert out.dtype == torch.float64


def test_dequantize_matches_transformers_decoder():
    """transformers' gpt-oss decoder (convert_moe_packed_tensors: [E, rows, K/32, 16] blocks ->
    [E, K, rows] weights) on random experts, every code and most scales."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    E, rows, nblocks = 3, 17, 5
    blocks = torch.randint(0, 256, (E, rows, nblocks, 16), dtype=torch.uint8)
    scales = torch.randint(100, 160, (E, rows, nblocks), dtype=torch.uint8)
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    ours = mxfp4_dequantize_ref(blocks, scales)
    assert ours.shape == (E, rows, nblocks * MXFP4_BLOCK)
    assert torch.equal(ours, theirs.double())


def _random_mxfp4(shape, generator=None):
    """Random blocks whose every block holds a largest magnitude code (6.0 or 4.0 times its
    scale), so that the floor rule finds the scale again."""
    blocks = torch.randint(0, 256, shape + (16,), dtype=torch.uint8, generator=generator)
    top = torch.where(torch.rand(shape, generator=generator) < 0.5, 7, 6).to(torch.uint8)  # 6.0 or 4.0
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | top  # the block's first value
    scales = torch.randint(1, 254, shape, dtype=torch.uint8, generator=generator)
    return blocks, scales


def test_quantize_recovers_mxfp4_values_bit_for_bit():
    blocks, scales = _random_mxfp4((4, 9, 3))
    w = mxfp4_dequantize_ref(blocks, scales)
    q_blocks, q_scales = mxfp4_quantize_ref(w)
    assert torch.equal(q_scales, scales)
    assert torch.equal(q_blocks, blocks)  # -0.0 keeps its code 8, +0.0 its code 0


# (value / scale, the code it takes): ties go to the even code; past 6 it clamps
ROUNDING_CASES = [(0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (5.01, 7),
                  (6.0, 7), (7.9, 7), (-0.25, 8), (-1.25, 10), (-5.0, 14), (-0.0, 8), (0.0, 0)]


@pytest.mark.parametrize("value,code", ROUNDING_CASES, ids=[f"{v}" for v, _ in ROUNDING_CASES])
def test_quantize_rounds_to_nearest_even_and_clamps(value, code):
    """A block whose largest magnitude is 4 (floor rule: scale 2^0) holding ``value``."""
    w = torch.zeros(MXFP4_BLOCK, dtype=torch.float64)
    w[0], w[1] = 4.0, value  # every value here is below 8: the block's scale stays 2^0
    blocks, scales = mxfp4_quantize_ref(w[None])
    assert scales.tolist() == [[127]]
    assert int(blocks[0, 0, 0]) >> 4 == code, (value, int(blocks[0, 0, 0]) >> 4)


def test_quantize_scale_rules():
    """floor: 2^(floor(log2 amax) - 2), so 7 clamps to 6; ceil: 2^ceil(log2(amax / 6)), so
    nothing clamps; an all-zero block takes s = 0; tiny and huge blocks saturate s at 0 / 254."""
    w = torch.zeros(5, MXFP4_BLOCK, dtype=torch.float64)
    w[0, 0] = 7.0
    w[1, 0] = 6.0
    w[3, 0] = 2.0 ** -140
    w[4, 0] = 2.0 ** 130
    floor_b, floor_s = mxfp4_quantize_ref(w)
    ceil_b, ceil_s = mxfp4_quantize_ref(w, scale_rounding="ceil")
    assert floor_s[:, 0].tolist() == [127, 127, 0, 0, 254]
    assert ceil_s[:, 0].tolist() == [128, 127, 0, 0, 254]
    assert mxfp4_dequantize_ref(floor_b, floor_s)[0, 0] == 6.0  # clamped
    assert mxfp4_dequantize_ref(ceil_b, ceil_s)[0, 0] == 8.0  # 7 / 2 = 3.5, a tie: 4.0 (the even code)
    assert (mxfp4_dequantize_ref(floor_b, floor_s)[2] == 0).all()


@pytest.mark.parametrize("scale_rounding", ["floor", "ceil"])
def test_quantize_error_is_within_half_a_step(scale_rounding):
    """Random weights (odd row count, several blocks): every value within half an e2m1 step
    (at its magnitude) of its decoded value, except values the floor rule clamps at 6."""
    w = torch.randn(2, 37, 4 * MXFP4_BLOCK, dtype=torch.float64)
    blocks, scales = mxfp4_quantize_ref(w, scale_rounding)
    out = mxfp4_dequantize_ref(blocks, scales)
    scale = torch.exp2(scales.double() - 127).repeat_interleave(MXFP4_BLOCK, dim=-1)
    a = w.abs() / scale
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))  # e2m1's spacing below each magnitude
    clamped = a > 6
    err = (out - w).abs() / scale
    assert (err[~clamped] <= step[~clamped] / 2 + 1e-12).all()
    assert (out[clamped].abs() == 6 * scale[clamped]).all()
    assert scale_rounding == "floor" or not clamped.any()
    assert not math.isnan(out.sum().item())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize_ref(torch.randn(4, 48))
    with pytest.raises(ValueError, match="scale_rounding must be"):
        mxfp4_quantize_ref(torch.randn(4, 32), scale_rounding="nearest")
    with pytest.raises(ValueError, match="blocks must be uint8"):
        mxfp4_dequantize_ref(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, dtype=torch.uint8))


# ---- grouped_matmul with MXFP4 experts (weight-only: a bf16 / fp16, b dequantised in the K loop)

# (group sizes, N, K, a dtype, bias and activation, b's layout): empty groups, 1, 17 and 127
# rows; K not a multiple of the 64-wide K block (its last block half full); N odd
MXFP4_CASES = [
    pytest.param([5, 0, 12], 40, 96, torch.bfloat16, False, "transposed", id="empty-group"),
    pytest.param([1, 17, 127], 33, 160, torch.bfloat16, True, "transposed", id="odd-rows-bias-gelu"),
    pytest.param([30, 2], 64, 32, torch.float16, False, "n_major", id="fp16-n-major-one-block"),
]


# each case with b's bytes read both ways: pointers, and a descriptor over the weights as stored
# (the interpreter runs descriptors too); an N-major b has no descriptor (tma=True refuses it)
MXFP4_FLAVOURED = [pytest.param(*case.values, tma, id=f"{case.id}-{name}") for case in MXFP4_CASES
                   for tma, name in ((None, "auto"), (False, "pointers"), (True, "tma"))
                   if not (tma and case.values[-1] == "n_major")]


@pytest.mark.parametrize("sizes,N,K,dtype,with_bias,layout,tma", MXFP4_FLAVOURED)
def test_grouped_matmul_mxfp4_matches_reference(sizes, N, K, dtype, with_bias, layout, tma, device):
    G = len(sizes)
    w4, s8, b_ref = mxfp4_experts(G, N, K, device, layout)
    a = torch.randn(sum(sizes) + 3, K, device=device).to(dtype)  # 3 rows past offs[-1]
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    bias = torch.randn(G, N, device=device).to(dtype) if with_bias else None
    act = "gelu" if with_bias else None
    out = onegemm.grouped_matmul(a, w4, offs, scale_b=s8, bias=bias, activation=act, tma=tma)
    assert out.dtype == dtype and out.shape == (a.shape[0], N)
    assert_close(out, grouped_mm_ref(a.double(), b_ref, offs, bias, act), TOL[dtype])
    assert (out[sum(sizes):] == 0).all()
    assert torch.equal(onegemm.grouped_matmul(a, w4, offs, scale_b=s8, bias=bias, activation=act, tma=tma), out)


def test_grouped_matmul_mxfp4_nan_scale(device):
    """e8m0's 255 is NaN: the columns of that expert's block come out NaN, others finite."""
    w4, s8, _ = mxfp4_experts(2, 16, 64, device)
    s8 = s8.view(torch.uint8).clone()
    s8[1, 0, 3] = 255  # expert 1, K block 0, column 3
    a = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    offs = torch.tensor([4, 8], device=device, dtype=torch.int32)
    out = onegemm.grouped_matmul(a, w4, offs, scale_b=s8.view(torch.float8_e8m0fnu))
    assert out[4:, 3].isnan().all() and not out[:4].isnan().any() and not out[4:, :3].isnan().any()


MXFP4_BAD = [
    (lambda a, w4, s8: dict(a=a.float()), TypeError, "a must be bfloat16 or float16 with an MXFP4 b"),
    (lambda a, w4, s8: dict(scale_a=torch.ones(a.shape[0], 1)), ValueError, "scale_a must be None with an MXFP4 b"),
    (lambda a, w4, s8: dict(scale_b=None), ValueError, "scale_b must be b's e8m0 block scales"),
    (lambda a, w4, s8: dict(scale_b=s8.view(torch.uint8)), TypeError, "scale_b"),
    (lambda a, w4, s8: dict(scale_b=s8[:, :1]), ValueError, r"scale_b .*\[G, K / 32, N\]"),
    (lambda a, w4, s8: dict(a=a[:, :32]), ValueError, "MXFP4 \\[G, K / 2, N\\] with K = 32"),
    (lambda a, w4, s8: dict(a=a.reshape(2, 4, 64), offs=None), ValueError, "only in the 2D x 3D mode"),
    (lambda a, w4, s8: dict(b=w4.view(torch.uint8).contiguous().view(torch.float4_e2m1fn_x2), tma=True), ValueError,
     "4-bit b through TMA is the weights as stored"),
]


@pytest.mark.parametrize("change,error,match", MXFP4_BAD, ids=[m[:30] for _, _, m in MXFP4_BAD])
def test_grouped_matmul_mxfp4_refuses(change, error, match, device):
    w4, s8, _ = mxfp4_experts(2, 16, 64, device)
    a = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    args = dict(a=a, b=w4, offs=torch.tensor([4, 8], device=device, dtype=torch.int32), scale_b=s8)
    args.update(change(a, w4, s8))
    with pytest.raises(error, match=match):
        onegemm.grouped_matmul(args.pop("a"), args.pop("b"), args.pop("offs"), **args)


@pytest.mark.parametrize("prepacked", [False, True], ids=["stored", "prepacked"])
def test_grouped_matmul_mxfp4_gradients(prepacked, device):
    """The weights are frozen; a and bias get their gradients (a LoRA user's dx on a 4-bit
    base), through the activation, against float64 autograd of the dequantised experts; rows
    past offs[-1] get none. Prepacked (onegemm.prepack_mxfp4): the backward dequantises the
    fragment order, K padded from 96 to 128."""
    G, N, K = 3, 48, 96
    w4, s8, b_ref = mxfp4_experts(G, N, K, device)
    b = dict(b=onegemm.prepack_mxfp4(w4.transpose(1, 2), s8.transpose(1, 2))) if prepacked else dict(b=w4, scale_b=s8)
    sizes = [5, 0, 12]
    a = torch.randn(sum(sizes) + 2, K, device=device).to(torch.bfloat16).requires_grad_()
    bias = (torch.randn(G, N, device=device) * 0.1).to(torch.bfloat16).requires_grad_()
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    out = onegemm.grouped_matmul(a, offs=offs, bias=bias, activation="gelu", **b)
    dy = torch.randn_like(out)
    out.backward(dy)
    a64, bias64 = a.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    grouped_mm_ref(a64, b_ref, offs, bias64, "gelu").backward(dy.double())
    assert_close(a.grad, a64.grad, TOL[torch.bfloat16], "a.grad")
    assert_close(bias.grad, bias64.grad, TOL[torch.bfloat16], "bias.grad")
    assert (a.grad[sum(sizes):] == 0).all()
    with pytest.raises(ValueError, match="config must be None when gradients are recorded"):  # never dropped
        onegemm.grouped_matmul(a, offs=offs, config=onegemm.core.configs.cfg(16, 32, 128, 4, 2), **b)


def test_grouped_matmul_mxfp4_under_torch_compile(device):
    """The registered op's fake takes MXFP4 b and scale_a None: a fullgraph compile gives the
    eager result bit for bit."""
    w4, s8, _ = mxfp4_experts(2, 16, 64, device)
    a = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
    compiled = torch.compile(lambda a: onegemm.grouped_matmul(a, w4, offs, scale_b=s8), fullgraph=True)
    assert torch.equal(compiled(a), onegemm.grouped_matmul(a, w4, offs, scale_b=s8))


# ---- moe_ffn with MXFP4 experts (gpt-oss's format, weight-only)

def _mxfp4_moe(T, H, I, E, k, dtype, device, foreign=False):
    """bf16/fp16 x, random experts quantised to MXFP4 (gate then up rows) with their scales,
    routing of random logits (``foreign``: some ids of experts on other ranks), and the
    dequantised experts in float64."""
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    (b13, s13), (b2, s2) = mxfp4_quantize_ref(w13), mxfp4_quantize_ref(w2)
    q13, q2 = (b.flatten(-2).view(torch.float4_e2m1fn_x2) for b in (b13, b2))
    scales = dict(w_gate_up_scale=s13.view(torch.float8_e8m0fnu), w_down_scale=s2.view(torch.float8_e8m0fnu))
    x = torch.randn(T, H, device=device).to(dtype)
    weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
    if foreign:
        ids[::3, 0] = E + 1
        ids[1::4, -1] = -1
    return x, q13, q2, scales, weights, ids, (mxfp4_dequantize_ref(b13, s13), mxfp4_dequantize_ref(b2, s2))


# (T, H, I, E, k, x dtype, foreign ids): one token; H and I not multiples of 64 (a half-full
# last K block); more experts than tokens (empty experts)
MXFP4_MOE_CASES = [
    pytest.param(1, 64, 32, 4, 2, torch.bfloat16, False, id="T1"),
    pytest.param(37, 96, 160, 6, 2, torch.bfloat16, True, id="T37-foreign-ids"),
    pytest.param(5, 128, 64, 16, 4, torch.float16, False, id="fp16-empty-experts"),
]


@pytest.mark.parametrize("T,H,I,E,k,dtype,foreign", MXFP4_MOE_CASES)
def test_moe_ffn_mxfp4_matches_reference(T, H, I, E, k, dtype, foreign, w4_flavour, device):
    x, q13, q2, scales, weights, ids, (w13, w2) = _mxfp4_moe(T, H, I, E, k, dtype, device, foreign)
    y = onegemm.moe_ffn(x, q13, q2, weights, ids, **scales)
    assert y.dtype == dtype and y.shape == (T, H)
    # h [T * k, I] is stored in x's dtype, as for 16-bit experts: twice the GEMM bound
    assert_close(y, moe_ref(x, w13, w2, weights, ids), 2 * TOL[dtype])
    assert torch.equal(onegemm.moe_ffn(x, q13, q2, weights, ids, **scales), y)


MXFP4_MOE_BAD = [
    (lambda x, q13, q2, s: dict(x=x.float()), TypeError, "x must be"),
    (lambda x, q13, q2, s: dict(w_down_scale=None), ValueError, "w_down_scale must be the e8m0 block scales"),
    (lambda x, q13, q2, s: dict(w_gate_up_scale=s["w_gate_up_scale"].view(torch.uint8)), TypeError, "w_gate_up_scale"),
    (lambda x, q13, q2, s: dict(w_down=q2[:, :, :-1]), ValueError, r"w_down must be MXFP4 \[E, H, I/2\]"),
    (lambda x, q13, q2, s: dict(x_scale=torch.ones(x.shape[0], 1)), ValueError, "x_scale must be None with MXFP4"),
    (lambda x, q13, q2, s: dict(x=x[:, :48], w_gate_up=q13[:, :, :24], w_gate_up_scale=s["w_gate_up_scale"][:, :, :1]),
     ValueError, "multiples of 32"),
]


@pytest.mark.parametrize("change,error,match", MXFP4_MOE_BAD, ids=[m[:30] for _, _, m in MXFP4_MOE_BAD])
def test_moe_ffn_mxfp4_refuses(change, error, match, device):
    x, q13, q2, scales, weights, ids, _ = _mxfp4_moe(4, 64, 32, 4, 2, torch.bfloat16, device)
    args = dict(x=x, w_gate_up=q13, w_down=q2, **scales)
    args.update(change(x, q13, q2, scales))
    with pytest.raises(error, match=match):
        onegemm.moe_ffn(args.pop("x"), args.pop("w_gate_up"), args.pop("w_down"), weights, ids, **args)


def test_moe_ffn_mxfp4_refuses_gradients(device):
    x, q13, q2, scales, weights, ids, _ = _mxfp4_moe(4, 64, 32, 4, 2, torch.bfloat16, device)
    with pytest.raises(ValueError, match="MXFP4"):
        onegemm.moe_ffn(x.requires_grad_(), q13, q2, weights, ids, **scales)


# ---- MoEFFN with MXFP4 experts (plain SwiGLU, and gpt-oss's biases and clamped SwiGLU)

@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt-oss"])
def test_moeffn_mxfp4_matches_its_dequantised_twin(gpt_oss, device):
    """The layer on MXFP4 experts against float64 of its twin on the dequantised experts (the
    reference routes in float64: rows whose choice differs by a near tie are left out)."""
    E, H, I, k = 6, 64, 96, 2
    x, q13, q2, scales, _, _, (w13, w2) = _mxfp4_moe(9, H, I, E, k, torch.bfloat16, device)
    gate = torch.randn(E, H, device=device).to(torch.bfloat16)
    extra = dict(gate_bias=torch.randn(E, device=device), w_gate_up_bias=torch.randn(E, 2 * I, device=device) * 0.1,
                 w_down_bias=torch.randn(E, H, device=device) * 0.1) if gpt_oss else {}
    extra = {n: t.to(torch.bfloat16) for n, t in extra.items()}
    if gpt_oss:
        extra.update(swiglu_limit=7.0, scoring="topk_softmax", renormalize=False)
    layer = onegemm.MoEFFN(gate, q13, q2, top_k=k, **scales, **extra)
    twin = onegemm.MoEFFN(gate, w13.to(torch.bfloat16), w2.to(torch.bfloat16), top_k=k, **extra)
    assert "intermediate=96" in repr(layer)
    assert not any(p.requires_grad for p in (layer.w_gate_up, layer.w_down, layer.gate_weight))
    y = assert_layer_close_to_twin(layer, twin, x, 2 * TOL[torch.bfloat16])
    with torch.no_grad():
        assert torch.equal(layer(x), y)


def test_moeffn_mxfp4_refuses(device):
    E, H, I = 4, 64, 32
    _, q13, q2, scales, _, _, _ = _mxfp4_moe(2, H, I, E, 2, torch.bfloat16, device)
    gate = torch.randn(E, H, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="gate_weight must be"):
        onegemm.MoEFFN(gate.float(), q13, q2, **scales)
    with pytest.raises(ValueError, match="w_down_scale must be the e8m0 block scales"):
        onegemm.MoEFFN(gate, q13, q2, w_gate_up_scale=scales["w_gate_up_scale"])
    with pytest.raises(ValueError, match="MXFP4 experts"):
        onegemm.MoEFFN(gate, q13, q2, **scales).check_fp8_training()


def test_quantize_experts_mxfp4_is_the_reference_format(device):
    """quantize_experts(format="mxfp4") (torch, fp32) gives the reference quantiser's bytes,
    bf16 and fp32 weights, tiny and huge blocks and all-zero ones included; moe_ffn runs them."""
    E, H, I = 3, 64, 96
    w13 = torch.randn(E, 2 * I, H, device=device)
    w13[0, :5] *= 1e-30
    w13[1, 3:7] = 0
    w13[2, 0, :32] *= 1e30
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13.to(torch.bfloat16), w2, format="mxfp4")
    assert (q13.dtype, s13.dtype) == (torch.float4_e2m1fn_x2, torch.float8_e8m0fnu)
    assert q13.shape == (E, 2 * I, H // 2) and s13.shape == (E, 2 * I, H // 32) and q2.shape == (E, H, I // 2)
    for q, s, w in ((q13, s13, w13.to(torch.bfloat16)), (q2, s2, w2)):
        blocks, scales = mxfp4_quantize_ref(w)
        assert torch.equal(q.view(torch.uint8), blocks.flatten(-2)) and torch.equal(s.view(torch.uint8), scales)
    fp32_q, fp32_s, _, _ = onegemm.quantize_experts(w13, w13.new_zeros(E, H, I), format="mxfp4")
    assert torch.equal(fp32_q.view(torch.uint8), mxfp4_quantize_ref(w13)[0].flatten(-2))
    # moe_ffn on quantize_experts' output, against float64 of the same bytes decoded
    q13, s13, q2, s2 = onegemm.quantize_experts((w13 * H**-0.5).clamp(-1, 1).to(torch.bfloat16), w2, format="mxfp4")
    x = torch.randn(4, H, device=device, dtype=torch.bfloat16)
    weights, ids = onegemm.route(torch.randn(4, E, device=device), 2)
    y = onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2)
    decoded = [mxfp4_dequantize_ref(q.view(torch.uint8).unflatten(-1, (-1, 16)), s.view(torch.uint8))
               for q, s in ((q13, s13), (q2, s2))]
    assert_close(y, moe_ref(x, *decoded, weights, ids), 2 * TOL[torch.bfloat16])
    with pytest.raises(ValueError, match="format must be one of"):
        onegemm.quantize_experts(w13, w2.float(), format="int8")
    with pytest.raises(ValueError, match="multiples of 32 for format='mxfp4'"):
        onegemm.quantize_experts(w13[:, :80, :48], w13.new_zeros(E, 48, 40), format="mxfp4")


def test_moeffn_gpt_oss_mxfp4_passes_x_gradients(device):
    """gpt-oss's MXFP4 layer is frozen but passes dx upstream (adapters on a 4-bit base): the
    same dx as its twin holding the dequantised experts in bf16."""
    E, H, I = 4, 64, 96
    x, q13, q2, scales, _, _, (w13, w2) = _mxfp4_moe(9, H, I, E, 2, torch.bfloat16, device)
    gate = torch.randn(E, H, device=device).to(torch.bfloat16)
    extra = dict(gate_bias=torch.randn(E, device=device).to(torch.bfloat16),
                 w_gate_up_bias=(torch.randn(E, 2 * I, device=device) * 0.1).to(torch.bfloat16),
                 w_down_bias=(torch.randn(E, H, device=device) * 0.1).to(torch.bfloat16),
                 swiglu_limit=7.0, scoring="topk_softmax", renormalize=False)
    layer = onegemm.MoEFFN(gate, q13, q2, top_k=2, **scales, **extra)
    twin = onegemm.MoEFFN(gate, w13.to(torch.bfloat16), w2.to(torch.bfloat16), top_k=2, **extra)
    for p in twin.parameters():
        p.requires_grad_(False)
    dy = torch.randn(9, H, device=device, dtype=torch.bfloat16)
    grads = []
    for model in (layer, twin):
        xg = x.detach().requires_grad_()
        model(xg).backward(dy)
        grads.append(xg.grad)
    assert_close(grads[0], grads[1].double(), TOL[torch.bfloat16], "dx")
