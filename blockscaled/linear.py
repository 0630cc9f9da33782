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
from ..core.scaling import BLOCKS, BLOCKWISE, ROW_BLOCKS, SCALE_BLOCK
from .matmul import scaled_record
from .quantize import QUANTIZE_OP, QUANTIZE_T_OP, quantize_fp8, quantize_launch, transposed_empty
from .recipes import FP8_LINEAR_BACKWARD, TRAIN_OPS, bias_grad, check_recipe


E4M3 = torch.float8_e4m3fn


def _quantizer(x, block):
    """The registered quantiser's record for x's signature: x -> (q, scale storage)
    (blockscaled/quantize.py; 1x128 scales stored [kb, rows])."""
    return QUANTIZE_OP.direct.route((x, str(block), E4M3, False, False, "onegemm"))


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


def _fp8_linear_backward(ctx, dy):
    """The registered op's gradients: a frozen layer's dx (its fp8 W, transposed once here for
    the K-major dgrad), or a direct call's on a high-precision W (quantised again), by the
    blockwise recipe's backward (blockscaled/recipes.py)."""
    x, weight, weight_scale = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    q_xt = s_xt = None
    if weight.dtype == E4M3:  # W.t()'s 128x128 scales are W's, transposed
        q_wt, s_wt = transposed_empty(*weight.t().shape, E4M3, weight.device).copy_(weight.t()), weight_scale.t()
    else:  # the registered quantiser (under torch.compile too)
        _, _, q_wt, s_wt = QUANTIZE_T_OP(weight, str(BLOCKS), E4M3, False, False, "onegemm")
    if need_w:
        _, _, q_xt, s_xt = QUANTIZE_T_OP(x, str(ROW_BLOCKS), E4M3, False, False, "onegemm")
    dx, dw = FP8_LINEAR_BACKWARD(dy, q_wt if need_x else None, s_wt, q_xt, s_xt, weight.dtype, "blockwise")
    return (dx if need_x else None), (dw if need_w else None), None, bias_grad(ctx, dy, 3)


# The backward quantises dy and runs FP8 GEMMs: no second derivative, and an error says so.
FP8_LINEAR = Op("fp8_linear", _fp8_linear_impl, _fp8_linear_fake, _fp8_linear_setup,
                first_order_only(_fp8_linear_backward, "Fp8Linear"), record=_fp8_linear_record, tensors=4)


