"""onegemm.quantize_fp8 and onegemm.blockscaled_matmul against float64 torch references.

CPU tests quantise with torch (under the interpreter the kernel's fp8 cast turns NaN into 384);
the fused Triton quantiser is checked bit for bit against the torch path on finite inputs on
every device, and the GPU tests check blockscaled_matmul against torch._scaled_mm's blockwise
mode.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

import onegemm
from onegemm.blockscaled.quantize import _quantize_torch, _quantize_triton, granularity
from onegemm.core import configs, hopper_configs, hopper_fp8, launch
from onegemm.blockscaled.configs import BLOCKSCALED_CONFIGS
from onegemm.core.configs import warp_specialized
from onegemm.core.hopper_configs import WGMMA_MIN_M, WgmmaKey, wgmma_candidates, wgmma_cfg, wgmma_heuristic
from onegemm.core.launch import plans
from onegemm.core.fp8 import divide_rn, fp8_cast
from onegemm.core.runtime import default_programs
from onegemm.blockscaled.matmul import SCALES_A, SCALES_B
from onegemm.core.scaling import BLOCKWISE, COL, COL_BLOCKS, ROW, ROW_BLOCKS, TENSOR, Scaling, read_granularity
from onegemm.testing import (
    TOL,
    assert_close,
    block_dims,
    blockscaled_matmul_ref,
    calc_diff,
    dequantize_ref,
    is_pow2,
    quantize_fp8_ref,
    rel_err,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCKS = [(1, 128), (128, 128), "row", "tensor"]
# Kernel error (same fp8 values and scales as the reference, fp32 output): fp32 accumulation
# on CPU; on Hopper each 128-deep K block is summed in the tensor core's ~14-bit accumulator
# before promotion, so allow 1e-3 there (the quantisation error itself is ~3e-2).
KERNEL_TOL = 1e-5 if onegemm.INTERPRET else 1e-3


def bits(q):
    return q.view(torch.uint8)


@triton.jit
def _fp8_cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    one = tl.full((BLOCK,), 1.0, tl.float32)
    tl.store(y_ptr + i, fp8_cast(tl.load(x_ptr + i, mask=i < n), one, y_ptr.dtype.element_ty), mask=i < n)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_cast_rounds_like_torch(dtype, device):
    """core/fp8.py's cast (every kernel's fp8 output) gives torch's bits: every fp8 value, the
    midpoints between neighbours (ties to even), values rounding to -0, the subnormals,
    saturation; NaN on the GPU only (the interpreter casts an fp32 NaN to e4m3 as 384)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([-0.0, -1e-30, 1e-30, 1e9, -1e9]),
                   torch.randn(300) * torch.finfo(dtype).max / 4])
    if not onegemm.INTERPRET:
        x = torch.cat([x, torch.tensor([float("nan")])])
    x = x.to(device)
    y = torch.empty(x.numel(), dtype=dtype, device=device)
    _fp8_cast_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    fmax = torch.finfo(dtype).max
    assert torch.equal(bits(y), bits(x.clamp(-fmax, fmax).to(dtype)))


