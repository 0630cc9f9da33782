"""FP8 training recipes: how a trainable Fp8Linear quantises the operands of its three GEMMs.

A step of y = x @ W.T + bias runs three GEMMs, each as out = A @ B.T with A [rows, K] and
B [cols, K] quantised along the GEMM's reduction dim K (K-major: the layout Hopper's fp8 MMA
reads from shared memory):

    forward  y  = x @ W.T     A = x [M, K_in] along K_in     B = W [N, K_in] along K_in
    dgrad    dx = dy @ W      A = dy [M, N] along N          B = W.t() [K_in, N] along N
    wgrad    dW = dy.T @ x    A = dy.t() [N, M] along M      B = x.t() [K_in, M] along M

So x, W and dy are each quantised along their rows for one GEMM and along their columns
(written transposed) for another. A ``Recipe`` names the ``Cast`` of each: granularity (one
scale per tensor, per row, per 1x128 block or per 128x128 block of the operand as A sees it)
and fp8 dtype, or None for an operand the wgrad reads in high precision. The scale rule
(``quantize_fp8``'s scale_rule and pow2_scale) and whether the forward GEMM may sum K in the
tensor core's fast accumulator complete it.

    blockwise           DeepSeek-V3's: 1x128 activations and gradients, 128x128 weights
    tensorwise          torchao's "tensorwise": one scale per tensor; dy in e5m2
    rowwise             torchao's "rowwise": one scale per row along each GEMM's K, powers of two
    rowwise_with_gw_hp  torchao's "rowwise_with_gw_hp": row-wise forward, dgrad with a
                        tensor-wise W, the weight gradient in high precision

The torchao recipes use torchao's scale rule, dtypes, power-of-two rounding and fast
accumulation (forward GEMM only), so a model quantises alike under either library. Every
GEMM runs blockscaled/matmul.py's ``run_blockscaled``: block scales in the K loop, the others
in the epilogue (on sm_90, core's Gluon body in its epilogue-scaled mode).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..core import checks
from ..core.dispatch import Op, first_order_only
from ..core.matmul import DENSE
from ..core.scaling import BLOCKS, ROW, ROW_BLOCKS, TENSOR, Granularity, Scaling
from .matmul import run_blockscaled, scaled_record
from .quantize import QUANTIZE_OP, QUANTIZE_T_OP

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Cast(NamedTuple):
    """How one operand is quantised along a GEMM's K: its scales' granularity as an A operand
    [rows, K] sees it (TENSOR, ROW, ROW_BLOCKS or BLOCKS) and the fp8 dtype."""

    granularity: Granularity
    dtype: torch.dtype = E4M3


class Recipe(NamedTuple):
    """A training recipe (module docstring). ``x``, ``w``, ``dy``: each operand along its rows
    (the forward's A and B, the dgrad's A); ``x_t``, ``w_t``, ``dy_t``: along its columns (the
    wgrad's B, the dgrad's B, the wgrad's A), None: the wgrad in high precision."""

    name: str
    x: Cast
    w: Cast
    dy: Cast
    x_t: Optional[Cast]
    w_t: Cast
    dy_t: Optional[Cast]
    scale_rule: str = "onegemm"
    pow2: bool = False
    fast_accum: bool = False  # the forward GEMM's use_fast_accum (epilogue scales only)

    @property
    def fp8_wgrad(self) -> bool:
        return self.x_t is not None


_BLOCKS_1x128 = Cast(ROW_BLOCKS)
RECIPES = {r.name: r for r in (
    Recipe("blockwise", _BLOCKS_1x128, Cast(BLOCKS), _BLOCKS_1x128, _BLOCKS_1x128, Cast(BLOCKS), _BLOCKS_1x128),
    Recipe("tensorwise", Cast(TENSOR), Cast(TENSOR), Cast(TENSOR, E5M2), Cast(TENSOR), Cast(TENSOR), Cast(TENSOR, E5M2),
           "torchao", fast_accum=True),
    Recipe("rowwise", Cast(ROW), Cast(ROW), Cast(ROW), Cast(ROW), Cast(ROW), Cast(ROW), "torchao", pow2=True,
           fast_accum=True),
    Recipe("rowwise_with_gw_hp", Cast(ROW), Cast(ROW), Cast(ROW), None, Cast(TENSOR), None, "torchao",
           fast_accum=True),
)}


def check_recipe(recipe) -> str:
    """``recipe`` (a public argument) checked: one of RECIPES' names."""
    checks.check_choice("recipe", recipe, tuple(RECIPES))
    return recipe


def _transposed(g: Granularity) -> Granularity:
    """The granularity of B = op.t() for scales an A operand op has: ROW -> COL, 1x128 -> 128x1."""
    return Granularity(g.cols, g.rows)


def _quantize_args(t, cast: Cast, recipe: Recipe) -> tuple:
    return (t, str(cast.granularity), cast.dtype, recipe.pow2, False, recipe.scale_rule)


def operand_quantizer(t: torch.Tensor, rows: Cast, cols: Optional[Cast], recipe: Recipe, fake: bool = False):
    """t [R, C] -> (q [R, C], s, q_t [C, R], s_t): t quantised along its rows by ``rows`` and
    t.t() along its rows by ``cols`` (None: q_t and s_t are None), as the registered quantisers
    return them (1x128 scales as their [kb, rows] storage). One quantiser call where both
    casts are alike (1x128: from one read of t), two otherwise. The quantisers' records for
    t's signature, or with ``fake`` their registered ops (on fake tensors: a fake impl's)."""
    def quantizer(op, t, cast):
        args = _quantize_args(t, cast, recipe)
        if fake:
            return lambda t: op.custom(t, *args[1:])
        return op.direct.route(args)

    if cols is None:
        direct = quantizer(QUANTIZE_OP, t, rows)
        return lambda t: (*direct(t), None, None)
    if cols == rows:
        return quantizer(QUANTIZE_T_OP, t, rows)
    direct, across = quantizer(QUANTIZE_OP, t, rows), quantizer(QUANTIZE_OP, t.t(), cols)
    return lambda t: (*direct(t), *across(t.t()))


def _gemm_operands(q_a, s_a, cast_a: Cast, q_b, s_b, cast_b: Cast) -> tuple:
    """(a, b, scale_a, scale_b, Scaling) of blockscaled_matmul for A @ B.T, A [rows, K] and
    B [cols, K] quantised along K (scales as the quantisers store them)."""
    ga, gb = cast_a.granularity, cast_b.granularity
    # A 1x128 scale's storage [kb, rows] is the transpose of A's [rows, kb] and B.t()'s [kb, cols] as it is.
    scale_a = s_a.t() if ga == ROW_BLOCKS else s_a
    scale_b = s_b if gb == ROW_BLOCKS else s_b.t()
    return q_a, q_b.t(), scale_a, scale_b, Scaling(ga, _transposed(gb))


def nt_gemm(q_a, s_a, cast_a: Cast, q_b, s_b, cast_b: Cast, out_dtype, bias=None, fast_accum=False):
    """A @ B.T (``_gemm_operands``) in out_dtype: blockscaled_matmul's body."""
    a, b, scale_a, scale_b, scaling = _gemm_operands(q_a, s_a, cast_a, q_b, s_b, cast_b)
    return run_blockscaled(a, b, scale_a, scale_b, scaling, out_dtype, bias, use_fast_accum=fast_accum)


# ---- the training forward: y, and what the backward's GEMMs read ----


def _train_op(r: Recipe) -> Op:
    """The training forward of recipe ``r``, one registered op per recipe (an autograd
    route's setup_context sees the tensors alone): (x, weight, bias, keep) -> (y, q_xt, s_xt,
    q_wt, s_wt): y = x @ W.T + bias with the recipe's forward casts and, with ``keep``
    (gradients are recorded), x.t() and W.t() quantised by its column casts, the wgrad's and
    the dgrad's B (q_xt [K, M] and q_wt [K, N] row-major, rows padded to 16 bytes where one
    call makes both casts), scales as the quantisers store them. Empty tensors stand for what
    is not kept: all four without ``keep``, x.t()'s with a high-precision wgrad (the
    autograd rule keeps x itself)."""

    def impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], keep: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return op.direct(x, weight, bias, keep)

    def quantizers(x, weight, keep, fake=False):
        return (operand_quantizer(x, r.x, r.x_t if keep else None, r, fake),
                operand_quantizer(weight, r.w, r.w_t if keep else None, r, fake))

    def record(x, weight, bias, keep):
        quantize_x, quantize_w = quantizers(x, weight, keep)
        q_w, s_w, _, _ = quantize_w(weight)
        q_x, s_x, _, _ = quantize_x(x)
        gemm = scaled_record(*_gemm_operands(q_x, s_x, r.x, q_w, s_w, r.w), x.dtype, bias,
                             use_fast_accum=r.fast_accum)

        def run(x, weight, bias):
            q_w, s_w, q_wt, s_wt = quantize_w(weight)
            q_x, s_x, q_xt, s_xt = quantize_x(x)
            a, b, scale_a, scale_b, _ = _gemm_operands(q_x, s_x, r.x, q_w, s_w, r.w)
            return (gemm(a, b, scale_a, scale_b, bias), *_kept(x, q_xt, s_xt, q_wt, s_wt))

        return run

    def fake(x, weight, bias, keep):
        quantize_x, quantize_w = quantizers(x, weight, keep, fake=True)
        _, _, q_wt, s_wt = quantize_w(weight)
        _, _, q_xt, s_xt = quantize_x(x)
        return (x.new_empty((x.shape[0], weight.shape[0])), *_kept(x, q_xt, s_xt, q_wt, s_wt))

    def setup(ctx, inputs, output):
        x, weight, bias = inputs[:3]
        ctx.save_for_backward(*output[1:], None if r.fp8_wgrad else x)
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)  # no zero gradients of the fp8 copies (hundreds of MB)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype

    def backward(ctx, dy, *_):
        q_xt, s_xt, q_wt, s_wt, x = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if x is not None:  # a high-precision wgrad reads x itself
            q_xt, s_xt = x, None
        dx, dw = FP8_LINEAR_BACKWARD(dy, q_wt if need_x else None, s_wt, q_xt if need_w else None, s_xt,
                                     ctx.weight_dtype, r.name)
        return (dx if need_x else None), (dw if need_w else None), bias_grad(ctx, dy, 2), None

    # The backward quantises dy and runs FP8 GEMMs: no second derivative, and an error says so.
    op = Op(f"fp8_linear_train_{r.name}", impl, fake, setup, first_order_only(backward, "Fp8Linear"), record=record,
            tensors=3)
    return op


