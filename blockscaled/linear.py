"""onegemm.Fp8Linear: an nn.Linear whose GEMMs run in FP8 (inference, and training with
trainable=True), and onegemm.fp8_training, which swaps a model's nn.Linear layers for it."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from ..core import checks
from ..core.dispatch import Cached, Op, Workspace, first_order_only, wants_grad
from ..core.runtime import INTERPRET, cdiv, empty_strided
from ..core.scaling import BLOCKS, BLOCKWISE, COL_BLOCKS, ROW_BLOCKS, SCALE_BLOCK, Scaling
from .matmul import run_blockscaled, scaled_record
from .quantize import QUANTIZE_OP, QUANTIZE_T_OP, quantize_fp8, quantize_launch, transposed_empty


E4M3 = torch.float8_e4m3fn


def _quantizer(x, block, transposed=False):
    """The registered quantiser's record for x's signature: x -> (q, scale storage[, q_t,
    scale_t storage]) (blockscaled/quantize.py; 1x128 scales stored [kb, rows])."""
    return (QUANTIZE_T_OP if transposed else QUANTIZE_OP).direct.route((x, str(block), E4M3, False, False))


def _fp8_linear_impl(x: torch.Tensor, weight: torch.Tensor, weight_scale: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ W.T + bias in FP8: x [M, K] quantised 1x128; W [N, K] either fp8 with its
    128x128 ``weight_scale`` or high precision (quantised 128x128 here: a trainable layer
    without gradients)."""
    return FP8_LINEAR.direct(x, weight, weight_scale, bias)


def _fp8_linear_record(x, weight, weight_scale, bias):
    """``_fp8_linear_impl`` for its arguments' signature: the quantiser's record for x (and
    for a high-precision W) and the GEMM's, one callable. b = W.t(): K-major, the fast layout
    for Hopper's fp8 MMA; its 128x128 scale [kb, nb] is then weight_scale.t(), torch._scaled_mm's
    layout too."""
    if weight.dtype == E4M3 and x.numel() and weight.shape[0] and not INTERPRET:
        return _fused_record(x, weight, weight_scale, bias)
    quantize_x = _quantizer(x, ROW_BLOCKS)
    quantize_w = None
    if weight.dtype != E4M3:
        quantize_w = _quantizer(weight, BLOCKS)
        weight, weight_scale = quantize_w(weight)
    q, scale = quantize_x(x)
    gemm = scaled_record(q, weight.t(), scale.t(), weight_scale.t(), BLOCKWISE, x.dtype, bias)

    def run(x, weight, weight_scale, bias):
        if quantize_w is not None:
            weight, weight_scale = quantize_w(weight)
        q, scale = quantize_x(x)
        return gemm(q, weight.t(), scale.t(), weight_scale.t(), bias)

    return run


def _fused_record(x, weight, weight_scale, bias):
    """``_fp8_linear_record`` for an fp8 W on a GPU: x's fp8 copy and its scales are one
    workspace (core/dispatch.py), the quantiser's and the GEMM's launches read them from it,
    and a call allocates that and its output, nothing else. (Under the interpreter the
    quantiser is torch's: its fp8 cast turns a NaN block into 384; blockscaled/quantize.py.)"""
    (M, K), N = x.shape, weight.shape[0]
    workspace = Workspace(x.device, ((M, K), E4M3), ((cdiv(K, SCALE_BLOCK), M), torch.float32))

    def parts(buffer):  # q [M, K] and its 1x128 scales [M, kb], a view of their [kb, M] storage
        q, scale = workspace.parts(buffer)
        return q, scale.t()

    quantize = quantize_launch(x, ROW_BLOCKS, E4M3, False).on(lambda x, buffer: (x, *parts(buffer)))
    q, scale = parts(workspace.new())
    (gemm,) = scaled_record(q, weight.t(), scale, weight_scale.t(), BLOCKWISE, x.dtype, bias).launches

    def gemm_tensors(out, buffer, weight, weight_scale, bias):  # what the GEMM's builder takes
        q, scale = parts(buffer)
        return out, q, weight.t(), scale, weight_scale.t(), bias

    gemm = gemm.on(gemm_tensors)
    shape, dtype, device = (M, N), x.dtype, x.device

    def run(x, weight, weight_scale, bias):
        buffer = workspace.new()
        quantize(x, buffer)
        out = empty_strided(shape, (N, 1), dtype=dtype, device=device)
        gemm(out, buffer, weight, weight_scale, bias)
        return out

    return run


