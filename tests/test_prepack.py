"""MXFP4 experts in fragment order (grouped/prepack.py, core/tiles.py TileSpec.W4_FRAG).

The layout against its description, written out here value by value; prepack_mxfp4 as a
lossless round trip; grouped_matmul, moe_ffn and moe_routed on prepacked experts against
float64 of the dequantised weights (odd rows, empty groups, K padded to the 128 block, N not a
multiple of the tile); torch.compile; and what is refused (a and bias's gradients: in
tests/test_mxfp4.py). Under the interpreter the decode's PTX is replaced by the same bit
operations on the same 4-byte words; on the GPU the tests run the PTX itself."""

import pytest
import torch

import onegemm
from helpers import mxfp4_experts
from onegemm.core.configs import cfg
from onegemm.core.tiles import FRAG_BITS
from onegemm.grouped import PrepackedMxfp4
from onegemm.grouped.moe import moe_routed
from onegemm.grouped.prepack import _codes_of, to_fragments
from onegemm.testing import TOL, assert_close, grouped_mm_ref, moe_ref, mxfp4_dequantize_ref

MXFP4, E8M0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu


def _layout_ref(codes):
    """The module docstring's layout, one value at a time: codes [N, K] (N % 16 == 0, K % 128
    == 0) -> bytes [N, K / 2]."""
    N, K = codes.shape
    words = torch.zeros(N, K // 8, dtype=torch.int64)  # a stored row's 32-bit words
    for n in range(N):
        group, r = divmod(n, 16)
        h, g = divmod(r, 8)
        for k in range(K):
            block, kk = divmod(k, 128)
            q, t = divmod(kk, 16)
            second, t = divmod(t, 8)  # K + 8: the second output
            c, j = divmod(t, 2)
            ch, cl = divmod(c, 2)
            row = 16 * group + 2 * g + ch
            word = block * 16 + cl * 8 + q  # 64 bytes per block: 32 per lane, 4 per chunk
            slot = 4 * second + 2 * h + j
            code = int(codes[n, k])
            for bit, place in zip((3, 2, 1, 0), FRAG_BITS[slot]):
                words[row, word] |= ((code >> bit) & 1) << place
    return torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(N, K // 2).to(torch.uint8)


def test_fragment_layout_is_the_documented_one():
    codes = torch.randint(0, 16, (32, 256), dtype=torch.uint8)
    assert torch.equal(to_fragments(codes[None])[0], _layout_ref(codes))


def test_frag_bits_use_every_bit_of_a_word_once():
    places = [p for slot in FRAG_BITS for p in slot]
    assert sorted(places) == list(range(32))
    # the PTX's masks: x0 at 0x81C081C0, x1 = x0 << 3, y0 = x0 << 6 (per 16-bit half)
    for slot, shift in ((0, 0), (2, 3), (4, 6)):
        assert [p + shift for p in FRAG_BITS[slot]] == list(FRAG_BITS[0])
        assert [p + shift for p in FRAG_BITS[slot + 1]] == list(FRAG_BITS[1])


def test_codes_round_trip():
    codes = torch.randint(0, 16, (3, 48, 384), dtype=torch.uint8)
    assert torch.equal(_codes_of(to_fragments(codes)), codes)


# (E, N, K, gate_up): K a multiple of 128, and not (padded: 160, 32); gate and up halves
PREPACK_CASES = [(2, 16, 128, False), (3, 48, 160, False), (1, 32, 32, True), (2, 64, 288, True)]


@pytest.mark.parametrize("E,N,K,gate_up", PREPACK_CASES)
def test_prepack_is_lossless(E, N, K, gate_up, device):
    w, s, _ = mxfp4_experts(E, N, K, device)
    w, s = w.transpose(1, 2), s.transpose(1, 2)  # as stored: [E, N, K / 2], [E, N, K / 32]
    p = onegemm.prepack_mxfp4(w, s, gate_up=gate_up)
    KP = -(-K // 128) * 128
    assert p.values.shape == (E, N, KP // 2) and p.values.dtype == torch.uint8
    assert p.scales.shape == (E, N, KP // 32) and p.scales.dtype == E8M0 and p.k == K and p.shape == (E, N, K)
    w2, s2 = p.unpack()
    assert w2.dtype == MXFP4 and s2.dtype == E8M0
    assert torch.equal(w2.view(torch.uint8), w.view(torch.uint8)) and torch.equal(s2.view(torch.uint8), s.view(torch.uint8))
    if gate_up:  # stored row pairs: gate j, up j
        half = N // 2
        plain = onegemm.prepack_mxfp4(w, s)
        assert torch.equal(p.scales.view(torch.uint8)[:, 0::2, :K // 32], s.view(torch.uint8)[:, :half])
        assert not torch.equal(p.values, plain.values)


# ---- grouped_matmul with a prepacked b

# (group sizes, N, K, bias and activation): an empty group, 1, 17 and 127 rows; K padded to
# the 128 block (160, 32) or not (256); N not a multiple of the 64-row tile (48)
PREPACKED_CASES = [
    pytest.param([5, 0, 12], 64, 256, False, id="empty-group"),
    pytest.param([1, 17, 127], 48, 160, True, id="odd-rows-bias-gelu"),
    pytest.param([30, 2], 16, 32, False, id="one-short-block"),
]
PREPACKED_FLAVOURED = [pytest.param(*case.values, tma, id=f"{case.id}-{name}") for case in PREPACKED_CASES
                       for tma, name in ((None, "auto"), (True, "tma"))]


def _prepacked(G, N, K, device, gate_up=False):
    w, s, ref = mxfp4_experts(G, N, K, device)
    return onegemm.prepack_mxfp4(w.transpose(1, 2), s.transpose(1, 2), gate_up=gate_up), ref


@pytest.mark.parametrize("sizes,N,K,with_bias,tma", PREPACKED_FLAVOURED)
def test_grouped_matmul_prepacked_matches_reference(sizes, N, K, with_bias, tma, device):
    G = len(sizes)
    p, b_ref = _prepacked(G, N, K, device)
    a = torch.randn(sum(sizes) + 3, K, device=device).to(torch.bfloat16)  # 3 rows past offs[-1]
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    bias = torch.randn(G, N, device=device).to(torch.bfloat16) if with_bias else None
    act = "gelu" if with_bias else None
    out = onegemm.grouped_matmul(a, p, offs, bias=bias, activation=act, tma=tma)
    assert out.dtype == torch.bfloat16 and out.shape == (a.shape[0], N)
    assert_close(out, grouped_mm_ref(a.double(), b_ref, offs, bias, act), TOL[torch.bfloat16])
    assert (out[sum(sizes):] == 0).all()
    assert torch.equal(onegemm.grouped_matmul(a, p, offs, bias=bias, activation=act, tma=tma), out)


@pytest.mark.parametrize("config", [cfg(16, 64, 128, 4, 3), cfg(64, 128, 128, 4, 3)], ids=["16x64", "64x128"])
def test_grouped_matmul_prepacked_forced_tiles(config, device):
    """The tile's weight rows (BLOCK_N, wgmma's M) and tokens (BLOCK_M) as the tuner may pick them."""
    p, b_ref = _prepacked(2, 80, 160, device)
    a = torch.randn(40, 160, device=device).to(torch.bfloat16)
    offs = torch.tensor([23, 40], device=device, dtype=torch.int32)
    out = onegemm.grouped_matmul(a, p, offs, config=config)
    assert_close(out, grouped_mm_ref(a.double(), b_ref, offs), TOL[torch.bfloat16])


def test_grouped_matmul_prepacked_under_torch_compile(device):
    p, _ = _prepacked(2, 16, 64, device)
    a = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
    compiled = torch.compile(lambda a: onegemm.grouped_matmul(a, p, offs), fullgraph=True)
    assert torch.equal(compiled(a), onegemm.grouped_matmul(a, p, offs))


PREPACKED_BAD = [
    (lambda a, p: dict(b=p.values.transpose(1, 2)), ValueError, "b must be a PrepackedMxfp4"),
    (lambda a, p: dict(scale_b=p.scales.transpose(1, 2)), ValueError, "scale_b must be None with a PrepackedMxfp4"),
    (lambda a, p: dict(a=a[:, :32]), ValueError, r"a must be \[sum_M, K\] with K = 64"),
    (lambda a, p: dict(b=p._replace(gate_up=True)), ValueError, "b must be a PrepackedMxfp4 prepacked with gate_up=False"),
    (lambda a, p: dict(b=p._replace(k=300)), ValueError, r"b.values must be \[E, N, ceil\(k / 128\) \* 64\]"),
    (lambda a, p: dict(b=p._replace(scales=p.scales[:, :, :1])), ValueError, "b.scales"),
    (lambda a, p: dict(config=cfg(16, 64, 64, 4, 3)), ValueError, "config must be a config with BLOCK_K = 128"),
]


@pytest.mark.parametrize("change,error,match", PREPACKED_BAD, ids=[m[:30] for _, _, m in PREPACKED_BAD])
def test_grouped_matmul_prepacked_refuses(change, error, match, device):
    p, _ = _prepacked(2, 16, 64, device)
    a = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    args = dict(a=a, b=p, offs=torch.tensor([4, 8], device=device, dtype=torch.int32))
    args.update(change(a, p))
    with pytest.raises(error, match=match):
        onegemm.grouped_matmul(args.pop("a"), args.pop("b"), args.pop("offs"), **args)


PREPACK_BAD = [
    (lambda w, s: dict(w=w.view(torch.uint8)), TypeError, "w must be"),
    (lambda w, s: dict(w=w[:, :8], s=s[:, :8]), ValueError, "N a multiple of 16"),
    (lambda w, s: dict(gate_up=True), ValueError, "N a multiple of 32"),
    (lambda w, s: dict(w=w[:, :, :8], s=s[:, :, :1]), ValueError, "K a multiple of 32"),
    (lambda w, s: dict(s=s[:, :, :1]), ValueError, r"scale must be \[E, N, K / 32\]"),
    (lambda w, s: dict(s=s.view(torch.uint8)), TypeError, "scale must be"),
]


@pytest.mark.parametrize("change,error,match", PREPACK_BAD, ids=[m[:30] for _, _, m in PREPACK_BAD])
def test_prepack_refuses(change, error, match, device):
    w, s, _ = mxfp4_experts(2, 16, 64, device)
    args = dict(w=w.transpose(1, 2), s=s.transpose(1, 2))
    args.update(change(args["w"], args["s"]))
    with pytest.raises(error, match=match):
        onegemm.prepack_mxfp4(args.pop("w"), args.pop("s"), **args)


# ---- moe_ffn and moe_routed with prepacked experts (SwiGLU's gate and up rows interleaved)

def _prepacked_moe(T, H, I, E, k, dtype, device, foreign=False):
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2, format="mxfp4")
    x = torch.randn(T, H, device=device).to(dtype)
    logits = torch.randn(T, E, device=device)
    weights, ids = onegemm.route(logits, k)
    if foreign:
        ids[::3, 0] = E + 1
        ids[1::4, -1] = -1
    ref = [mxfp4_dequantize_ref(q.view(torch.uint8).unflatten(-1, (-1, 16)), s.view(torch.uint8))
           for q, s in ((q13, s13), (q2, s2))]
    p13, p2 = onegemm.prepack_mxfp4(q13, s13, gate_up=True), onegemm.prepack_mxfp4(q2, s2)
    return x, logits, p13, p2, weights, ids, ref


# (T, H, I, E, k, x dtype, foreign ids): one token; H and I padded to the 128 block; more
# experts than tokens (empty experts). The bytes' flavour (pointers, descriptor) is the
# GEMM's choice, covered by the grouped_matmul tests above.
PREPACKED_MOE_CASES = [
    pytest.param(1, 64, 32, 4, 2, torch.bfloat16, False, id="T1"),
    pytest.param(37, 96, 160, 6, 2, torch.bfloat16, True, id="T37-foreign-ids"),
    pytest.param(5, 128, 64, 16, 4, torch.float16, False, id="fp16-empty-experts"),
]


@pytest.mark.parametrize("T,H,I,E,k,dtype,foreign", PREPACKED_MOE_CASES)
def test_moe_ffn_prepacked_matches_reference(T, H, I, E, k, dtype, foreign, device):
    x, _, p13, p2, weights, ids, (w13, w2) = _prepacked_moe(T, H, I, E, k, dtype, device, foreign)
    y = onegemm.moe_ffn(x, p13, p2, weights, ids)
    assert y.dtype == dtype and y.shape == (T, H)
    assert_close(y, moe_ref(x, w13, w2, weights, ids), 2 * TOL[dtype])  # h in x's dtype: twice the GEMM bound
    assert torch.equal(onegemm.moe_ffn(x, p13, p2, weights, ids), y)


def test_moe_routed_prepacked_is_moe_ffn(device):
    x, logits, p13, p2, _, _, _ = _prepacked_moe(9, 64, 96, 4, 2, torch.bfloat16, device)
    weights, ids = onegemm.route(logits, 2)
    assert torch.equal(moe_routed(x, logits, p13, p2, top_k=2), onegemm.moe_ffn(x, p13, p2, weights, ids))


PREPACKED_MOE_BAD = [
    (lambda x, p13, p2: dict(w_down=p2.unpack()[0]), ValueError, "w_down must be a PrepackedMxfp4"),
    (lambda x, p13, p2: dict(w_gate_up=p13.values, w_down=p2.values, w_gate_up_scale=p13.scales,
                             w_down_scale=p2.scales), ValueError, "w_gate_up must be a PrepackedMxfp4"),
    (lambda x, p13, p2: dict(w_gate_up=p13._replace(gate_up=False)), ValueError, "prepacked with gate_up=True"),
    (lambda x, p13, p2: dict(w_down_scale=p2.scales), ValueError, "w_down_scale must be None with prepacked"),
    (lambda x, p13, p2: dict(x=x[:, :32]), ValueError, r"x must be \[T, H\] with H = 64"),
    (lambda x, p13, p2: dict(w_down=p13._replace(gate_up=False)), ValueError, r"w_down must be prepacked \[E, H, I\]"),
]


@pytest.mark.parametrize("change,error,match", PREPACKED_MOE_BAD, ids=[m[:30] for _, _, m in PREPACKED_MOE_BAD])
def test_moe_ffn_prepacked_refuses(change, error, match, device):
    x, _, p13, p2, weights, ids, _ = _prepacked_moe(4, 64, 32, 4, 2, torch.bfloat16, device)
    args = dict(x=x, w_gate_up=p13, w_down=p2)
    args.update(change(x, p13, p2))
    with pytest.raises(error, match=match):
        onegemm.moe_ffn(args.pop("x"), args.pop("w_gate_up"), args.pop("w_down"), weights, ids, **args)


def test_prepacked_is_a_named_tuple_of_tensors():
    """What torch.compile and state dicts see: plain tensors and ints."""
    assert PrepackedMxfp4._fields == ("values", "scales", "k", "gate_up")


# ---- MoEFFN.prepack_experts: the layer's experts rewritten in place, saved as stored

@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt-oss"])
def test_moeffn_prepack_experts(gpt_oss, device):
    """The prepacked layer gives its stored twin's output (float64 reference of the decoded
    experts), saves the experts as stored, and loads stored experts into fragment order."""
    E, H, I, k = 4, 64, 96, 2
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2, format="mxfp4")
    gate = torch.randn(E, H, device=device).to(torch.bfloat16)
    extra = {}
    if gpt_oss:
        extra = dict(gate_bias=torch.randn(E, device=device).to(torch.bfloat16), swiglu_limit=7.0,
                     w_gate_up_bias=(torch.randn(E, 2 * I, device=device) * 0.1).to(torch.bfloat16),
                     w_down_bias=(torch.randn(E, H, device=device) * 0.1).to(torch.bfloat16),
                     scoring="topk_softmax", renormalize=False)
    make = lambda: onegemm.MoEFFN(gate, q13, q2, top_k=k, w_gate_up_scale=s13, w_down_scale=s2, **extra)  # noqa: E731
    stored, layer = make(), make().prepack_experts()
    assert layer.w_gate_up.dtype == torch.uint8 and "intermediate=96" in repr(layer)
    x = torch.randn(9, H, device=device).to(torch.bfloat16)
    with torch.no_grad():
        y, want = layer(x), stored(x)
    assert_close(y, want.double(), 2 * TOL[torch.bfloat16])
    saved = layer.state_dict()
    assert saved.keys() == stored.state_dict().keys()
    for name, t in stored.state_dict().items():
        assert saved[name].dtype == t.dtype and torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name
    fresh = make().prepack_experts()
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.w_gate_up, layer.w_gate_up) and torch.equal(fresh.w_down_scale.view(torch.uint8),
                                                                          layer.w_down_scale.view(torch.uint8))
    with pytest.raises(ValueError, match="MXFP4 experts as stored for prepack_experts"):
        layer.prepack_experts()
    with pytest.raises(TypeError, match="w_gate_up must be experts as stored"):  # bare fragment-order bytes
        onegemm.MoEFFN(gate, layer.w_gate_up.data, layer.w_down.data, top_k=k, w_gate_up_scale=layer.w_gate_up_scale,
                       w_down_scale=layer.w_down_scale, **extra)
    with pytest.raises(TypeError, match="weight must be a 4-bit weight"):
        onegemm.linear_4bit(x, layer.w_down.data[0], layer.w_down_scale[0])


# ---- on the GPU: the decode's PTX at model shapes, every tile the tuner may pick

MODEL_SHAPES = [pytest.param(4, 2880, 2880, id="gpt-oss"), pytest.param(2, 7168, 2048, id="kimi-k2-down"),
                pytest.param(3, 2048, 7168, id="kimi-k2-up")]


@pytest.mark.gpu
@pytest.mark.parametrize("G,N,K", MODEL_SHAPES)
@pytest.mark.parametrize("config", [None] + onegemm.grouped.configs.RAGGED_W4_FRAG[::3],
                         ids=lambda c: "auto" if c is None else f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}w{c.num_warps}s{c.num_stages}")
def test_grouped_matmul_prepacked_at_model_shapes(G, N, K, config, device):
    """The PTX decode reads its 4-byte words in the compiled layout's register order, which
    only a GPU run shows: every flavour at gpt-oss's and Kimi-K2's expert shapes (K = 2880 is
    not a multiple of 128), 1 to 300 rows per expert, against float64."""
    p, b_ref = _prepacked(G, N, K, device)
    sizes = [1, 0, 300, 17][:G] if G > 2 else [17, 64]
    a = torch.randn(sum(sizes), K, device=device).to(torch.bfloat16)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    ref = grouped_mm_ref(a.double(), b_ref, offs)
    for tma in (True, False):
        assert_close(onegemm.grouped_matmul(a, p, offs, config=config, tma=tma), ref, TOL[torch.bfloat16], f"tma={tma}")