@triton.jit
def _divide_kernel(x_ptr, s_ptr, y_ptr, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    offs = rows[:, None] * C + cols[None, :]
    scale = tl.load(s_ptr + rows)[:, None]
    tl.store(y_ptr + offs, divide_rn(tl.load(x_ptr + offs), scale))


def test_divide_rn_is_torchs_division(device):
    """core/fp8.py's divide_rn (every quantiser's x / scale) gives the bits of torch's x / s:
    per-row scales of random mantissas from 2^-70 to 2^110, so that most 16-row tiles take
    the reciprocal-and-corrections path and the tiles holding a scale outside [2^-60, 2^100]
    (or an inf one) take div_rn; x of random mantissas and exponents, subnormals, zeros of
    both signs."""
    g = torch.Generator().manual_seed(7)
    R, C = 2048, 256
    x = torch.randn(R, C, generator=g) * torch.exp2(torch.randint(-40, 40, (R, C), generator=g).float())
    x[:, :4] = torch.tensor([0.0, -0.0, 1e-38, -3e-39])
    s = (torch.rand(R, generator=g) + 0.5) * torch.exp2(torch.randint(-50, 90, (R,), generator=g).float())
    for j, tile in enumerate(range(0, R // 16, 9)):  # one scale outside the fast range in every 9th tile
        s[16 * tile] = (2.0**-70, 2.0**110, float("inf"))[j % 3]
    x, s = x.to(device), s.to(device)
    y = torch.empty_like(x)
    _divide_kernel[(R // 16,)](x, s, y, C, BLOCK_R=16, BLOCK_C=C)
    want = x / s[:, None]
    exact = want.abs() >= 2.0**-42  # divide_rn's docstring: below, the last bit may differ
    assert torch.equal(y.view(torch.int32)[exact], want.view(torch.int32)[exact])
    for dtype in (E4M3, E5M2):  # what the quantisers store: torch's fp8 everywhere, zeros' signs included
        fmax = torch.finfo(dtype).max
        assert torch.equal(bits(y.clamp(-fmax, fmax).to(dtype)), bits(want.clamp(-fmax, fmax).to(dtype)))


def make_input(shape, device, layout="contig", dtype=torch.float32, spread=True):
    """Random normal [R, C]; ``spread``: rows scaled by 1e-3..1e3 (so block scales differ)."""
    R, C = shape
    if layout == "contig":
        t = torch.randn(R, C, device=device)
    elif layout == "transposed":
        t = torch.randn(C, R, device=device).t()
    elif layout == "sliced":
        t = torch.randn(2 * R + 1, C + 5, device=device)[1::2, 3 : 3 + C]
    else:
        raise ValueError(layout)
    if not spread:
        return t.to(dtype)
    rows = torch.logspace(-3, 3, R, device=device)[torch.randperm(R, device=device)]
    return (t * rows[:, None]).to(dtype)


# ---------------------------------------------------------------- quantize_fp8


QUANT_SHAPES = [(1, 1), (17, 300), (300, 127), (129, 257)]
SCALE_RULES = ["onegemm", "torchao"]


@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("pow2_scale", [False, True])
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_quantize_matches_reference(shape, block, dtype, pow2_scale, scale_rule, device):
    x = make_input(shape, device)
    q, scale = onegemm.quantize_fp8(x, block, dtype=dtype, pow2_scale=pow2_scale, scale_rule=scale_rule)
    q_ref, scale_ref = quantize_fp8_ref(x, block, dtype, pow2_scale, scale_rule)
    assert q.dtype == dtype and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(bits(q), bits(q_ref))


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_quantize_views_and_input_dtypes(layout, in_dtype, device):
    x = make_input((130, 300), device, layout, dtype=in_dtype)
    for block in BLOCKS:
        q, scale = onegemm.quantize_fp8(x, block)
        q_ref, scale_ref = quantize_fp8_ref(x, block)
        assert torch.equal(scale, scale_ref) and torch.equal(bits(q), bits(q_ref)), block


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("pow2_scale", [False, True])
def test_quantize_round_trip_and_saturation(block, dtype, pow2_scale, device):
    """|q * scale - x| <= half an fp8 ulp (relative, normal range) or half the smallest
    subnormal times the scale; the largest |q| of each block is at the format's max
    (pow2: within a factor 2 of it), never above."""
    x = make_input((150, 260), device)
    q, scale = onegemm.quantize_fp8(x, block, dtype=dtype, pow2_scale=pow2_scale)
    M, K = x.shape
    rb, cb = {"row": (1, K), "tensor": (M, K)}.get(block, block) if isinstance(block, str) else block
    s = scale.reshape(-1, 1) if scale.dim() == 0 else scale
    full = s.repeat_interleave(rb, 0).repeat_interleave(cb, 1)[:M, :K] if s.numel() > 1 else s.reshape(1, 1)
    fi = torch.finfo(dtype)
    mant = {E4M3: 3, E5M2: 2}[dtype]
    err = (q.double() * full.double() - x.double()).abs()
    bound = x.double().abs() * 2.0 ** -(mant + 1) + full.double() * fi.smallest_normal * 2.0 ** -(mant + 1)
    assert (err <= bound * (1 + 1e-6)).all(), f"max excess {(err - bound).max().item():.3e}"
    qmax = q.float().abs()
    assert qmax.max().item() <= fi.max
    block_max = torch.nn.functional.max_pool2d(qmax[None, None], (min(rb, M), min(cb, K)), ceil_mode=True)[0, 0]
    if pow2_scale:
        assert (block_max >= fi.max / 2).all() and (block_max <= fi.max).all()  # amax / scale in (max/2, max], then rounded
    else:
        assert (block_max == fi.max).all()


def test_quantize_saturates_huge_values(device):
    """3e38 (near fp32's max) quantises to +-448 with a finite scale; no NaN in e4m3fn."""
    x = make_input((4, 256), device)
    x[1, 5], x[2, 200] = 3e38, -3e38
    for block in BLOCKS:
        q, scale = onegemm.quantize_fp8(x, block)
        assert torch.isfinite(scale).all() and not torch.isnan(q.float()).any()
        assert q[1, 5].item() == 448.0 and q[2, 200].item() == -448.0


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("pow2_scale", [False, True])
def test_quantize_zero_and_tiny_blocks(block, pow2_scale, device):
    """An all-zero block: scale 1.0, q all zero. A block of denormals (1e-40): a finite scale
    >= FLT_MIN (amax / 448 would underflow to 0), and q * scale still close to x."""
    x = make_input((256, 384), device)
    x[:128, :128] = 0.0
    x[128:, 256:] = 1e-40 * torch.rand(128, 128, device=device)
    if block == "row":
        x[5] = 0.0
    q, scale = onegemm.quantize_fp8(x, block, pow2_scale=pow2_scale)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (q[:128, :128].float() == 0).all()
    if block == (128, 128):
        assert scale[0, 0].item() == 1.0
        assert scale[1, 2].item() >= torch.finfo(torch.float32).tiny
    if block == (1, 128):
        assert (scale[:128, 0] == 1.0).all()
    if block == "row":
        assert scale[5, 0].item() == 1.0
    q_ref, scale_ref = quantize_fp8_ref(x, block, pow2_scale=pow2_scale)
    assert torch.equal(scale, scale_ref) and torch.equal(bits(q), bits(q_ref))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_quantize_non_finite(bad, block, scale_rule, device):
    """By default (no host sync) a block holding NaN or inf gets an inf scale, so it
    dequantises to NaN while the other blocks stay exact; check_finite=True raises."""
    x = make_input((40, 300), device)
    i, j = torch.randint(40, ()).item(), torch.randint(300, ()).item()
    x[i, j] = bad
    q, scale = onegemm.quantize_fp8(x, block, scale_rule=scale_rule)
    rows, cols = block_dims(block, 40, 300)
    deq = dequantize_ref(q, scale, rows, cols)
    hit = torch.zeros(40, 300, dtype=torch.bool, device=x.device)
    hit[(i // rows) * rows:(i // rows + 1) * rows, (j // cols) * cols:(j // cols + 1) * cols] = True
    assert torch.isnan(deq[hit]).all()
    assert torch.isfinite(deq[~hit]).all()
    with pytest.raises(ValueError, match="x must be finite"):
        onegemm.quantize_fp8(x, block, check_finite=True)


def test_quantize_pow2_scales_are_powers_of_two(device):
    x = make_input((64, 512), device)
    q, scale = onegemm.quantize_fp8(x, (1, 128), pow2_scale=True)
    _, plain = onegemm.quantize_fp8(x, (1, 128))
    assert is_pow2(scale).all()
    assert (scale >= plain).all() and (scale < 2 * plain).all()


@pytest.mark.parametrize("shape,block,scale_shape", [((0, 300), (1, 128), (0, 3)), ((5, 0), (128, 128), (1, 0)), ((0, 0), "tensor", ())], ids=str)
def test_quantize_empty(shape, block, scale_shape, device):
    q, scale = onegemm.quantize_fp8(torch.randn(*shape, device=device), block)
    assert q.shape == shape and tuple(scale.shape) == scale_shape
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert (scale == 1).all()  # a block with no elements is all-zero: scale 1 (the tensor-wise scalar)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(block=(64, 64)), ValueError, "block must be one of"),
        (dict(block="col"), ValueError, "block must be one of"),
        (dict(dtype=torch.float16), TypeError, "dtype must be torch.float8"),
        (dict(scale_rule="ocp"), ValueError, "scale_rule must be one of"),
    ],
)
def test_quantize_bad_args(kwargs, exc, match, device):
    with pytest.raises(exc, match=match):
        onegemm.quantize_fp8(torch.randn(4, 8, device=device), **kwargs)


def test_quantize_bad_x(device):
    with pytest.raises(ValueError, match="x must be 2-D"):
        onegemm.quantize_fp8(torch.randn(2, 4, 8, device=device))
    with pytest.raises(TypeError, match="x must be of dtype"):
        onegemm.quantize_fp8(torch.ones(4, 8, dtype=torch.int32, device=device))


@pytest.mark.parametrize("block", [(1, 128), (128, 128), "row", "tensor"], ids=str)
@pytest.mark.parametrize("pow2_scale", [False, True])
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_quantize_kernel_matches_torch_path(block, pow2_scale, scale_rule, device):
    """The Triton kernel's scales and fp8 values equal the torch path's (the same fp32
    arithmetic) bit for bit on a sliced view, under the interpreter too: core/fp8.py's cast
    rounds finite values exactly there."""
    x = make_input((130, 300), device, "sliced")
    torchao = scale_rule == "torchao"
    q, scale = _quantize_triton(x, granularity(block), E4M3, pow2_scale, torchao=torchao)
    q_ref, scale_ref = _quantize_torch(x, granularity(block), E4M3, pow2_scale, torchao)
    assert torch.equal(scale, scale_ref) and torch.equal(bits(q), bits(q_ref))


TRANSPOSED_CASES = [((1, 128), (1, 1)), ((1, 128), (130, 300)), ((1, 128), (300, 129)), ((1, 128), (257, 17)),
                    ((128, 128), (130, 300)), ((128, 128), (17, 129)), ((128, 128), (1, 1)), ((128, 128), (300, 1)),
                    ("row", (130, 300)), ("row", (1, 17)), ("row", (257, 1)), ("tensor", (130, 300)), ("tensor", (17, 1))]


@pytest.mark.parametrize("block,shape", TRANSPOSED_CASES, ids=str)
@pytest.mark.parametrize("layout", ["contig", "sliced", "transposed"])
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_quantize_transposed_is_the_quantisation_of_the_transpose(block, shape, layout, scale_rule, device):
    """quantize_fp8(x, transposed=True) gives x's quantisation and x.t()'s, each bit for bit
    what quantize_fp8 gives for that tensor alone (the fused kernels' own passes on every
    device, and the public call). 1x128 blocks of x.t() run along x's rows (one read of x),
    so rows of x spread over 1e-3..1e3 give x.t()'s blocks scales of their own; row scales of
    x.t() are x's columns'."""
    x = make_input(shape, device, layout)
    x[0, 0] = 0.0
    gran, torchao = granularity(block), scale_rule == "torchao"
    q, s, q_t, s_t = _quantize_triton(x, gran, E4M3, False, transposed=True, torchao=torchao)
    assert s_t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()  # two outputs, never one aliased
    for got, want in [((q, s), _quantize_torch(x, gran, E4M3, False, torchao)),
                      ((q_t, s_t), _quantize_torch(x.t(), gran, E4M3, False, torchao))]:
        assert got[0].shape == want[0].shape and torch.equal(bits(got[0]), bits(want[0]))
        assert torch.equal(got[1], want[1]) and layout_of(got[1]) == layout_of(want[1])
    public = onegemm.quantize_fp8(x, block, transposed=True, scale_rule=scale_rule)
    alone = (*onegemm.quantize_fp8(x, block, scale_rule=scale_rule), *onegemm.quantize_fp8(x.t(), block, scale_rule=scale_rule))
    assert len(public) == 4
    for got, want in zip(public, alone):
        assert got.shape == want.shape
        assert torch.equal(bits(got), bits(want)) if got.dtype == E4M3 else torch.equal(got, want)
        if got is not public[2]:
            assert layout_of(got) == layout_of(want)
    # q_t is row-major with 16-byte rows (TMA-readable for any M)
    assert public[2].stride() == (-(-shape[0] // 16) * 16, 1)


def layout_of(t):
    """The strides that matter: those of dimensions longer than 1."""
    return [st for n, st in zip(t.shape, t.stride()) if n > 1]


def test_quantize_transposed_must_be_a_bool(device):
    with pytest.raises(TypeError, match="transposed must be a bool"):
        onegemm.quantize_fp8(torch.randn(4, 8, device=device), transposed=1)


# ---------------------------------------------------------------- blockscaled_matmul


# Each granularity: how to build the scale for a [R, C] operand from quantize_fp8, what
# (rows, cols) of the operand share one scale, for A [M, K] and for B [K, N] (= W.t(), W [N, K]).
A_GRANS = {"tensor": "tensor", "row": "row", "1x128": (1, 128), "128x128": (128, 128)}
B_GRANS = {"tensor": "tensor", "col": "row", "128x1": (1, 128), "128x128": (128, 128)}


def quant_a(a, gran, dtype=E4M3):
    """A [M, K] quantised with granularity ``gran``; returns (q, scale, (rows, cols) per scale)."""
    M, K = a.shape
    q, s = quantize_fp8_ref(a, A_GRANS[gran], dtype)
    return q, s, {"tensor": (M, K), "row": (1, K), "1x128": (1, 128), "128x128": (128, 128)}[gran]


def quant_b(w, gran, dtype=E4M3):
    """B = W.t() for W [N, K]: quantise W by rows (its 1x128 blocks are B's 128x1 blocks)
    and pass B and its scale as transposed views, the layout torch._scaled_mm wants."""
    N, K = w.shape
    q, s = quantize_fp8_ref(w, B_GRANS[gran], dtype)
    s = s if s.dim() == 0 else s.t()
    return q.t(), s, {"tensor": (K, N), "col": (K, 1), "128x1": (128, 1), "128x128": (128, 128)}[gran]


@pytest.mark.parametrize("gran_a", list(A_GRANS))
@pytest.mark.parametrize("gran_b", list(B_GRANS))
def test_every_granularity_pair(gran_a, gran_b, device):
    """All 16 pairs on a shape with partial blocks in M, N and K (kernel error, tight)."""
    M, N, K = 130, 150, 300
    qa, sa, ba = quant_a(make_input((M, K), device), gran_a)
    qb, sb, bb = quant_b(make_input((N, K), device), gran_b)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


SHAPES = [(1, 1, 1), (1, 300, 127), (17, 33, 65), (127, 1, 300), (300, 127, 17), (129, 257, 129)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("layout", ["contig", "a_transposed", "b_row_major", "sliced"])
def test_deepseek_recipe_shapes_and_layouts(M, N, K, layout, device):
    """1x128 x 128x128 on odd shapes; operands as transposed / strided views and the scales
    both contiguous and in torch._scaled_mm's layout."""
    a = make_input((M, K), device)
    w = make_input((N, K), device)
    qa, sa = quantize_fp8_ref(a, (1, 128))
    qw, sw = quantize_fp8_ref(w, (128, 128))
    qb, sb = qw.t(), sw.t()
    if layout == "a_transposed":
        qa = qa.t().contiguous().t()
        sa = sa.t().contiguous().t()  # outer-dim-major scale_a, torch._scaled_mm's layout
    elif layout == "b_row_major":
        qb, sb = qb.contiguous(), sb.contiguous()
    elif layout == "sliced":
        big = torch.zeros(2 * M, K + 7, device=device).to(E4M3)
        big[::2, 7:] = qa
        qa = big[::2, 7:]
        sbig = torch.rand(sa.shape[0], 2 * sa.shape[1] + 1, device=device)
        sbig[:, 1::2] = sa
        sa = sbig[:, 1::2]
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, (1, 128), (128, 128)), KERNEL_TOL)


# Sizes: TMA needs 16-byte strides (M, N, K multiples of 16 here), but not of the 32x32x128
# interpreter tiles, so every edge has a partial box.
@pytest.mark.parametrize("M,N,K", [(112, 152, 272), (48, 40, 64)])
@pytest.mark.parametrize("grans", [("1x128", "128x128"), ("128x128", "128x1"), ("row", "tensor")], ids=str)
@pytest.mark.parametrize("a_layout", ["contig", "transposed"])
def test_tma_flavour(M, N, K, grans, a_layout, device):
    """core's TMA flavour (tensor descriptors; the interpreter runs them too), forced: boxes
    past M, N and K must arrive zero-filled, and the scales still follow rows and columns."""
    a = make_input((M, K), device)
    qa, sa, ba = quant_a(a, grans[0])
    if a_layout == "transposed":
        qa = qa.t().contiguous().t()
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, tma=True)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


@pytest.mark.parametrize("K", [129, 200, 300])
def test_k_tail_is_masked(K, device):
    """K not a multiple of 128: a, b and both scales are windows into buffers whose entries
    past K (and past ceil(K/128) scale blocks) hold large values; reading them would show."""
    M, N = 40, 70
    kb = triton.cdiv(K, 128)
    qa, sa = quantize_fp8_ref(make_input((M, K), device), (1, 128))
    qw, sw = quantize_fp8_ref(make_input((N, K), device), (128, 128))
    big_a = torch.full((M, K + 64), 448.0, device=device).to(E4M3)
    big_a[:, :K] = qa
    big_w = torch.full((N, K + 64), 448.0, device=device).to(E4M3)
    big_w[:, :K] = qw
    big_sa = torch.full((M, kb + 1), 1e6, device=device)
    big_sa[:, :kb] = sa
    a, b, s_a = big_a[:, :K], big_w[:, :K].t(), big_sa[:, :kb]
    out = onegemm.blockscaled_matmul(a, b, s_a, sw.t(), out_dtype=torch.float32)
    assert_close(out, blockscaled_matmul_ref(a, b, s_a, sw.t(), (1, 128), (128, 128)), KERNEL_TOL)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bias_activation_out_dtype(activation, out_dtype, device):
    M, N, K = 70, 90, 260
    # No magnitude spread: products of 1e3-sized rows would overflow the fp16 output.
    qa, sa = quantize_fp8_ref(make_input((M, K), device, spread=False), (1, 128))
    qw, sw = quantize_fp8_ref(make_input((N, K), device, spread=False), (128, 128))
    bias = (torch.randn(N, device=device) * 100).to(torch.bfloat16)
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=out_dtype, bias=bias, activation=activation)
    assert out.dtype == out_dtype
    ref = blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (1, 128), (128, 128), bias, activation)
    assert_close(out, ref, max(TOL[out_dtype], KERNEL_TOL))


@pytest.mark.parametrize("a_dtype,b_dtype", [(E4M3, E5M2), (E5M2, E4M3)], ids=str)
def test_mixed_fp8_formats(a_dtype, b_dtype, device):
    qa, sa = quantize_fp8_ref(make_input((50, 300), device), (1, 128), a_dtype)
    qw, sw = quantize_fp8_ref(make_input((60, 300), device), (128, 128), b_dtype)
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    assert_close(out, blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (1, 128), (128, 128)), KERNEL_TOL)


def test_quantisation_error_is_fp8_sized(device):
    """End to end against the unquantised product: calc_diff well under 1e-3 (DeepSeek-V3's
    figure), and far above the kernel error (so the check is not vacuous)."""
    a = torch.randn(96, 512, device=device)
    w = torch.randn(80, 512, device=device)
    qa, sa = onegemm.quantize_fp8(a)
    qw, sw = onegemm.quantize_fp8(w, (128, 128))
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    d = calc_diff(out, a.double() @ w.double().t())
    assert 1e-5 < d < 1e-3, d


# Ambiguous shapes (module docstring of blockscaled/matmul.py): each is read the coarsest way,
# and the test checks that the other reading gives the same numbers, by expanding the scale
# to the other granularity's full shape and running the kernel on that too.
def test_ambiguous_m1_1x128_is_128x128(device):
    """M == 1: [1, kb] is both 1x128 and 128x128."""
    qa, sa = quantize_fp8_ref(make_input((1, 300), device), (1, 128))
    qw, sw = quantize_fp8_ref(make_input((70, 300), device), (128, 128))
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    for block in [(1, 128), (128, 128)]:
        assert_close(out, blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), block, (128, 128)), KERNEL_TOL)


