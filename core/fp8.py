"""FP8 quantisation arithmetic as ``@triton.jit`` helpers: the scale rule and the cast.

One definition for every kernel that writes fp8: blockscaled/'s quantiser
(``quantize_fp8``) and the tile body's quantised output (``tiles.quantize_tile``, e.g. the
MoE GEMM1 epilogue that writes its SwiGLU output as fp8 plus 1x128 scales). The rule, also
written out in blockscaled/quantize.py's docstring and its torch path:

    scale = max(amax / FP8_MAX, FLT_MIN) if amax > 0 else 1.0   (NaN counts as inf in amax)
    q     = fp8(clamp(x / scale, -FP8_MAX, FP8_MAX)), rounded to nearest even

and torchao's (``scale_rule="torchao"``, so that its float8 training recipes quantise alike):

    mult  = fp32(FP8_MAX / max(amax, 1e-12)), pow2: rounded down to a power of two
    q     = fp8(clamp(x * mult, -FP8_MAX, FP8_MAX)); the dequantisation scale is 1 / mult
"""

import triton
import triton.language as tl

from .runtime import INTERPRET

FLT_MIN: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # smallest normal fp32
_ROUND: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it - it rounds |x| < 2^22 to an integer (RNE)
# The quantiser's cast: the GPU's own (exact, RNE); the interpreter's needs fp8_grid's rounding.
HW_CAST: tl.constexpr = tl.constexpr(not INTERPRET)
_FAST_LO: tl.constexpr = tl.constexpr(2.0**-60)  # divide_rn's fast range of scales
_FAST_HI: tl.constexpr = tl.constexpr(2.0**100)


@triton.constexpr_function
def fp8_format(dtype):
    """(max, mantissa bits, exponent of the smallest normal) of e4m3fn or e5m2, at compile time."""
    return (448.0, 3, -6) if dtype == tl.float8e4nv else (57344.0, 2, -14)


@triton.jit
def round_up_pow2(scale):
    """Next power of two >= scale, for positive normal (or inf) fp32: clear the mantissa and,
    if it was not already zero, add one to the exponent. Exact, unlike exp2(ceil(log2(s)))."""
    bits = scale.to(tl.int32, bitcast=True)
    up = tl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
    return ((bits & 0x7F800000) + up).to(tl.float32, bitcast=True)


@triton.jit
def amax_input(x):
    """|x| as the amax sees it: NaN counts as inf, so a block holding NaN gets an inf scale
    and dequantises to NaN instead of finite values."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def fp8_scale(amax, dtype: tl.constexpr, POW2: tl.constexpr = False):
    """The scale of blocks with maximum magnitude ``amax`` (fp32, any shape)."""
    FP8_MAX: tl.constexpr = fp8_format(dtype)[0]
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), FLT_MIN)
    scale = tl.where(amax > 0, scale, 1.0)
    if POW2:
        scale = round_up_pow2(scale)
    return scale


@triton.jit
def fp8_grid(x, scale, dtype: tl.constexpr):
    """x / scale on ``dtype``'s grid, in fp32: a correctly rounded division (the same bits as
    torch's x / scale), then ``fp8_round``. Hardware casts round the same way; Triton's
    interpreter does not carry a rounding into the exponent (31.3 -> 16 in e4m3), so with the
    explicit rounding the CPU tests check the GPU's arithmetic. (``fp8_cast``, the standalone
    quantiser's cast, uses the hardware's on a GPU, where the GPU tests compare its bits with
    the torch path's.)"""
    return fp8_round(tl.math.div_rn(x.to(tl.float32), scale), dtype)


@triton.jit
def fp8_round(q, dtype: tl.constexpr):
    """fp32 q clamped to ``dtype``'s range (NaN stays NaN) and rounded to its grid, to nearest
    even, in fp32: casting the result to ``dtype`` is exact."""
    FP8_MAX: tl.constexpr = fp8_format(dtype)[0]
    MANT: tl.constexpr = fp8_format(dtype)[1]
    MIN_EXP: tl.constexpr = fp8_format(dtype)[2]
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = q.to(tl.int32, bitcast=True)
    # The grid's spacing at |q|: 2^(exponent - MANT), at least the subnormals' 2^(MIN_EXP - MANT);
    # it and its inverse are built from exponent bits, so the scaling below is exact.
    exp_bits = tl.maximum(bits & 0x7F800000, (MIN_EXP + 127) << 23)
    ulp = (exp_bits - (MANT << 23)).to(tl.float32, bitcast=True)
    inv_ulp = ((254 << 23) - (exp_bits - (MANT << 23))).to(tl.float32, bitcast=True)
    r = ((tl.abs(q) * inv_ulp + _ROUND) - _ROUND) * ulp
    # The sign goes back on by q's sign bit, so -0 and values rounding to -0 keep it.
    return tl.where(bits < 0, r * -1.0, r)  # not -r: Triton negates as 0 - r, which makes -0 +0