def _fp8_linear_fake(x, weight, weight_scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _fp8_linear_setup(ctx, inputs, output):
    x, weight, weight_scale, bias = inputs
    ctx.save_for_backward(x, weight, weight_scale)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _bias_grad(ctx, dy, index):
    """The bias's gradient if input ``index`` (the bias) needs one (a cached call's Function
    has one more input after it: the record)."""
    return dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.needs_input_grad[index] else None


def _fp8_linear_backward(ctx, dy):
    """The registered op's gradients: a frozen layer's dx (its fp8 W, transposed once here for
    the K-major dgrad), or a direct call's on a high-precision W (quantised again)."""
    x, weight, weight_scale = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    q_xt = s_xt = None
    if weight.dtype == E4M3:
        q_wt, s_w = transposed_empty(*weight.t().shape, E4M3, weight.device).copy_(weight.t()), weight_scale
    else:  # the registered quantiser (under torch.compile too)
        _, s_w, q_wt, _ = QUANTIZE_T_OP(weight, str(BLOCKS), E4M3, False, False)
    if need_w:
        _, _, q_xt, s_xt = QUANTIZE_T_OP(x, str(ROW_BLOCKS), E4M3, False, False)
    dx, dw = FP8_LINEAR_BACKWARD(dy, q_wt if need_x else None, s_w, q_xt, s_xt, weight.dtype)
    return (dx if need_x else None), (dw if need_w else None), None, _bias_grad(ctx, dy, 3)


def _fp8_linear_train_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A trainable layer's forward when it records gradients -> (y, q_xt, s_xt, q_wt, s_w):
    y as ``_fp8_linear_impl``, and what the backward's GEMMs read, made by the forward's own
    quantiser passes (each one read of x and of W writes both layouts): x.t() quantised 1x128
    along the tokens (q_xt [K, M], its scale stored [ceil(M/128), K]), W.t() in fp8 (q_wt
    [K, N]) and W's 128x128 scale s_w [ceil(N/128), ceil(K/128)], which also serves W.t()."""
    return FP8_LINEAR_TRAIN.direct(x, weight, bias)


def _fp8_linear_train_record(x, weight, bias):
    quantize_x = _quantizer(x, ROW_BLOCKS, transposed=True)
    quantize_w = _quantizer(weight, BLOCKS, transposed=True)
    q_w, s_w, _, _ = quantize_w(weight)
    q, s, _, _ = quantize_x(x)
    gemm = scaled_record(q, q_w.t(), s.t(), s_w.t(), BLOCKWISE, x.dtype, bias)

    def run(x, weight, bias):
        q_w, s_w, q_wt, _ = quantize_w(weight)  # W.t()'s 128x128 scale is s_w.t(): not kept
        q, s, q_xt, s_xt = quantize_x(x)
        return gemm(q, q_w.t(), s.t(), s_w.t(), bias), q_xt, s_xt, q_wt, s_w

    return run


def _fp8_linear_train_fake(x, weight, bias):
    (M, K), N = x.shape, weight.shape[0]
    return (x.new_empty((M, N)), transposed_empty(K, M, E4M3, None, x),
            x.new_empty((cdiv(M, SCALE_BLOCK), K), dtype=torch.float32), transposed_empty(K, N, E4M3, None, x),
            x.new_empty((cdiv(N, SCALE_BLOCK), cdiv(K, SCALE_BLOCK)), dtype=torch.float32))


def _fp8_linear_train_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients of the fp8 copies (hundreds of MB)
    ctx.weight_dtype = weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _fp8_linear_train_backward(ctx, dy, *_):
    q_xt, s_xt, q_wt, s_w = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    dx, dw = FP8_LINEAR_BACKWARD(dy, q_wt if need_x else None, s_w, q_xt if need_w else None, s_xt, ctx.weight_dtype)
    return (dx if need_x else None), (dw if need_w else None), _bias_grad(ctx, dy, 2)


def _fp8_linear_backward_impl(dy: torch.Tensor, q_wt: Optional[torch.Tensor], s_w: torch.Tensor,
                              q_xt: Optional[torch.Tensor], s_xt: Optional[torch.Tensor], weight_dtype: torch.dtype
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dW) in FP8, the DeepSeek-V3 recipe: each GEMM's operands quantised along its own
    reduction dim, every operand K-major (the layout of the Gluon body's fp8 wgmma). dy [M, N]
    is read once for both GEMMs' operands.
    dgrad dx = dy @ W (when q_wt is given): dy 1x128 along N; b = W as [N, K] read K-major from
      q_wt = W.t() in fp8 [K, N], whose 128x128 scale is W's own s_w [ceil(N/128), ceil(K/128)].
    wgrad dW = dy^T @ x (when q_xt is given), in weight_dtype: dy.t() and x.t() both quantised
      1x128 along the tokens M: a = dy.t() [N, M]; b = x [M, K] read K-major from q_xt [K, M],
      its scale s_xt stored [ceil(M/128), K] (128x1 blocks of b).
    An empty tensor stands for a gradient not asked for. A registered op of its own, so
    torch.compile traces the backward as one call. dy may have any strides (the quantisers
    read them)."""
    dx = dw = dy.new_empty(0)
    if q_xt is None:
        q_dy, s_dy = _quantizer(dy, ROW_BLOCKS)(dy)
    else:
        q_dy, s_dy, q_dyt, s_dyt = _quantizer(dy, ROW_BLOCKS, transposed=True)(dy)
        dw = run_blockscaled(q_dyt, q_xt.t(), s_dyt.t(), s_xt, Scaling(ROW_BLOCKS, COL_BLOCKS), weight_dtype)
    if q_wt is not None:
        dx = run_blockscaled(q_dy, q_wt.t(), s_dy.t(), s_w, BLOCKWISE, dy.dtype)
    return dx, dw


def _fp8_linear_backward_fake(dy, q_wt, s_w, q_xt, s_xt, weight_dtype):
    M, N = dy.shape
    dx = dy.new_empty(0) if q_wt is None else dy.new_empty((M, q_wt.shape[0]))
    dw = dy.new_empty(0) if q_xt is None else dy.new_empty((N, q_xt.shape[0]), dtype=weight_dtype)
    return dx, dw


FP8_LINEAR_BACKWARD = Op("fp8_linear_backward", _fp8_linear_backward_impl, _fp8_linear_backward_fake)
# The backward quantises dy and runs FP8 GEMMs: no second derivative, and an error says so.
FP8_LINEAR = Op("fp8_linear", _fp8_linear_impl, _fp8_linear_fake, _fp8_linear_setup,
                first_order_only(_fp8_linear_backward, "Fp8Linear"), record=_fp8_linear_record, tensors=4)
FP8_LINEAR_TRAIN = Op("fp8_linear_train", _fp8_linear_train_impl, _fp8_linear_train_fake, _fp8_linear_train_setup,
                      first_order_only(_fp8_linear_train_backward, "Fp8Linear"), record=_fp8_linear_train_record,
                      tensors=3)


class Fp8Linear(nn.Module):
    """y = x @ W.T + bias with the DeepSeek-V3 recipe: W quantised in 128x128 blocks, x
    quantised per call in 1x128 blocks (the fused quantiser), both fp8 e4m3 with fp32 scales,
    multiplied by blockscaled_matmul with the bias fused in its epilogue.

    Frozen (the default): W is quantised once. Buffers (saved in the state_dict, so it
    round-trips through safetensors):
      weight        float8_e4m3fn [out_features, in_features]
      weight_scale  float32 [ceil(out_features/128), ceil(in_features/128)]
    Gradients flow to x and the bias (dx by an FP8 GEMM).

    trainable=True: ``weight`` is a high-precision Parameter (``dtype``), quantised 128x128 in
    every forward; the forward, dgrad and wgrad GEMMs all run in FP8 (docs/autograd.md), as
    torchao's Float8Linear does with tensor-wise scales. ``weight_scale`` is then None.

    No second derivative (frozen or trainable): with create_graph=True the gradients are the
    usual ones, and differentiating them again raises ValueError (docs/autograd.md).

    ``bias`` [out_features] is a Parameter in ``dtype``, or None.

    x [..., in_features] of float32 / bfloat16 / float16 -> y [..., out_features], x's dtype.
    ``dtype`` is the dtype of the bias and of the random initial weight before quantisation
    (default: torch's default dtype), as in nn.Linear.

    The forward pass does not check x for NaN/inf (that needs a host sync per call); a
    non-finite activation gives a non-finite output, as nn.Linear would.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None, dtype=None,
                 trainable: bool = False):
        super().__init__()
        checks.check_bool("trainable", trainable)
        self.in_features = in_features
        self.out_features = out_features
        self.trainable = trainable
        dtype = dtype or torch.get_default_dtype()
        # nn.Linear's initialisation, then quantised: a fresh Fp8Linear behaves like a fresh Linear.
        w = torch.empty(out_features, in_features, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        self._init_weight(w, "weight", device)
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    def _init_weight(self, w: torch.Tensor, name: str, device) -> None:
        if self.trainable:
            checks.check_tensor(name, w, ndim=2, dtypes=checks.FLOAT_DTYPES)
            # A Parameter is kept as it is (from_linear: the Linear's own), so its optimizer
            # state, its ties to other modules and its requires_grad carry over.
            self.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w.detach())
            self.register_buffer("weight_scale", None)
        else:
            self.register_buffer("weight", torch.empty(0, device=device, dtype=torch.float8_e4m3fn))
            self.register_buffer("weight_scale", torch.empty(0, device=device, dtype=torch.float32))
            self.set_weight(w, name)

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor, name: str = "weight") -> None:
        """Set the weight from a float [out_features, in_features]: quantised (128x128 blocks)
        into the buffers, or copied into the Parameter of a trainable layer. ``name``: what
        errors call it (from_linear says 'linear.weight')."""
        checks.check_tensor(name, weight, ndim=2, dtypes=checks.FLOAT_DTYPES)
        checks.check_shape(name, weight, (self.out_features, self.in_features),
                           f"[out_features, in_features] = [{self.out_features}, {self.in_features}]")
        if self.trainable:
            self.weight.copy_(weight)
            return
        q, scale = quantize_fp8(weight.detach(), (SCALE_BLOCK, SCALE_BLOCK))
        if not bool(torch.isfinite(scale).all()):  # once per weight, not per call: the sync is fine
            raise checks.bad_value(name, "finite", "NaN or inf")
        self.weight, self.weight_scale = q, scale

    def _apply(self, fn, recurse=True):
        # .half() / .to(dtype) and the like cast floating tensors; the fp8 weight and its fp32
        # scales must keep their dtypes (only the bias and the output follow the module's
        # dtype), so they are moved, never cast.
        if self.trainable:
            return super()._apply(fn, recurse)
        weight, scale = self.weight, self.weight_scale
        super()._apply(fn, recurse)
        if self.weight.dtype != weight.dtype:
            self.weight = weight.to(self.weight.device)
        if self.weight_scale.dtype != scale.dtype:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, trainable: bool = False) -> "Fp8Linear":
        """An Fp8Linear with linear's weight and bias, on its device: the bias Parameter is
        linear's own, and so is the weight Parameter if ``trainable`` (else the weight is
        quantised into the fp8 buffers). Reusing the Parameters keeps what a model's training
        set-up holds on to: an optimizer built before the swap, ties (two layers sharing one
        weight, an output head tied to an embedding), requires_grad=False on frozen layers,
        and the state_dict keys (weight, bias), so an unconverted checkpoint loads as it is."""
        if not isinstance(linear, nn.Linear):
            raise checks.bad_type("linear", "a torch.nn.Linear", linear)
        checks.check_bool("trainable", trainable)
        w = linear.weight
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.trainable = trainable
        module._init_weight(w, "linear.weight", w.device)
        if linear.bias is not None:
            module.bias = linear.bias
        else:
            module.register_parameter("bias", None)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FORWARD(x, self.weight, self.weight_scale, self.bias, self.in_features, self.out_features, self.trainable)

    def extra_repr(self) -> str:
        weight = f"{self.weight.dtype} quantised 128x128 per call" if self.trainable else "float8_e4m3fn 128x128"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={weight}, activations=1x128")