def test_ambiguous_small_m_reads_128x128(device):
    """M <= 128: [1, kb] is the 128x128 reading (one row block); it equals 1x128 scales with
    that row repeated M times. With M > 128 the same shape fits nothing and is refused."""
    M, K = 100, 300
    qa, sa = quantize_fp8_ref(make_input((M, K), device), (128, 128))
    qw, sw = quantize_fp8_ref(make_input((60, K), device), (128, 128))
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    as_1x128 = onegemm.blockscaled_matmul(qa, qw.t(), sa.expand(M, -1), sw.t(), out_dtype=torch.float32)
    assert_close(out, blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (128, 128), (128, 128)), KERNEL_TOL)
    assert_close(as_1x128, out, KERNEL_TOL)
    qa2 = torch.randn(200, K, device=device).to(E4M3)
    with pytest.raises(ValueError, match="scale_a must be a scalar"):
        onegemm.blockscaled_matmul(qa2, qw.t(), sa, sw.t())


def test_ambiguous_k_le_128_row_is_one_block(device):
    """K <= 128: [M, 1] is both row-wise and 1x128, [1, N] both col-wise and 128x1, [1, nb]
    128x128; all readings agree (rows of scale b broadcast over the single K block)."""
    M, N, K = 60, 150, 100
    qa, sa = quantize_fp8_ref(make_input((M, K), device), "row")
    qw, sw = quantize_fp8_ref(make_input((N, K), device), "row")
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    ref = blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (1, 128), (128, 1))
    assert_close(out, ref, KERNEL_TOL)
    # The 128x128 reading of B: a [1, nb] scale, one value per 128 columns.
    sw_blk = torch.rand(1, triton.cdiv(N, 128), device=device) + 0.5
    out_blk = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw_blk, out_dtype=torch.float32)
    assert_close(out_blk, blockscaled_matmul_ref(qa, qw.t(), sa, sw_blk, (1, 128), (128, 128)), KERNEL_TOL)


