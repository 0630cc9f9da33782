"""How a public op reaches its kernels from PyTorch, in one of three ways.

- **Eager, no gradient** (the common inference call): the implementation directly. Nothing of
  PyTorch's dispatcher is on the path, so the call costs what the launch costs.
- **Eager, an input requires grad**: through a ``torch.autograd.Function`` whose backward runs
  onegemm's own kernels.
- **Under torch.compile**: through a ``torch.library`` custom op (namespace ``onegemm``) with a
  fake implementation, so Dynamo traces the call without a graph break and AOTAutograd
  differentiates it with the same backward.

``Op`` builds the three from one definition: the implementation, its fake (shapes and dtypes
only), ``setup_context`` (what the backward keeps) and the backward. Eager calls do not go
through the registered op: a registered custom op with autograd costs more host time per call
than an autograd.Function, and both more than the direct call (bench/results/autograd.md has
the figures).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import checks

_ACTIVATIONS = {
    None: lambda x: x,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activate(x: torch.Tensor, activation) -> torch.Tensor:
    """The kernels' epilogue activation as a differentiable torch op (the gradient path)."""
    return _ACTIVATIONS[activation](x)


def wants_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (anything else, None or a wrong
    argument the op's checks will name, is skipped)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def begin(config, a, b, bias) -> bool:
    """The start every differentiable op shares: whether gradients are recorded for a, b or
    bias, with the checks that go with it (no gradient through fp8 operands; a forced
    ``config``, a benchmarking knob, neither with gradients nor under torch.compile)."""
    grad = wants_grad(a, b, bias)
    if grad:
        checks.check_differentiable(a=a, b=b)
    if config is not None and (grad or torch.compiler.is_compiling()):
        raise checks.bad_value("config", "None when gradients are recorded or under torch.compile (a forced "
                               "config is a benchmarking knob)", config)
    return grad


def fused(op: "Op", args: Callable, activation, grad: bool):
    """``op`` on ``args(activation)`` with the activation fused in its epilogue; with gradients,
    ``op`` on ``args(None)`` followed by the torch activation, so autograd keeps the
    pre-activation for the activation's backward (as for nn.Linear and an activation module)
    and the backward needs no second forward GEMM."""
    if grad and activation is not None:
        checks.check_activation(activation)
        return activate(op.run(args(None), True), activation)
    return op.run(args(activation), grad)


class _NoSecondDerivative(torch.autograd.Function):
    """Passes first-order gradients through; differentiating them again raises (first_order_only)."""

    @staticmethod
    def forward(ctx, op: str, count: int, *tensors):
        ctx.op = op
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise checks.bad_value("create_graph", f"False for gradients through {ctx.op} (its backward runs on quantised "
                               "values and has no derivative)", "a second derivative of them",
                               "take them with create_graph=False, or detach them")


def first_order_only(backward: Callable, op: str) -> Callable:
    """``backward`` for an op that has no second derivative (its backward runs on quantised
    values): under create_graph=True its gradients come out of a node that raises ValueError
    naming ``op`` once something differentiates them, never a gradient missing its second-order
    terms. The check covers the saved inputs too: a gradient depends on them even when the
    incoming gradient is a constant."""

    def wrapped(ctx, *grads):
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return out
        sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        given = [i for i, g in enumerate(out) if isinstance(g, torch.Tensor)]
        if not sources or not given:
            return out
        out = list(out)
        for i, g in zip(given, _NoSecondDerivative.apply(op, len(given), *(out[i] for i in given), *sources)):
            out[i] = g
        return tuple(out)

    return wrapped


class Op:
    """One onegemm op in its three forms (module docstring).

    impl(*args) -> Tensor or tuple of Tensors: the kernels' call, with a type-annotated
        signature (torch.library infers the op's schema from it).
    fake(*args): the outputs' shapes and dtypes on meta / fake tensors.
    setup_context(ctx, inputs, output) and backward(ctx, *grads) -> one grad per input (None
        for non-tensor inputs): torch.library.register_autograd's contract, which the
        autograd.Function reuses as it is. None for an op without gradients.
    """

    def __init__(self, name: str, impl: Callable, fake: Callable, setup_context: Callable | None = None,
                 backward: Callable | None = None):
        self.name = name
        self.impl = impl
        self.custom = torch.library.custom_op(f"onegemm::{name}", impl, mutates_args=())
        self.custom.register_fake(fake)
        self.function = None
        if backward is not None:
            self.custom.register_autograd(backward, setup_context=setup_context)

            def forward(ctx, *args):
                out = impl(*args)
                setup_context(ctx, args, out)
                return out

            self.function = type(f"{name}_function", (torch.autograd.Function,), {
                "forward": staticmethod(forward),
                "backward": staticmethod(backward),
            })

    def __call__(self, *args, grad_inputs=()):
        """Run the op on ``args`` (the first a tensor); ``grad_inputs``: the tensors among them
        that may require grad."""
        return self.run(args, wants_grad(*grad_inputs))

    def run(self, args: tuple, grad: bool):
        """``__call__`` for a caller that has already asked ``wants_grad``."""
        first = args[0]
        # A tensor subclass (a fake, functional or proxy tensor: AOTAutograd tracing a backward,
        # opcheck, export) has no memory to launch on: it takes the registered op too.
        if torch.compiler.is_compiling() or (type(first) is not torch.Tensor and isinstance(first, torch.Tensor)):
            return self.custom(*args)
        if grad and self.function is not None:
            return self.function.apply(*args)
        return self.impl(*args)