def _kept(x, *tensors) -> tuple:
    """The training forward's kept tensors, a fresh empty one for each not made (outputs of a
    registered op may not alias each other)."""
    return tuple(x.new_empty(0) if t is None else t for t in tensors)


def bias_grad(ctx, dy, index):
    """The bias's gradient if input ``index`` (the bias) needs one."""
    return dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.needs_input_grad[index] else None


# ---- the backward's two GEMMs ----


def _backward_impl(dy: torch.Tensor, q_wt: Optional[torch.Tensor], s_wt: torch.Tensor, q_xt: Optional[torch.Tensor],
                   s_xt: Optional[torch.Tensor], weight_dtype: torch.dtype, recipe: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) by the recipe, dy [M, N] quantised along its rows and columns as it says (one
    quantiser call where both casts are alike), scales as the quantisers store them.
    dgrad dx = dy @ W (when q_wt is given): B = W.t() quantised along N, q_wt [K, N], s_wt.
    wgrad dW = dy.t() @ x (when q_xt is given), in weight_dtype: B = x.t() quantised along M,
      q_xt [K, M] and s_xt; for a high-precision wgrad q_xt is x [M, K] itself (s_xt None)
      and the GEMM is core's 16/32-bit matmul of dy.t() and x.
    An empty tensor stands for a gradient not asked for. A registered op of its own, so
    torch.compile traces the backward as one call. dy may have any strides."""
    return FP8_LINEAR_BACKWARD.direct(dy, q_wt, s_wt, q_xt, s_xt, weight_dtype, recipe)


def _backward_record(dy, q_wt, s_wt, q_xt, s_xt, weight_dtype, recipe: str):
    r = RECIPES[recipe]
    fp8_wgrad = q_xt is not None and r.fp8_wgrad
    quantize_dy = operand_quantizer(dy, r.dy, r.dy_t if fp8_wgrad else None, r)

    def run(dy, q_wt, s_wt, q_xt, s_xt):
        q_dy, s_dy, q_dyt, s_dyt = quantize_dy(dy)
        dx = dw = None
        if q_wt is not None:
            dx = nt_gemm(q_dy, s_dy, r.dy, q_wt, s_wt, r.w_t, dy.dtype)
        if fp8_wgrad:
            dw = nt_gemm(q_dyt, s_dyt, r.dy_t, q_xt, s_xt, r.x_t, weight_dtype)
        elif q_xt is not None:
            dw = DENSE.direct(dy.t(), q_xt.to(dy.dtype), None, None, weight_dtype, None, None, None)
        return _kept(dy, dx, dw)

    return run


def _backward_fake(dy, q_wt, s_wt, q_xt, s_xt, weight_dtype, recipe):
    M, N = dy.shape
    dx = dy.new_empty(0) if q_wt is None else dy.new_empty((M, q_wt.shape[0]))
    K = None if q_xt is None else q_xt.shape[0] if RECIPES[recipe].fp8_wgrad else q_xt.shape[1]
    dw = dy.new_empty(0) if q_xt is None else dy.new_empty((N, K), dtype=weight_dtype)
    return dx, dw


FP8_LINEAR_BACKWARD = Op("fp8_linear_backward", _backward_impl, _backward_fake, record=_backward_record, tensors=5)
TRAIN_OPS = {name: _train_op(r) for name, r in RECIPES.items()}