def test_ambiguous_n1(device):
    """N == 1: [kb, 1] is both 128x1 and 128x128."""
    qa, sa = quantize_fp8_ref(make_input((40, 300), device), (1, 128))
    qw, sw = quantize_fp8_ref(make_input((1, 300), device), (1, 128))
    out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    for block in [(128, 1), (128, 128)]:
        assert_close(out, blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (1, 128), block), KERNEL_TOL)


def test_ambiguous_shapes_take_the_coarsest_reading():
    """Where readings of a shape coincide (blockscaled/matmul.py's docstring) the coarsest is
    taken: a scale constant along K goes to the epilogue, not the K loop."""
    def kind_a(shape, M, K):
        return read_granularity("scale_a", torch.ones(shape), SCALES_A, "a", ("M", "K"), (M, K))

    def kind_b(shape, K, N):
        return read_granularity("scale_b", torch.ones(shape), SCALES_B, "b", ("K", "N"), (K, N))

    assert kind_a((1, 1), 1, 100) == TENSOR  # also [M, 1], [M, kb] and [mb, kb]
    assert kind_a((60, 1), 60, 100) == ROW  # also [M, kb] (K <= 128)
    assert kind_a((1, 3), 1, 300) == ROW_BLOCKS  # also [mb, kb] (M == 1)
    assert kind_b((1, 150), 100, 150) == COL  # also [kb, N] (K <= 128)
    assert kind_b((3, 1), 300, 1) == COL_BLOCKS  # also [kb, nb] (N == 1)


@pytest.mark.parametrize("M,N", [(0, 5), (5, 0)])
def test_empty_output(M, N, device):
    K = 64
    out = onegemm.blockscaled_matmul(
        torch.randn(M, K, device=device).to(E4M3), torch.randn(K, N, device=device).to(E4M3),
        torch.ones((), device=device), torch.ones((), device=device),
    )
    assert out.shape == (M, N) and out.dtype == torch.bfloat16 and out.device.type == torch.device(device).type


def test_k_zero_gives_act_bias(device):
    a = torch.empty(6, 0, device=device, dtype=E4M3)
    b = torch.empty(0, 9, device=device, dtype=E4M3)
    bias = torch.randn(9, device=device)
    out = onegemm.blockscaled_matmul(a, b, torch.ones(6, 0, device=device), torch.ones(0, 9, device=device),
                                     out_dtype=torch.float32, bias=bias, activation="silu")
    assert_close(out, torch.nn.functional.silu(bias.double()).expand(6, 9), 1e-6)