@triton.jit
def divide_rn(x, scale):
    """x / scale correctly rounded (the bits of torch's division), x fp32, scale fp32 of at
    least one dim, broadcastable to x. On a GPU, when every scale lies in [2^-60, 2^100]: one
    correctly rounded reciprocal per scale, then per element a product and two residual
    corrections (the in-range sequence of the hardware's own div.rn, less its per-element
    reciprocal and range check, which made the quantisers compute-bound). The fp32 bits are
    torch's wherever |x / scale| >= 2^-42; below, a residual can underflow (subnormal x) and
    the last bit differ, far under any fp8 value, so every fp8 cast of the quotient is
    torch's. Other scales (an inf scale of a non-finite block, tiny ones) take div_rn."""
    if HW_CAST:
        fast = tl.min(((scale >= _FAST_LO) & (scale <= _FAST_HI)).to(tl.int32))
        if fast == 1:
            r = tl.math.div_rn(1.0, scale)
            q0 = x * r
            e0 = tl.fma(q0 * -1.0, scale, x)  # * -1.0, not -q0: Triton negates as 0 - q0 (-0 -> +0)
            # A zero residual means an exact quotient: keep it (an fma adding +0 would turn -0 into +0).
            q1 = tl.where(e0 == 0.0, q0, tl.fma(e0, r, q0))
            e1 = tl.fma(q1 * -1.0, scale, x)
            q = tl.where(e1 == 0.0, q1, tl.fma(e1, r, q1))
        else:
            q = tl.math.div_rn(x, scale)
    else:
        q = tl.math.div_rn(x, scale)
    return q


@triton.jit
def fp8_cast(x, scale, dtype: tl.constexpr):
    """fp8(x / scale) in ``dtype``: on a GPU the correctly rounded quotient (``divide_rn``),
    clamped, then the hardware's cast (round to nearest even, as ``fp8_grid`` rounds, in one
    instruction per pair); under the interpreter ``fp8_grid``'s explicit rounding, then an
    exact cast. ``scale``: at least one dim (``divide_rn``)."""
    if HW_CAST:
        FP8_MAX: tl.constexpr = fp8_format(dtype)[0]
        q = tl.clamp(divide_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        return q.to(dtype)
    return fp8_grid(x, scale, dtype).to(dtype)


# ---- torchao's rule (scale_rule="torchao"): a multiplier, not a divisor ----

_AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-12)  # torchao's floor on amax (its EPS)


@triton.jit
def fp8_multiplier(amax, dtype: tl.constexpr, POW2: tl.constexpr = False):
    """torchao's scale of blocks with maximum magnitude ``amax``: the multiplier
    FP8_MAX / max(amax, 1e-12), correctly rounded to fp32; POW2 rounds it down to a power of
    two (the exponent bits: exact). The dequantisation scale is its reciprocal."""
    FP8_MAX: tl.constexpr = fp8_format(dtype)[0]
    mult = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), tl.maximum(amax, _AMAX_FLOOR))
    if POW2:
        mult = (mult.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return mult


@triton.jit
def fp8_cast_mul(x, mult, dtype: tl.constexpr):
    """fp8(x * mult) in ``dtype``, torchao's cast: the fp32 product, clamped, rounded to
    nearest even (the hardware's cast on a GPU, ``fp8_round`` under the interpreter)."""
    q = x.to(tl.float32) * mult
    if HW_CAST:
        FP8_MAX: tl.constexpr = fp8_format(dtype)[0]
        return tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL).to(dtype)
    return fp8_round(q, dtype).to(dtype)


@triton.jit
def fp8_scales(amax, dtype: tl.constexpr, POW2: tl.constexpr, TORCHAO: tl.constexpr):
    """(scale, factor) of blocks with maximum magnitude ``amax`` under either rule: the
    dequantisation scale to store and what ``fp8_apply`` takes (the scale itself, or
    torchao's multiplier, whose reciprocal the scale then is)."""
    if TORCHAO:
        factor = fp8_multiplier(amax, dtype, POW2)
        scale = tl.math.div_rn(tl.full(factor.shape, 1.0, tl.float32), factor)
    else:
        scale = fp8_scale(amax, dtype, POW2)
        factor = scale
    return scale, factor


@triton.jit
def fp8_apply(x, factor, dtype: tl.constexpr, TORCHAO: tl.constexpr):
    """x in fp8 under either rule, ``factor`` from ``fp8_scales``."""
    if TORCHAO:
        q = fp8_cast_mul(x, factor, dtype)
    else:
        q = fp8_cast(x, factor, dtype)
    return q