class Fp8Linear(nn.Module):
    """y = x @ W.T + bias with the DeepSeek-V3 recipe: W quantised in 128x128 blocks, x
    quantised per call in 1x128 blocks (the fused quantiser), both fp8 e4m3 with fp32 scales,
    multiplied by blockscaled_matmul with the bias fused in its epilogue.

    Frozen (the default): W is quantised once. Buffers (saved in the state_dict, so it
    round-trips through safetensors):
      weight        float8_e4m3fn [out_features, in_features]
      weight_scale  float32 [ceil(out_features/128), ceil(in_features/128)]
    Gradients flow to x and the bias (dx by an FP8 GEMM).

    trainable=True: ``weight`` is a high-precision Parameter (``dtype``), quantised in every
    forward; the forward, dgrad and wgrad GEMMs all run in FP8 (docs/autograd.md), as
    torchao's Float8Linear does. ``weight_scale`` is then None. ``recipe`` says how each GEMM's
    operands are quantised (blockscaled/recipes.py): "blockwise" (the default, DeepSeek-V3's
    1x128 x 128x128 above), or torchao's "tensorwise", "rowwise" and "rowwise_with_gw_hp",
    with torchao's scale rule, so a model trains alike under either library.

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
                 trainable: bool = False, recipe: str = "blockwise"):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.trainable, self.recipe = _check_mode(trainable, recipe)
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
    def from_linear(cls, linear: nn.Linear, *, trainable: bool = False, recipe: str = "blockwise") -> "Fp8Linear":
        """An Fp8Linear with linear's weight and bias, on its device: the bias Parameter is
        linear's own, and so is the weight Parameter if ``trainable`` (else the weight is
        quantised into the fp8 buffers). Reusing the Parameters keeps what a model's training
        set-up holds on to: an optimizer built before the swap, ties (two layers sharing one
        weight, an output head tied to an embedding), requires_grad=False on frozen layers,
        and the state_dict keys (weight, bias), so an unconverted checkpoint loads as it is.
        ``recipe``: as in the constructor."""
        if not isinstance(linear, nn.Linear):
            raise checks.bad_type("linear", "a torch.nn.Linear", linear)
        w = linear.weight
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.trainable, module.recipe = _check_mode(trainable, recipe)
        module._init_weight(w, "linear.weight", w.device)
        if linear.bias is not None:
            module.bias = linear.bias
        else:
            module.register_parameter("bias", None)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FORWARD(x, self.weight, self.weight_scale, self.bias, self.in_features, self.out_features,
                        self.recipe if self.trainable else None)

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
        if self.trainable:
            return text + f"weight={self.weight.dtype} quantised per call, recipe={self.recipe}"
        return text + "weight=float8_e4m3fn 128x128, activations=1x128"


def _check_mode(trainable, recipe) -> tuple[bool, str]:
    """Fp8Linear's (trainable, recipe), checked: a recipe other than blockwise needs a
    trainable layer (a frozen one holds 128x128 weight scales)."""
    checks.check_bool("trainable", trainable)
    check_recipe(recipe)
    if recipe != "blockwise" and not trainable:
        raise checks.bad_value("recipe", "'blockwise' for a frozen layer (trainable=False holds 128x128 "
                               "weight scales; the other recipes train)", repr(recipe))
    return trainable, recipe


def _forward_route(args):
    """Fp8Linear.forward's checks (x, and the weight, its scales and the bias as the GEMM
    reads them: they may have been replaced since construction, e.g. by load_state_dict or
    assignment), then the registered op's route for x as [M, K]."""
    x, w, s, bias, in_features, out_features, recipe = args
    trainable = recipe is not None
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
    if trainable and (recipe != "blockwise" or wants_grad(x, w, bias)):
        # the training forward keeps what the backward reads (when gradients are recorded)
        train = TRAIN_OPS[recipe].call.route((x2, w, bias, wants_grad(x, w, bias)))
        inner = lambda x, w, s, bias: train(x, w, bias)[0]  # noqa: E731
    else:
        inner = FP8_LINEAR.call.route((x2, w, s, bias))
    if x.dim() == 2:
        return inner
    shape = (*x.shape[:-1], out_features)
    return lambda x, w, s, bias: inner(x.reshape(-1, in_features), w, s, bias).reshape(shape)


# Fp8Linear.forward cached by signature: (x, weight, weight_scale, bias, in/out features, recipe
# (None: frozen)).
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
                 recipe: str = "blockwise", moe_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
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

    recipe: how the Linear layers' GEMMs quantise (Fp8Linear): "blockwise" (default),
    "tensorwise", "rowwise" or "rowwise_with_gw_hp" (torchao's recipes of those names). MoE
    layers train blockwise only: with another recipe a picked MoE layer is a ValueError (leave
    it out with moe_filter_fn).
    """
    if not isinstance(module, nn.Module):
        raise checks.bad_type("module", "a torch.nn.Module", module)
    check_recipe(recipe)
    for name, fn in (("module_filter_fn", module_filter_fn), ("moe_filter_fn", moe_filter_fn)):
        if fn is not None and not callable(fn):
            raise checks.bad_type(name, "a callable (module, fqn) -> bool, or None", fn)

    def swap(m: nn.Module, fqn: str) -> nn.Module:
        if type(m) is nn.Linear:
            picked = module_filter_fn is None or module_filter_fn(m, fqn)
            return Fp8Linear.from_linear(m, trainable=True, recipe=recipe) if picked else m
        for module_type, convert in _FP8_TRAINING_CONVERSIONS.items():
            if isinstance(m, module_type) and (moe_filter_fn is None or moe_filter_fn(m, fqn)):
                if recipe != "blockwise":
                    raise checks.bad_value("recipe", f"'blockwise' where MoE layers train in FP8 (the "
                                           f"{type(m).__name__} at {fqn or 'the root'!r}), or a moe_filter_fn "
                                           "that leaves them out", repr(recipe))
                convert(m)
        for name, child in m.named_children():
            new = swap(child, f"{fqn}.{name}" if fqn else name)
            if new is not child:
                setattr(m, name, new)
        return m

    return swap(module, "")