# (match, kwargs(t), exception) for a [200, 300] x [300, 150] call: t.f8(*shape) is a random
# e4m3 tensor, t.ones(*shape) an fp32 one (t.one the scalar scale), on the test's device.
_M, _K, _N = 200, 300, 150
BAD_CASES = [
    pytest.param("scale_a must be a scalar", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.ones(_M, 2), scale_b=t.one),
                 ValueError, id="scale_a [M, 2]"),
    pytest.param("scale_a must be a scalar", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.ones(_M), scale_b=t.one),
                 ValueError, id="scale_a 1-D"),
    pytest.param("scale_b must be a scalar", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.ones(_N, 3)),
                 ValueError, id="scale_b [N, 3]"),
    pytest.param("scale_b must be a scalar", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.ones(3, 3)),
                 ValueError, id="scale_b [3, 3]"),
    pytest.param("scale_a must be of dtype", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.one.half(), scale_b=t.one),
                 TypeError, id="scale_a fp16"),
    pytest.param("a must be float8", lambda t: dict(a=t.ones(_M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.one),
                 TypeError, id="a fp32"),
    pytest.param("b must be float8", lambda t: dict(a=t.f8(_M, _K), b=t.ones(_K, _N).bfloat16(), scale_a=t.one, scale_b=t.one),
                 TypeError, id="b bf16"),
    pytest.param("b must be float8_e4m3fn when a is float8_e5m2", lambda t: dict(a=t.f8(_M, _K).to(E5M2), b=t.f8(_K, _N).to(E5M2), scale_a=t.one, scale_b=t.one),
                 TypeError, id="e5m2 x e5m2"),
    pytest.param("b must be \\[K, N\\]", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K + 1, _N), scale_a=t.one, scale_b=t.one),
                 ValueError, id="K mismatch"),
    pytest.param("bias must be of shape", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.one, bias=t.ones(_M)),
                 ValueError, id="bias [M]"),
    pytest.param("a must be 2-D", lambda t: dict(a=t.f8(2, _M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.one),
                 ValueError, id="a 3-D"),
    pytest.param("out_dtype", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.one, out_dtype=E4M3),
                 TypeError, id="out_dtype e4m3"),
    pytest.param("use_fast_accum", lambda t: dict(a=t.f8(_M, _K), b=t.f8(_K, _N), scale_a=t.one, scale_b=t.one,
                                                  use_fast_accum="yes"), TypeError, id="use_fast_accum str"),
]


class _Factory:
    def __init__(self, device):
        self.device = device
        self.one = torch.ones((), device=device)

    def f8(self, *shape):
        return torch.randn(*shape, device=self.device).to(E4M3)

    def ones(self, *shape):
        return torch.ones(*shape, device=self.device)


@pytest.mark.parametrize("match,kwargs,exc", BAD_CASES)
def test_bad_input(match, kwargs, exc, device):
    with pytest.raises(exc, match=match):
        onegemm.blockscaled_matmul(**kwargs(_Factory(device)))


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1), (333, 777), (4096, 7168), (16, 4096)], ids=str)
@pytest.mark.parametrize("block", [(1, 128), (128, 128), "row", "tensor"], ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("pow2_scale", [False, True])
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
def test_gpu_quantize_kernel_matches_torch(shape, block, dtype, pow2_scale, scale_rule, device):
    """The fused kernel (autotuned) gives the torch path's fp8 bits and scales exactly."""
    torchao = scale_rule == "torchao"
    for layout in ["contig", "transposed"]:
        x = make_input(shape, device, layout, dtype=torch.bfloat16)
        q, scale = _quantize_triton(x, granularity(block), dtype, pow2_scale, torchao=torchao)
        q_ref, scale_ref = _quantize_torch(x, granularity(block), dtype, pow2_scale, torchao)
        assert torch.equal(scale, scale_ref), layout
        mismatch = (bits(q) != bits(q_ref)).sum().item()
        assert mismatch == 0, f"{layout}: {mismatch} of {q.numel()} fp8 values differ"


@pytest.mark.gpu
def test_gpu_quantize_kernel_non_finite_and_zero(device):
    x = make_input((256, 512), device)
    x[:128, :128] = 0
    x[200, 300] = float("nan")
    q, scale = _quantize_triton(x, granularity((128, 128)), E4M3, False)
    assert scale[0, 0].item() == 1.0 and (q[:128, :128].float() == 0).all()
    assert math.isinf(scale[1, 2].item())
    with pytest.raises(ValueError, match="x must be finite"):
        onegemm.quantize_fp8(x, (128, 128), check_finite=True)


def _scaled_mm_blockwise(qa, sa, qw, sw):
    """torch._scaled_mm's DeepSeek recipe: scale_a [M, kb] outer-dim-major,
    scale_b [kb, nb] a transposed view of a contiguous [nb, kb]. Skips (never passes) if this
    torch refuses the recipe."""
    try:
        return torch._scaled_mm(qa, qw.t(), scale_a=sa.t().contiguous().t(), scale_b=sw.contiguous().t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        pytest.skip(f"torch {torch.__version__} refuses blockwise torch._scaled_mm: {str(e).splitlines()[0]}")


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(128, 256, 512), (2048, 7168, 2048), (4096, 2112, 7168), (16, 4096, 4096), (8192, 4096, 4096)])
def test_gpu_matches_scaled_mm_blockwise(M, N, K, device):
    """Same fp8 values and scales as cuBLAS's blockwise _scaled_mm: the two bf16 results agree
    to bf16 rounding, and both are within the kernel tolerance of float64."""
    qa, sa = onegemm.quantize_fp8(torch.randn(M, K, device=device, dtype=torch.bfloat16))
    qw, sw = onegemm.quantize_fp8(torch.randn(N, K, device=device, dtype=torch.bfloat16), (128, 128))
    ours = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t())
    theirs = _scaled_mm_blockwise(qa, sa, qw, sw)
    ref = blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (1, 128), (128, 128))
    assert_close(ours, ref, TOL[torch.bfloat16])
    assert_close(ours, theirs, TOL[torch.bfloat16], "onegemm vs torch._scaled_mm")
    assert rel_err(ours, ref) <= 1.5 * rel_err(theirs, ref) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", BLOCKSCALED_CONFIGS, ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("grans", [("1x128", "128x128"), ("row", "col")], ids=str)
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_every_config(cfg, grans, tma, device):
    """Each Hopper config, forced, in both load flavours, with partial tiles and partial scale
    blocks on every edge (sizes multiples of 16 so that TMA may run, none of 128)."""
    M, N, K = 336, 560, 784
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, bias=bias, activation="gelu", config=cfg, tma=tma)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb, bias, "gelu"), KERNEL_TOL)


@pytest.mark.parametrize("grans", [("1x128", "128x128"), ("1x128", "128x1")], ids=str)
def test_warp_specialize_switch(grans, device):
    """A config with WARP_SPECIALIZE reaches the K loop and gives the same product. (On CPU
    the interpreter runs the loop as written; on the H200 it is a warp-specialised loop.)"""
    M, N, K = 70, 96, 304  # fp8 rows of 304 bytes: 16-byte multiples, as TMA needs
    tile, warps, stages = (32, 1, 1) if onegemm.INTERPRET else (128, 4, 3)
    cfg = triton.Config({"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_K": 128, "GROUP_M": 4}, num_warps=warps, num_stages=stages)
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, config=warp_specialized(cfg), tma=True)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


@pytest.mark.parametrize("layout", ["a_mn_major", "b_mn_major"])
def test_warp_specialize_switch_mn_major(layout, device):
    """A forced WARP_SPECIALIZE config on an fp8 operand stored MN-major (TMA reads it, but
    Triton 3.6 cannot warp-specialise the transpose: core's K loop then runs unspecialised).
    It must still compile and give the same product, not fail or abort on the H200."""
    M, N, K = 80, 96, 304  # 16-byte multiples both ways, so either orientation takes TMA
    tile, warps, stages = (32, 1, 1) if onegemm.INTERPRET else (128, 4, 4)
    cfg = triton.Config({"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_K": 128, "GROUP_M": 4}, num_warps=warps, num_stages=stages)
    qa, sa, ba = quant_a(make_input((M, K), device), "1x128")
    qb, sb, bb = quant_b(make_input((N, K), device), "128x128")
    if layout == "a_mn_major":
        qa = qa.t().contiguous().t()
    else:
        qb = qb.contiguous()
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, config=warp_specialized(cfg), tma=True)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


