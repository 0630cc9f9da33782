"""The MXFP4 reference codec in onegemm.testing (what 4-bit expert kernels are checked against):
every byte and every scale decoded as the OCP MX format and gpt-oss's checkpoints define them,
against a table written here and against transformers' own decoder; the quantiser's scale
rules, ties, clamping and sign of zero; a round trip of MXFP4 values."""

import math

import pytest
import torch

from onegemm.testing import E2M1_MAGNITUDES, MXFP4_BLOCK, mxfp4_dequantize_ref, mxfp4_quantize_ref

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
