"""The eager path: how a public op reaches its kernels from PyTorch.

A call takes one of three routes:

- **Eager, no gradient** (the common inference call): the op's *record* directly (below).
  Nothing of PyTorch's dispatcher is on the path, so the call costs what the launch costs.
- **Eager, an input requires grad**: through a ``torch.autograd.Function`` whose forward is
  the first route and whose backward runs onegemm's own kernels.
- **Under torch.compile, inside a torch.func transform (grad, vmap: its tensors are wrappers
  without storage), or with a tensor subclass in any tensor argument** (a FakeTensor,
  a functional or proxy tensor, a DTensor, any ``__torch_dispatch__`` subclass): through a
  ``torch.library`` custom op (namespace ``onegemm``) with a fake implementation, so Dynamo
  traces the call without a graph break, AOTAutograd differentiates it with the same
  backward, and a subclass sees the op in its ``__torch_dispatch__``. A subclass has no
  memory of its own to launch on, so the shortcut is taken only when every tensor argument
  is a plain ``torch.Tensor`` (or an ``nn.Parameter``, which dispatches as one).

**The signature cache.** Everything the checks, the route, the TMA eligibility, the config
choice and the grid depend on is metadata, so each op keeps a bounded map from a call's
*signature* (``signature``) to a ready callable: a ``Record`` (output recipe, plans, grids,
argument builders) or the autograd route built on one. A repeat call builds the signature,
does one dict lookup, allocates its output and launches. A miss runs the op's full path
(its checks and decisions, in its own module) and stores what it made. The signature holds,
per tensor argument, its shape, strides, dtype, device, requires_grad and whether its data
pointer is 16-byte aligned (Triton's specialisation and TMA's rule both read only that), plus
grad mode, torch's float32 matmul precision and the other arguments with their types (so
``tma=1`` does not hit the entry of ``tma=True``). What reads values (``check_offs``) runs in
the record on every call. Dropping the plans (``launch.clear_plans``: tables reloaded,
autotuning switched on) drops every record too.

``Op`` builds the routes from one definition: the record builder, the fake (shapes and dtypes
only), ``setup_context`` (what the backward keeps) and the backward. A registered custom op
with autograd costs more host time per eager call than an autograd.Function, and both more
than the direct call (bench/results/autograd.md has the figures), which is why eager calls do
not go through the registered op.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from . import checks, launch, runtime

_ACTIVATIONS = {
    None: lambda x: x,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}

_Tensor = torch.Tensor
_empty_strided = torch.empty_strided
# What launches as it is: a tensor, or an nn.Parameter (a subclass without __torch_dispatch__).
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_grad_enabled = torch.is_grad_enabled
_precision = torch._C._get_float32_matmul_precision  # torch.get_float32_matmul_precision without its wrapper
transforms_active = torch._C._are_functorch_transforms_active  # inside torch.func.vmap / grad
_unwrap_dead = torch._functorch.utils.unwrap_dead_wrappers  # what Function.apply does to its arguments


def apply_activation(x: torch.Tensor, activation) -> torch.Tensor:
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


def has_subclass(args) -> bool:
    """Whether any argument is a tensor subclass other than nn.Parameter (it must take the
    registered op)."""
    for t in args:
        if t.__class__ not in _PLAIN and isinstance(t, _Tensor):
            return True
    return False


def fused(op: "Op", args: Callable, activation, grad: bool):
    """``op`` on ``args(activation)`` with the activation fused in its epilogue; with gradients,
    ``op`` on ``args(None)`` followed by the torch activation (``Op.route`` does the same for
    ops on the signature cache)."""
    if grad and activation is not None:
        checks.check_activation(activation)
        return apply_activation(op.run(args(None), True), activation)
    return op.run(args(activation), grad)


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


# ---------------------------------------------------------------------------- the signature


def signature(args: tuple, tensors: int) -> tuple | None:
    """The call's signature (module docstring): ``args[:tensors]`` are tensors or None, the
    rest plain values. None when a tensor position holds anything but a plain torch.Tensor,
    an nn.Parameter or None (a subclass takes the registered op; another type gets the
    checks' TypeError)."""
    rest = args[tensors:]
    key = [_grad_enabled(), _precision(), rest]
    for t in args[:tensors]:
        if t is None:
            key.append(None)
        elif t.__class__ in _PLAIN:
            key += (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() & 15 == 0)
        else:
            return None
    for x in rest:  # the types too: tma=1 is not tma=True (a loop: cheaper than tuple(map(type, rest)))
        key.append(x.__class__)
    return tuple(key)


class Records:
    """A bounded, thread-safe map from signatures to ready calls (the oldest entry goes when
    it is full). Reads take no lock: a dict lookup is atomic."""

    def __init__(self, size: int = 256):
        self.size = size
        self._map: dict = {}
        self._lock = threading.Lock()
        self.get = self._map.get
        launch.on_clear(self.clear)

    def put(self, sig: tuple, run: Callable) -> None:
        with self._lock:
            if len(self._map) >= self.size:
                self._map.pop(next(iter(self._map)))
            self._map[sig] = run

    def clear(self) -> None:
        with self._lock:
            self._map.clear()

    def __len__(self) -> int:
        return len(self._map)


class Cached:
    """A call cached by signature: ``route(args)`` (the full path: checks and decisions)
    returns a callable of the tensor arguments, which a call with the same signature reuses."""

    def __init__(self, tensors: int, route: Callable, size: int = 256):
        self.tensors = tensors
        self.route = route
        self.records = Records(size)

    def __call__(self, *args):
        n = self.tensors
        sig = None
        if not torch.compiler.is_compiling():
            try:
                sig = signature(args, n)
            except RuntimeError:  # a tensor without storage: a torch.func wrapper, or no strided tensor
                if not transforms_active():  # a wrapper left by an exited transform stands for its tensor
                    args = _unwrap_dead(args)
                    sig = _signature_or_none(args, n)
            if sig is not None:
                try:
                    run = self.records.get(sig)
                except TypeError:  # an unhashable argument: the full path's checks name it
                    run = sig = None
                if run is not None:
                    return run(*args[:n])
        run = self.route(args)
        if sig is not None:
            self.records.put(sig, run)
        return run(*args[:n])


def _signature_or_none(args: tuple, tensors: int):
    try:
        return signature(args, tensors)
    except RuntimeError:  # still no storage (a sparse tensor, ...): the full path's checks name it
        return None


# ---------------------------------------------------------------------------- records


# A record Launch's generated launcher before its first and second calls, and where none can
# be made: each declines, so the full launch runs.
_first, _second, _never = (lambda *t: False), (lambda *t: False), (lambda *t: False)  # noqa: E731


class Launch:
    """One kernel launch of a record: ``launcher.launch(plan, grid, build(*tensors))``, where
    ``tensors`` are the output(s) and inputs (a Record passes ``(out, *its tensors)``).

    Called as a record's launch (``launch(*tensors)``), from its third call on it starts
    the kernel through a launcher generated from its second call's arguments
    (triton_abi.fast_launcher: the arguments' ints, Nones and the kernel's specialisation are
    fixed by the record's signature, so only the tensors' addresses are read), falling back to
    the full launch whenever that launcher declines. A one-off launch (a forced config, an
    autotuning trial) never pays for generating one. ``run`` is the full launch alone.
    """

    __slots__ = ("launcher", "plan", "grid", "build", "_fast")

    def __init__(self, launcher, plan, grid: tuple, build: Callable):
        self.launcher = launcher
        self.plan = plan
        self.grid = grid
        self.build = build
        self._fast = _first

    def run(self, *tensors) -> None:
        self.launcher.launch(self.plan, self.grid, self.build(*tensors))

    def on(self, views: Callable) -> "Launch":
        """The same launch, called with other tensors: ``views(*tensors)`` gives the ones its
        builder takes (a workspace's parts, a transpose), made only when the full launch runs."""
        build = self.build
        return Launch(self.launcher, self.plan, self.grid, lambda *tensors: build(*views(*tensors)))

    def __call__(self, *tensors) -> None:
        fast = self._fast
        if fast(*tensors):
            return
        args = self.build(*tensors)
        self.launcher.launch(self.plan, self.grid, args)
        if fast is _first:
            self._fast = _second
        elif fast is _second:
            self._fast = self.launcher.fast(self.plan, self.grid, args, tensors) or _never


class Step:
    """A record's step that is not one kernel launch (torch ops writing into the tensors it is
    given: a large routing sort, the interpreter's quantiser), with Launch's interface."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *tensors) -> None:
        self.fn(*tensors)

    run = __call__

    def on(self, views: Callable) -> "Step":
        fn = self.fn
        return Step(lambda *tensors: fn(*views(*tensors)))


class Record:
    """A ready call: the output's shape and dtype, the launches that fill it, an optional
    ``finish(out)`` (a zero fill) and an optional ``check(*tensors)``: a check that reads
    values, not metadata (offs on the CPU), so it runs on every call. Called with the call's
    tensor arguments."""

    __slots__ = ("shape", "stride", "dtype", "device", "launches", "finish", "check")

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, launches=(), finish=None, check=None):
        self.shape = tuple(shape)
        self.stride = runtime.contiguous_strides(self.shape)
        self.dtype = dtype
        self.device = device
        self.launches = tuple(launches)
        self.finish = finish
        self.check = check

    def __call__(self, *tensors):
        if self.check is not None:
            self.check(*tensors)
        out = runtime.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        for launch in self.launches:
            launch(out, *tensors)
        return out if self.finish is None else self.finish(out)


class Workspace:
    """A record's intermediate tensors in one allocation per call: ``new()`` is one uint8
    buffer, and ``parts(buffer)`` its tensors, each at a fixed 16-byte aligned offset. A
    record's launches take the buffer itself (``Launch.on(workspace.parts)``-style builders),
    so their generated launchers read each part as the buffer's address plus a constant and
    no view is made on that path.

    ``parts``: (shape, dtype) of each tensor, contiguous. Under POISON the buffer is filled
    with 0xFF bytes: NaN in every float format onegemm writes, -1 in int32."""

    __slots__ = ("shapes", "dtypes", "offsets", "sizes", "nbytes", "device")

    def __init__(self, device: torch.device, *parts: tuple):
        self.device = device
        self.shapes, self.dtypes, self.offsets, self.sizes = [], [], [], []
        offset = 0
        for shape, dtype in parts:
            size = math.prod(shape) * dtype.itemsize
            self.shapes.append(tuple(shape))
            self.dtypes.append(dtype)
            self.offsets.append(offset)
            self.sizes.append(size)
            offset += -(-size // 16) * 16
        self.nbytes = offset

    def new(self) -> torch.Tensor:
        out = _empty_strided((self.nbytes,), (1,), dtype=torch.uint8, device=self.device)
        return out.fill_(255) if runtime.POISON else out

    def parts(self, buffer: torch.Tensor) -> list:
        return [self.part(buffer, i) for i in range(len(self.shapes))]

    def part(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        offset = self.offsets[i]
        return buffer[offset:offset + self.sizes[i]].view(self.dtypes[i]).view(self.shapes[i])


# ---------------------------------------------------------------------------- ops


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
    terms. A gradient depends on the op's inputs even when the incoming gradient is a constant,
    and the backward may keep only their quantised forms (which do not require grad), so the
    node is attached whenever gradients are given: to a stand-in leaf if nothing else requires
    grad."""

    def wrapped(ctx, *grads):
        with torch.no_grad():
            out = backward(ctx, *grads)
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return out
        given = [i for i, g in enumerate(out) if isinstance(g, torch.Tensor)]
        if not given:
            return out
        sources = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not sources:
            sources = [torch.zeros((), device=out[given[0]].device, requires_grad=True)]
        out = list(out)
        for i, g in zip(given, _NoSecondDerivative.apply(op, len(given), *(out[i] for i in given), *sources)):
            out[i] = g
        return tuple(out)

    return wrapped


def _refuse(no_grad: Callable, inputs: tuple) -> None:
    # setup_context runs only where autograd records the call, inside the op's forward, where
    # grad mode is off: back on, for the check's own test of it.
    with torch.enable_grad():
        no_grad(*inputs)


def _no_backward(ctx, *grads):
    raise AssertionError("an op without gradients was differentiated: its no_grad check let an input requiring grad "
                         "through (a onegemm bug)")


class Op:
    """One onegemm op in its three forms (module docstring).

    impl(*args) -> Tensor or tuple of Tensors: the kernels' call, with a type-annotated
        signature (torch.library infers the op's schema from it).
    fake(*args): the outputs' shapes and dtypes on meta / fake tensors.
    setup_context(ctx, inputs, output) and backward(ctx, *grads) -> one grad per input (None
        for non-tensor inputs): torch.library.register_autograd's contract, which the
        autograd.Function reuses as it is. None for an op without gradients.

    With ``record`` (an op on the signature cache): ``record(*args) -> Record``, the op's
    checks and decisions for ``args``, of which the first ``tensors`` are tensors (or None)
    and the rest plain values; ``impl`` is then ``op.direct(*args)``. ``op.call(*args)`` is
    the public entry (every route, cached), ``op.direct(*args)`` the first route alone (what
    the registered op and the autograd forward run). ``activation``: the index of an
    ``activation`` argument, fused in the epilogue without gradients and applied by torch
    after the GEMM with them (so autograd keeps the pre-activation and the backward needs no
    second forward GEMM). ``differentiable``: the names of the leading tensor arguments
    whose fp8 dtype rules gradients out. A cached call's autograd route passes its
    ``setup_context`` the ``tensors`` leading arguments alone: it may read only those.
    ``no_grad`` (an op without gradients): its check of ``args`` (checks.check_not_differentiable),
    which the record runs; the registered op's routes run it first too, and its autograd rule
    runs it, so torch.compile raises the eager call's ValueError, not Dynamo's "no autograd
    formula was registered" from tracing a backward the op does not have.
    """

    def __init__(self, name: str, impl: Callable, fake: Callable, setup_context: Callable | None = None,
                 backward: Callable | None = None, *, record: Callable | None = None, tensors: int = 0,
                 activation: int | None = None, differentiable: tuple = (), no_grad: Callable | None = None):
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

            # The autograd route of a cached call: its forward runs the record the call's
            # route made (passed last), not a second signature lookup. It takes the leading
            # tensor arguments alone (what every setup_context reads): each argument of a
            # Function's apply costs host time.
            def forward_recorded(ctx, *args):
                *args, run = args
                out = run(*args)
                setup_context(ctx, args, out)
                return out

            def backward_recorded(ctx, *grads):
                return (*backward(ctx, *grads)[:tensors], None)

            self.recorded = type(f"{name}_recorded", (torch.autograd.Function,), {
                "forward": staticmethod(forward_recorded),
                "backward": staticmethod(backward_recorded),
            })
            # Function.apply's C entry, without its Python wrapper (default-argument binding,
            # which a Function without setup_context skips, and functorch's unwrapping of dead
            # wrappers, which ``Cached`` has done before any record is built).
            self.recorded_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, self.recorded)
        self.no_grad = no_grad
        if no_grad is not None:
            self.custom.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: _refuse(no_grad, inputs))
        self.record = record
        self.tensors = tensors
        self.activation = activation
        self.differentiable = differentiable
        if record is not None:
            self.direct = Cached(tensors, lambda args: record(*args))
            self.call = Cached(tensors, self.route)

    def route(self, args: tuple) -> Callable:
        """The callable a call on ``args`` takes (module docstring), made on a cache miss."""
        n = self.tensors
        rest = args[n:]
        grad = self.function is not None and wants_grad(*args[:n])
        custom = torch.compiler.is_compiling() or transforms_active() or has_subclass(args[:n])
        if not custom and not grad:
            return self.record(*args)
        i = self.activation
        act = None if i is None or not grad else args[i]
        if act is not None:
            checks.check_activation(act)
            rest = rest[: i - n] + (None,) + rest[i - n + 1:]
        if custom:
            if self.no_grad is not None:  # raised where Dynamo traces, the eager ValueError reaches the caller
                self.no_grad(*args)
            apply = self.custom
        else:
            run = self.record(*args[:n], *rest)  # the checks, before any attribute of a wrong argument is read
            checks.check_differentiable(**dict(zip(self.differentiable, args)))
            recorded = self.recorded_apply
            if act is None:
                return lambda *t: recorded(*t, run)
            return lambda *t: apply_activation(recorded(*t, run), act)
        if act is None:
            return lambda *t: apply(*t, *rest)
        return lambda *t: apply_activation(apply(*t, *rest), act)

    def __call__(self, *args, grad_inputs=()):
        """Run the op on ``args`` (the first a tensor); ``grad_inputs``: the tensors among them
        that may require grad."""
        return self.run(args, wants_grad(*grad_inputs))

    def run(self, args: tuple, grad: bool):
        """``__call__`` for a caller that has already asked ``wants_grad``."""
        if torch.compiler.is_compiling() or transforms_active() or has_subclass(args):
            return self.custom(*args)
        if grad and self.function is not None:
            return self.function.apply(*args)
        return self.impl(*args)