# (M, N, K, tile, warps, stages): more tiles than programs, so each program walks several and
# a tile the loop skipped would stay NaN. Interpreter: 3 x 5 tiles over 4 programs; H200:
# 12 x 14 = 168 tiles of 128x128 over 132 SMs, edges partial in M, N, K and the scale blocks.
PERSISTENT_CASE = (70, 152, 304, 32, 1, 1) if onegemm.INTERPRET else (1500, 1700, 784, 128, 4, 4)


@pytest.mark.parametrize("ws", [False, True], ids=["plain", "warp_specialized"])
@pytest.mark.parametrize("grans", [("1x128", "128x128"), ("128x128", "128x1"), ("row", "col")], ids=str)
def test_persistent_schedule(grans, ws, device):
    """A PERSISTENT config launches min(SM count, tiles) programs, each looping over tiles
    pid, pid + P, ... (4 programs under the interpreter); every tile must still be written
    once, with its own block scales, bias and activation."""
    M, N, K, tile, warps, stages = PERSISTENT_CASE
    assert triton.cdiv(M, tile) * triton.cdiv(N, tile) > default_programs(torch.device(device).index)
    cfg = triton.Config({"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_K": 128, "GROUP_M": 4, "PERSISTENT": True},
                        num_warps=warps, num_stages=stages)
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, bias=bias, activation="silu",
                                     config=warp_specialized(cfg) if ws else cfg, tma=True if ws else None)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb, bias, "silu"), KERNEL_TOL)


# (M, N, K, SPLIT_K, (gran_a, gran_b), persistent, tma): split-K over whole 128-deep K blocks,
# so each split applies its own blocks' scales: uneven (3 blocks over 2), empty splits (3 over
# 4; 4 over 3 gives 2, 2, 0), epilogue-only scales, the persistent schedule walking
# (tile, split) units, and the TMA flavour (K = 304: 16-byte fp8 rows).
SPLIT_CASES = [
    (70, 152, 300, 2, ("1x128", "128x128"), False, None),
    (33, 40, 300, 4, ("128x128", "128x1"), False, None),
    (20, 64, 400, 3, ("row", "col"), False, None),
    (70, 152, 304, 2, ("1x128", "128x128"), True, None),
    (48, 80, 304, 3, ("1x128", "128x128"), False, True),
]


@pytest.mark.parametrize("M,N,K,split,grans,persistent,tma", SPLIT_CASES)
def test_split_k(M, N, K, split, grans, persistent, tma, device):
    """Split-K (core/splitk.py): every (tile, split) sums its own K blocks with their scales,
    the last split of a tile adds the partials and alone runs bias and activation."""
    tile, warps, stages = (32, 1, 1) if onegemm.INTERPRET else (64, 4, 3)
    cfg = triton.Config({"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_K": 128, "GROUP_M": 4, "SPLIT_K": split,
                         "PERSISTENT": persistent}, num_warps=warps, num_stages=stages)
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, bias=bias, activation="silu",
                                     config=cfg, tma=tma)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb, bias, "silu"), KERNEL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("grans", [("1x128", "128x128"), ("128x128", "128x1"), ("1x128", "col")], ids=str)
def test_gpu_warp_specialized_configs(stages, grans, device):
    """The warp-specialised 128x128 configs bench/diagnose_blockscaled.py sweeps (4 warps: a
    producer and two 64-row consumer warpgroups), forced, with partial tiles and scale blocks
    on every edge: per-row scales are what each consumer must index from its own rows."""
    cfg = warp_specialized(triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}, num_warps=4, num_stages=stages))
    M, N, K = 336, 560, 784
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, config=cfg, tma=True)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


CFG_128x128 = next(c for c in BLOCKSCALED_CONFIGS if c.kwargs["BLOCK_N"] == 128 and c.kwargs["BLOCK_M"] == 128)


@pytest.mark.gpu
@pytest.mark.parametrize("gran_a", list(A_GRANS))
@pytest.mark.parametrize("gran_b", list(B_GRANS))
def test_gpu_every_pair_compiled(gran_a, gran_b, device):
    """The 16 pairs compiled for sm_90 (each is its own specialisation), one forced config so
    the run stays short; autotuning is covered by the other GPU tests."""
    M, N, K = 1000, 1536, 2100
    qa, sa, ba = quant_a(make_input((M, K), device), gran_a)
    qb, sb, bb = quant_b(make_input((N, K), device), gran_b)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, config=CFG_128x128)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


@pytest.mark.gpu
def test_gpu_calc_diff_at_large_k(device):
    """The accuracy target: calc_diff < 1e-3 against the unquantised product up to K = 16384
    (per-K-block promotion keeps the tensor core's short accumulator from drifting)."""
    for K in [4096, 16384]:
        a = torch.randn(256, K, device=device)
        w = torch.randn(512, K, device=device)
        qa, sa = onegemm.quantize_fp8(a)
        qw, sw = onegemm.quantize_fp8(w, (128, 128))
        out = onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32)
        assert calc_diff(out, a.double() @ w.double().t()) < 1e-3, K