def _forward_route(args):
    """Fp8Linear.forward's checks (x, and the weight, its scales and the bias as the GEMM
    reads them: they may have been replaced since construction, e.g. by load_state_dict or
    assignment), then the registered op's route for x as [M, K]."""
    x, w, s, bias, in_features, out_features, trainable = args
    checks.check_tensor("x", x, dtypes=checks.FLOAT_DTYPES)
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise checks.bad_shape("x", f"[..., in_features] = [..., {in_features}]", x.shape)
    kb, nb = cdiv(in_features, SCALE_BLOCK), cdiv(out_features, SCALE_BLOCK)
    want = checks.FLOAT_DTYPES if trainable else (torch.float8_e4m3fn,)
    if w.dtype not in want or w.shape != (out_features, in_features):
        raise checks.bad_value("Fp8Linear.weight", f"{checks.dtype_names(want)} [{out_features}, {in_features}]",
                               f"{w.dtype} {tuple(w.shape)}")
    if not trainable and (s.dtype != torch.float32 or s.shape != (nb, kb)):
        raise checks.bad_value("Fp8Linear.weight_scale", f"float32 [{nb}, {kb}]", f"{s.dtype} {tuple(s.shape)}")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype not in checks.FLOAT_DTYPES):
        raise checks.bad_value("Fp8Linear.bias", f"[{out_features}] of dtype in ({checks.dtype_names(checks.FLOAT_DTYPES)})",
                               f"{bias.dtype} {tuple(bias.shape)}")
    checks.check_same_device(x=x, weight=w, weight_scale=s, bias=bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, in_features)
    if trainable and wants_grad(x, w, bias):  # the training forward keeps what the backward reads
        train = FP8_LINEAR_TRAIN.call.route((x2, w, bias))
        inner = lambda x, w, s, bias: train(x, w, bias)[0]  # noqa: E731
    else:
        inner = FP8_LINEAR.call.route((x2, w, s, bias))
    if x.dim() == 2:
        return inner
    shape = (*x.shape[:-1], out_features)
    return lambda x, w, s, bias: inner(x.reshape(-1, in_features), w, s, bias).reshape(shape)