@pytest.mark.gpu
def test_gpu_int64_offsets(device):
    """A [M, K] fp8 with M * K > 2^31 elements (2.1 GB): row offsets need int64."""
    M, K, N = 2**31 // 4096 + 2048, 4096, 128
    a = torch.empty(M, K, device=device, dtype=E4M3)
    a[: M // 2].copy_(torch.randn(M // 2, K, device=device, dtype=torch.bfloat16))
    a[M // 2 :].copy_(torch.randn(M - M // 2, K, device=device, dtype=torch.bfloat16))
    sa = torch.rand(M, K // 128, device=device) + 0.5
    qw, sw = onegemm.quantize_fp8(torch.randn(N, K, device=device), (128, 128))
    out = onegemm.blockscaled_matmul(a, qw.t(), sa, sw.t(), out_dtype=torch.float32)
    tail = slice(M - 3000, M)
    assert_close(out[tail], blockscaled_matmul_ref(a[tail], qw.t(), sa[tail], sw.t(), (1, 128), (128, 128)), KERNEL_TOL)
    del a, out
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- the sm_90 Gluon body
# core/hopper_fp8.py: block-scaled FP8 on sm_90 runs a Gluon K loop. Gluon has no
# interpreter, so its kernels run on the H200 only (the GPU tests below); the CPU tests check
# the dispatch rule that decides between it and core's Triton body.

WGMMA_PAIRS = [("1x128", "128x128"), ("128x128", "128x128"), ("1x128", "128x1"), ("128x128", "128x1")]


def _dispatch_case(M, N, K, kinds=("1x128", "128x128"), a_layout="contig", b_layout="k_major", out=torch.bfloat16):
    a = torch.empty((M, K) if a_layout == "contig" else (K, M), dtype=E4M3)
    a = a if a_layout == "contig" else a.t()
    b = torch.empty((N, K), dtype=E4M3).t() if b_layout == "k_major" else torch.empty((K, N), dtype=E4M3)
    return a, b, torch.empty((M, N), dtype=out), Scaling.parse(",".join(kinds))


# (what changes from a 512 x 256 x 256 1x128 x 128x128 call, tma, the rule's answer)
DISPATCH_CASES = [
    ({}, None, True),
    ({}, True, True),
    ({}, False, False),                                  # pointer loads asked for
    ({"M": 127}, None, False),                           # below hopper_configs.WGMMA_MIN_M
    ({"kinds": ("128x128", "128x1")}, None, True),
    ({"kinds": ("row", "128x128")}, None, False),        # block scales on one operand only: the Triton body
    ({"kinds": ("1x128", "tensor")}, None, False),
    ({"kinds": ("row", "col")}, None, True),             # epilogue scales on both
    ({"kinds": ("tensor", "tensor")}, None, True),
    ({"kinds": ("row", "tensor")}, None, True),
    ({"a_layout": "transposed"}, None, False),           # fp8 wgmma reads K-major operands only
    ({"b_layout": "row_major"}, None, False),
    ({"K": 200}, None, False),                           # fp8 rows of 200 bytes: no TMA box
    ({"N": 300}, None, False),                           # bf16 output rows of 600 bytes
    ({"N": 300, "out": torch.float32}, None, True),      # 1200 bytes
]


@pytest.mark.parametrize("change,tma,expected", DISPATCH_CASES, ids=str)
def test_wgmma_dispatch_rule(change, tma, expected, monkeypatch):
    """On an sm_90 GPU (stood in for here), block scales on both operands or on neither,
    K-major TMA-able operands and M >= WGMMA_MIN_M take the Gluon body; anything else core's
    Triton body."""
    monkeypatch.setattr(hopper_fp8, "on_sm90", lambda t: True)
    args = dict(M=512, N=256, K=256)
    args.update(change)
    assert hopper_fp8.uses_gluon_body(*_dispatch_case(**args), tma, None) is expected
    if expected is False and args["M"] >= WGMMA_MIN_M:
        with pytest.raises(ValueError, match="config"):  # a forced Gluon config says why not
            hopper_fp8.uses_gluon_body(*_dispatch_case(**args), tma, wgmma_cfg(128, 4, 4))


# (key, the heuristic's tile (BLOCK_M x BLOCK_N)): fast accumulation holds one fp32
# accumulator per consumer, so 64 x 256 halves of a 128 x 256 tile where they fill the SMs;
# a promoting K loop holds a second (the raw block), so 128 columns, on 256 rows (each
# consumer's 128 as two 64-row halves) where two waves of such tiles fill the SMs.
BLOCK_BOTH = Scaling.parse("128x128,128x128")
WGMMA_HEURISTIC_CASES = [
    (WgmmaKey(4096, 4096, 4096, Scaling.parse("row,col"), "bf16", fast_accum=True), (128, 256)),
    (WgmmaKey(512, 1024, 4096, Scaling.parse("row,col"), "bf16", fast_accum=True), (128, 128)),
    (WgmmaKey(4096, 4096, 4096, Scaling.parse("row,col"), "bf16"), (256, 128)),
    (WgmmaKey(4096, 4096, 4096, BLOCKWISE, "bf16"), (128, 128)),  # 1x128 scale_a: 64-row scale vectors spill
    (WgmmaKey(4096, 4096, 4096, BLOCK_BOTH, "bf16"), (256, 128)),
    (WgmmaKey(4096, 2112, 7168, BLOCK_BOTH, "bf16"), (128, 128)),  # 2.06 waves of 256 x 128 tiles
    (WgmmaKey(2048, 2048, 4096, BLOCK_BOTH, "bf16"), (128, 128)),  # one wave of them
    (WgmmaKey(4096, 4096, 4096, BLOCK_BOTH, "fp32"), (128, 128)),  # its fp32 staging leaves no third ring slot
]


@pytest.mark.parametrize("key,tile", WGMMA_HEURISTIC_CASES, ids=str)
def test_wgmma_heuristic_and_candidates(key, tile):
    """The heuristic's tile per K loop, and every candidate fits the H200's shared memory;
    256-wide and 256-row candidates come with fast accumulation, or as a promoting loop's two
    halves (SPLIT) except with 1x128 scale_a (which spills there)."""
    pick = wgmma_heuristic(key, 132)
    assert (pick.kwargs["BLOCK_M"], pick.kwargs["BLOCK_N"]) == tile
    found = wgmma_candidates(key, 132)
    assert all(hopper_configs._wgmma_fits(c, key.out, key.mode) for c in found)
    roomy = key.out != "fp32"  # a 256-wide or -tall fp32 staging tile leaves no room for three ring slots
    assert any(c.kwargs["BLOCK_N"] == 256 for c in found) == (roomy and (key.fast_accum or key.scaling.a != ROW_BLOCKS))
    assert any(c.kwargs["BLOCK_M"] == 256 for c in found) == (roomy and not key.fast_accum and key.scaling.a != ROW_BLOCKS)
    assert any(c.kwargs.get("PINGPONG") for c in found) == key.fast_accum


@pytest.mark.parametrize("grans", [("row", "col"), ("tensor", "tensor"), ("1x128", "128x128")], ids=str)
def test_use_fast_accum_is_a_permission(grans, device):
    """use_fast_accum=True allows reduced-precision accumulation; core's Triton body (here)
    promotes anyway, so both calls match the float64 reference as closely."""
    M, N, K = 130, 150, 300
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    ref = blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb)
    for fast in (False, True):
        out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, use_fast_accum=fast)
        assert_close(out, ref, KERNEL_TOL, f"use_fast_accum={fast}")


def test_wgmma_dispatch_off_sm90(device):
    """Off sm_90 (the interpreter, a CPU tensor, another GPU) every call takes the Triton
    body, and forcing a Gluon config is a ValueError naming ``config``; a forced Triton
    config always takes the Triton body."""
    call = _dispatch_case(512, 256, 256)
    if hopper_fp8.on_sm90(torch.empty(1, device=device)):
        pytest.skip("this GPU is sm_90: the GPU tests below cover it")
    assert hopper_fp8.uses_gluon_body(*call, None, None) is False
    assert hopper_fp8.uses_gluon_body(*call, None, BLOCKSCALED_CONFIGS[0]) is False
    with pytest.raises(ValueError, match="config.*sm_90"):
        hopper_fp8.uses_gluon_body(*call, None, wgmma_cfg(128, 4, 4))
    qa, sa, _ = quant_a(make_input((64, 128), device), "1x128")
    qb, sb, _ = quant_b(make_input((64, 128), device), "128x128")
    with pytest.raises(ValueError, match="config"):
        onegemm.blockscaled_matmul(qa, qb, sa, sb, config=wgmma_cfg(128, 4, 4))


def _wgmma_plans():
    return [p for p in plans("blockscaled_wgmma").values()]


# (M, N, K): M = 1..128 (forced: the rule gives these to the Triton body), N not a multiple of
# 128, K not a multiple of 128 and K-block counts that leave each K_GROUP's remainder
# (2, 3, 5, 7, 8, 9, 16 blocks), more tiles than SMs (each program walks several).
WGMMA_SHAPES = [(1, 256, 256), (17, 200, 336), (64, 136, 1024), (127, 512, 640), (128, 2112, 896),
                (300, 264, 1152), (2048, 7168, 2048), (1500, 1704, 784)]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("M,N,K", WGMMA_SHAPES)
@pytest.mark.parametrize("grans", WGMMA_PAIRS, ids=str)
def test_gpu_wgmma_body(M, N, K, grans, device):
    """The Gluon body (forced with its default config) against float64, with every edge
    partial: TMA boxes past M, N and K arrive zero-filled and the stores clip."""
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    cfg = wgmma_heuristic(WgmmaKey(M, N, K, Scaling.parse(",".join(grans)), "fp32"), 132)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, config=cfg)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


def _every_wgmma_config():
    """(scale kinds, use_fast_accum, config) for each config the dense Gluon body is tuned
    over, each with the first K loop it is a candidate of."""
    cases = {}
    for grans, fast in ((("1x128", "128x1"), False), (("1x128", "128x128"), False), (("128x128", "128x128"), False),
                        (("row", "col"), False), (("row", "col"), True)):
        key = WgmmaKey(512, 512, 512, Scaling.parse(",".join(grans)), "bf16", fast_accum=fast)
        for c in wgmma_candidates(key, 132):
            cases.setdefault((configs.config_id(c), fast), pytest.param(
                grans, fast, c, id=f"{configs.label(c)} {','.join(grans)}{' fast' if fast else ''}"))
    return list(cases.values())


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("grans,fast,cfg", _every_wgmma_config())
# 10 K blocks: two groups of 4 and a remainder, or five of 2; then more tiles than 2 x 132 SMs,
# so that each program walks several (pingpong: both consumers, in turns)
@pytest.mark.parametrize("M,N,K", [(336, 560, 1168), (1664, 3200, 640)], ids=["one-tile-each", "several-tiles-each"])
def test_gpu_wgmma_every_config(grans, fast, cfg, M, N, K, device):
    """Each config the Gluon body is tuned over, on partial tiles, with bias and activation."""
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, bias=bias, activation="gelu", use_fast_accum=fast, config=cfg)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb, bias, "gelu"), TOL[torch.bfloat16])
    assert torch.equal(out, onegemm.blockscaled_matmul(qa, qb, sa, sb, bias=bias, activation="gelu",
                                                       use_fast_accum=fast, config=cfg))  # bitwise on a rerun


# The split tiles (two accumulators per consumer): 256 x 128 (SPLIT_M, two 64-row halves) on
# each scaling of A it serves, 128 x 256 (two 128-column halves) where it compiles spill-free.
SPLIT_CASES = [(128, 256, "1x128"), (128, 256, "128x128"), (128, 256, "row"), (256, 128, "1x128"), (256, 128, "128x128"),
               (256, 128, "row")]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("M,N,K", WGMMA_SHAPES)
@pytest.mark.parametrize("bn,bm,gran_a", SPLIT_CASES, ids=lambda c: str(c))
def test_gpu_wgmma_split_tiles(M, N, K, bn, bm, gran_a, device):
    """Each split tile against float64 with every edge partial (a 256-row tile past M keeps
    its second consumer's rows, or a half of them, wholly outside), fp32 out."""
    gran_b = "col" if gran_a == "row" else "128x128"
    qa, sa, ba = quant_a(make_input((M, K), device), gran_a)
    qb, sb, bb = quant_b(make_input((N, K), device), gran_b)
    # two ring slots: an fp32 256 x 128 staging tile fits beside them
    cfg = hopper_configs.tall_cfg(2) if bm == 256 else hopper_configs.wgmma_cfg(bn, 2, 1, bm=bm)
    torch.full((M, N), float("nan"), device=device)  # freed: the output below reuses its NaN block
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, config=cfg)
    assert_close(out, blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb), KERNEL_TOL)


# Epilogue scales on both operands (tensor, row, column): the Gluon body's K loop promotes
# each K block unscaled, or with use_fast_accum sums the whole K in the tensor core, whose
# accumulator keeps about 14 bits (docs/hopper.md): its error grows with K's block count.
WGMMA_EPILOGUE_PAIRS = [("row", "col"), ("tensor", "tensor"), ("row", "tensor"), ("tensor", "col")]
FAST_ACC_TOL = 3e-3


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("M,N,K", WGMMA_SHAPES)
@pytest.mark.parametrize("grans", WGMMA_EPILOGUE_PAIRS, ids=str)
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast-accum"])
def test_gpu_wgmma_epilogue_scaled(M, N, K, grans, fast, device):
    """The epilogue-scaled K loops (forced with their default config) against float64, every
    edge partial, and the Triton body (which always promotes) as a cross-check."""
    qa, sa, ba = quant_a(make_input((M, K), device), grans[0])
    qb, sb, bb = quant_b(make_input((N, K), device), grans[1])
    cfg = wgmma_heuristic(WgmmaKey(M, N, K, Scaling.parse(",".join(grans)), "fp32", fast_accum=fast), 132)
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, use_fast_accum=fast, config=cfg)
    ref = blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb)
    assert_close(out, ref, FAST_ACC_TOL if fast else KERNEL_TOL)
    triton_body = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=torch.float32, tma=False)
    assert_close(out, triton_body.double(), FAST_ACC_TOL if fast else KERNEL_TOL, "Gluon vs Triton body")


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_rowwise_dispatch_and_fast_accum(device):
    """An unforced row-wise call at M >= WGMMA_MIN_M runs the Gluon body; use_fast_accum picks
    its fast_accum plan, and both match torch._scaled_mm's row-wise mode on the same inputs."""
    M, N, K = 1024, 768, 2048
    qa, sa, ba = quant_a(make_input((M, K), device, spread=False), "row")
    qb, sb, bb = quant_b(make_input((N, K), device, spread=False), "col")
    ref = blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb)
    for fast in (False, True):
        launch.clear_plans()
        out = onegemm.blockscaled_matmul(qa, qb, sa, sb, use_fast_accum=fast)
        assert [p.meta["FAST_ACC"] for p in _wgmma_plans()] == [fast]
        torch_out = torch._scaled_mm(qa, qb, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        assert_close(out, ref, TOL[torch.bfloat16])
        assert_close(out, torch_out.double(), TOL[torch.bfloat16], "onegemm vs torch._scaled_mm")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("activation", [None, "relu", "silu", "gelu_tanh"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_wgmma_dispatch_epilogue(activation, out_dtype, device):
    """An unforced call at M >= WGMMA_MIN_M reaches the Gluon body (a plan of its launcher
    appears) and applies bias, activation and out dtype as the Triton body does."""
    M, N, K = 384, 264, 400
    # unit-scale inputs: make_input's spread of magnitudes would overflow a float16 output
    qa, sa, ba = quant_a(make_input((M, K), device, spread=False), "1x128")
    qb, sb, bb = quant_b(make_input((N, K), device, spread=False), "128x128")
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    launch.clear_plans()
    out = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=out_dtype, bias=bias, activation=activation)
    assert len(_wgmma_plans()) == 1
    ref = blockscaled_matmul_ref(qa, qb, sa, sb, ba, bb, bias, activation)
    assert_close(out, ref, max(KERNEL_TOL, TOL[out_dtype]))
    triton_body = onegemm.blockscaled_matmul(qa, qb, sa, sb, out_dtype=out_dtype, bias=bias, activation=activation, tma=False)
    assert_close(out, triton_body, max(KERNEL_TOL, TOL[out_dtype]), "Gluon vs Triton body")


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_fp8_linear_uses_wgmma_body(device):
    """Fp8Linear's forward and both backward GEMMs (1x128 x 128x128, and the weight
    gradient's 1x128 x 128x1) take the Gluon body at M >= WGMMA_MIN_M, and match the float64
    reference of the same quantised operands."""
    layer = onegemm.Fp8Linear(384, 264, bias=True, trainable=True, device=device)
    x = torch.randn(512, 384, device=device, requires_grad=True)
    launch.clear_plans()
    layer(x).float().square().sum().backward()
    kinds = {p.meta["SB_COLS"] for p in _wgmma_plans()}
    assert kinds == {1, 128}, kinds
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