# Fp8Linear.forward cached by signature: (x, weight, weight_scale, bias, in/out features, trainable).
_FORWARD = Cached(4, _forward_route)


# fp8_training's conversions of the module types of the packages built on blockscaled/, which it
# cannot import: type -> convert(module), called in place on every picked module of that type.
# grouped/layer.py registers MoEFFN's (importing onegemm imports grouped/, so it is always there).
_FP8_TRAINING_CONVERSIONS: dict[type, Callable[[nn.Module], None]] = {}


def register_fp8_training(module_type: type, convert: Callable[[nn.Module], None]) -> None:
    """Have fp8_training call ``convert(m)`` on every module ``m`` that is a ``module_type``
    and passes its moe_filter_fn (before it visits m's children): how a layer of a package
    above blockscaled/ (grouped/'s MoEFFN) trains in FP8 under fp8_training."""
    _FP8_TRAINING_CONVERSIONS[module_type] = convert


def fp8_training(module: nn.Module, module_filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
                 moe_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Swap every nn.Linear in ``module`` (itself included) for a trainable Fp8Linear, in place
    where it sits, and return the module: forward, dgrad and wgrad then run in FP8. Every
    onegemm.MoEFFN in it trains its routed experts in FP8 too (moe_ffn's ``fp8_training``:
    forward and input-gradient GEMMs; a layer whose experts cannot is a ValueError), by the
    conversion grouped/layer.py registers (register_fp8_training).

    module_filter_fn(linear, fully_qualified_name) -> bool picks the Linear layers to convert
    (default: all), with torchao's convert_to_float8_training contract: it is called on the
    nn.Linear modules only (a filter may read ``in_features``), so that a torchao filter works
    as it is; keep a model's output head in high precision, for instance. Subclasses of
    nn.Linear are left as they are (nn.MultiheadAttention's out_proj: the attention reads its
    weight directly). moe_filter_fn(layer, fully_qualified_name) -> bool does the same for the
    MoE layers (default: all). Each new layer holds its Linear's own weight and bias Parameters
    (Fp8Linear.from_linear), so optimizers, ties, frozen weights and state_dict keys carry over.
    """
    if not isinstance(module, nn.Module):
        raise checks.bad_type("module", "a torch.nn.Module", module)
    for name, fn in (("module_filter_fn", module_filter_fn), ("moe_filter_fn", moe_filter_fn)):
        if fn is not None and not callable(fn):
            raise checks.bad_type(name, "a callable (module, fqn) -> bool, or None", fn)

    def swap(m: nn.Module, fqn: str) -> nn.Module:
        if type(m) is nn.Linear:
            picked = module_filter_fn is None or module_filter_fn(m, fqn)
            return Fp8Linear.from_linear(m, trainable=True) if picked else m
        for module_type, convert in _FP8_TRAINING_CONVERSIONS.items():
            if isinstance(m, module_type) and (moe_filter_fn is None or moe_filter_fn(m, fqn)):
                convert(m)
        for name, child in m.named_children():
            new = swap(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                setattr(m, name, new)
        return m

    return swap(module, "")
