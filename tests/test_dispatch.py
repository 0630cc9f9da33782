"""The eager path (core/dispatch.py): the signature cache, and the registered op for tensor
subclasses in any tensor position."""

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

import onegemm
from onegemm.core import dispatch, launch
from onegemm.core.matmul import DENSE, LINEAR
from onegemm.grouped.ops import GROUPED
from onegemm.testing import TOL, assert_close, grouped_mm_ref, matmul_ref, quantize_experts_ref, quantize_fp8_ref

# ---- the signature cache ----


def _aligned_pair(rows, cols, device):
    """Two [rows, cols] fp32 views with equal shape and strides, one 16-byte aligned and one
    not (4 bytes further)."""
    buf = torch.randn(rows * cols + 4, device=device)
    return buf[: rows * cols].view(rows, cols), buf[1 : rows * cols + 1].view(rows, cols)


def _base(device):
    a, _ = _aligned_pair(9, 20, device)
    return dict(a=a, b=torch.randn(20, 12, device=device), bias=None, activation=None, out_dtype=None, tma=None,
                persistent=None)


def _change(field, device):
    """The base call with one signature field changed (each must be a miss)."""
    kw = _base(device)
    a = kw["a"]
    if field == "shape":
        kw["a"] = torch.randn(10, 20, device=device)
    elif field == "strides":
        kw["a"] = a.t().contiguous().t()
    elif field == "dtype":
        kw["a"], kw["b"] = a.double().float().half(), kw["b"].half()
    elif field == "alignment":
        kw["a"] = _aligned_pair(9, 20, device)[1]
    elif field == "requires_grad":
        kw["a"] = a.clone().requires_grad_()
    elif field == "bias present":
        kw["bias"] = torch.randn(12, device=device)
    elif field in ("activation", "out_dtype", "tma", "persistent"):
        kw[field] = {"activation": "relu", "out_dtype": torch.float16, "tma": False, "persistent": True}[field]
    return kw


_FIELDS = ["shape", "strides", "dtype", "alignment", "requires_grad", "grad mode", "fp32 precision", "bias present",
           "activation", "out_dtype", "tma", "persistent"]


def _call(kw):
    return onegemm.matmul(kw["a"], kw["b"], bias=kw["bias"], activation=kw["activation"], out_dtype=kw["out_dtype"],
                          tma=kw["tma"], persistent=kw["persistent"])


@pytest.fixture
def fresh():
    launch.clear_plans()
    yield
    launch.clear_plans()


@pytest.mark.parametrize("field", _FIELDS)
def test_each_signature_field_is_a_miss(field, fresh, device):
    """A call that differs from a cached one in one signature field gets a record of its own
    (and the right answer): with the field dropped from ``dispatch.signature`` it would reuse
    the first call's record, and this test fails."""
    base = _base(device)
    _call(base)
    _call(dict(base, a=base["a"].clone()))  # same signature, other tensors: a hit
    assert len(DENSE.call.records) == 1
    kw = _change(field, device)
    previous = torch.get_float32_matmul_precision()
    try:
        if field == "grad mode":
            kw["a"] = kw["a"].clone().requires_grad_()
            _call(kw)  # a requires grad, grad mode on: a miss of its own ...
            assert len(DENSE.call.records) == 2
            with torch.no_grad():
                out = _call(kw)  # ... and with grad mode off, another
        elif field == "fp32 precision":
            torch.set_float32_matmul_precision("high")
            out = _call(kw)
        else:
            out = _call(kw)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert len(DENSE.call.records) == (3 if field == "grad mode" else 2)
    ref = matmul_ref(kw["a"].detach(), kw["b"], kw["bias"], kw["activation"])
    tol = TOL[out.dtype] if field != "fp32 precision" else 1e-2
    assert_close(out.detach(), ref, tol)


def test_option_types_are_part_of_the_signature(fresh, device):
    """tma=1 is not tma=True (they hash alike): the cached call does not hide the TypeError."""
    a, b = torch.randn(8, 16, device=device), torch.randn(16, 8, device=device)
    onegemm.matmul(a, b, tma=False)
    with pytest.raises(TypeError, match="tma must be None"):
        onegemm.matmul(a, b, tma=0)
    onegemm.persistent_matmul(a, b, num_programs=2)
    with pytest.raises(TypeError, match="num_programs must be an int"):
        onegemm.persistent_matmul(a, b, num_programs=2.0)
    with pytest.raises(TypeError, match="activation must be one of"):
        onegemm.matmul(a, b, activation=["relu"])  # unhashable: the full path names it


def test_parameters_take_the_cache(fresh, monkeypatch, device):
    """nn.Parameter (a module's weight) is no __torch_dispatch__ subclass: linear on a
    layer's Parameters takes the signature cache, not the registered op."""
    layer = torch.nn.Linear(16, 8, device=device)
    x = torch.randn(5, 16, device=device)
    with torch.no_grad():
        onegemm.linear(x, layer.weight, layer.bias)
        monkeypatch.setattr(DENSE, "custom", None)  # the registered op is not called
        out = onegemm.linear(x, layer.weight, layer.bias)
    assert len(LINEAR.records) == 1
    assert_close(out, matmul_ref(x, layer.weight.detach().t(), layer.bias.detach()), TOL[torch.float32])


def test_signature_holds_the_device():
    """The device (CPU and meta tensors both report get_device() == -1) is in the signature."""
    t = torch.empty(4, 4)
    assert dispatch.signature((t,), 1) != dispatch.signature((t.to("meta"),), 1)


def test_values_checked_on_every_call(fresh, device):
    """check_offs reads offs' values, which no signature holds: a cached grouped call still
    refuses bad offs of the same metadata."""
    a, b = torch.randn(10, 8, device=device), torch.randn(3, 8, 6, device=device)
    good = torch.tensor([3, 7, 10], dtype=torch.int32, device=device)
    out = onegemm.grouped_matmul(a, b, good, check_offs=True)
    assert_close(out, grouped_mm_ref(a, b, good), TOL[torch.float32])
    with pytest.raises(ValueError, match="offs must be non-decreasing"):
        onegemm.grouped_matmul(a, b, torch.tensor([3, 2, 10], dtype=torch.int32, device=device), check_offs=True)
    assert len(GROUPED.call.records) == 1


def test_records_are_bounded_and_cleared_with_the_plans(fresh, device):
    records = dispatch.Records(size=3)
    for i in range(5):
        records.put((i,), i)
    assert len(records) == 3 and records.get((0,)) is None and records.get((4,)) == 4
    onegemm.matmul(torch.randn(4, 8, device=device), torch.randn(8, 4, device=device))
    assert len(DENSE.call.records) == 1
    launch.clear_plans()  # tables reloaded, autotuning switched on: records hold old plans
    assert len(records) == 0 and len(DENSE.call.records) == 0


def test_records_from_many_threads(fresh, device):
    """Threads filling and reading one op's records at once (several shapes each) all get
    their own right answer."""
    inputs = [(torch.randn(m, 16, device=device), torch.randn(16, 8, device=device)) for m in (3, 5, 7, 9)]
    errors = []

    def work(a, b):
        try:
            for _ in range(3):
                assert_close(onegemm.matmul(a, b), matmul_ref(a, b), TOL[torch.float32])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=ab) for ab in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(DENSE.call.records) == 4


# ---- tensor subclasses take the registered op, in every tensor position ----


class Wrapped(torch.Tensor):
    """The plainest __torch_dispatch__ subclass: a wrapper that unwraps, runs, rewraps."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device, storage_offset=inner.storage_offset())

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.inner if isinstance(x, Wrapped) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Wrapped(x) if isinstance(x, torch.Tensor) else x, out)


def _inputs(name, device):
    """(fn(*tensors), tensors) of one public op, small."""
    if name in ("matmul", "linear", "persistent_matmul"):
        a, b, bias = torch.randn(9, 16, device=device), torch.randn(16, 12, device=device), torch.randn(12, device=device)
        fn = {"matmul": lambda a, b, bias: onegemm.matmul(a, b, bias=bias),
              "linear": lambda x, w, bias: onegemm.linear(x, w.t(), bias),
              "persistent_matmul": lambda a, b, bias: onegemm.persistent_matmul(a, b, bias=bias)}[name]
        return fn, (a, b, bias)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32, device=device)
    if name == "grouped_matmul":
        return (lambda a, b, offs, bias: onegemm.grouped_matmul(a, b, offs, bias=bias),
                (torch.randn(10, 16, device=device), torch.randn(3, 16, 12, device=device), offs,
                 torch.randn(3, 12, device=device)))
    qa, sa = quantize_fp8_ref(torch.randn(10, 128, device=device), (1, 128))
    if name == "grouped_matmul fp8":
        qw, sw = quantize_experts_ref(torch.randn(3, 16, 128, device=device))
        return (lambda a, b, offs, sa, sb: onegemm.grouped_matmul(a, b, offs, scale_a=sa, scale_b=sb),
                (qa, qw.transpose(1, 2), offs, sa, sw.transpose(1, 2)))
    if name == "blockscaled_matmul":
        qb, sb = quantize_fp8_ref(torch.randn(16, 128, device=device), (128, 128))
        return (lambda a, b, sa, sb, bias: onegemm.blockscaled_matmul(a, b, sa, sb, bias=bias),
                (qa, qb.t(), sa, sb.t(), torch.randn(16, device=device)))
    if name == "quantize_fp8":
        return lambda x: onegemm.quantize_fp8(x)[1], (torch.randn(4, 128, device=device),)
    E, T, H, I = 3, 4, 16, 8
    weights, ids = onegemm.route(torch.randn(T, E, device=device), 2)
    return (lambda *t: onegemm.moe_ffn(*t), (torch.randn(T, H, device=device), torch.randn(E, 2 * I, H, device=device),
                                             torch.randn(E, H, I, device=device), weights, ids))


# name: number of tensor arguments
_OPS = {"matmul": 3, "linear": 3, "persistent_matmul": 3, "grouped_matmul": 4, "grouped_matmul fp8": 5,
        "blockscaled_matmul": 5, "quantize_fp8": 1, "moe_ffn": 5}


@pytest.mark.parametrize("name,position", [pytest.param(name, i, id=f"{name}-arg{i}") for name, n in _OPS.items()
                                           for i in range(n)])
def test_subclass_in_any_position_takes_the_registered_op(name, position, device):
    """A __torch_dispatch__ subclass in any one tensor position (the others plain) sees the
    op in its __torch_dispatch__ and gets the plain call's result, never a raw launch on a
    tensor without memory."""
    fn, tensors = _inputs(name, device)
    mixed = [Wrapped(t) if i == position else t for i, t in enumerate(tensors)]
    got = fn(*mixed)
    assert type(got) is Wrapped
    assert torch.equal(got.inner.float(), fn(*tensors).float())


@pytest.mark.parametrize("name", list(_OPS))
def test_fake_tensors_take_the_fake(name, device):
    """Under FakeTensorMode every op gives fake outputs of the real call's shape and dtype."""
    fn, tensors = _inputs(name, device)
    want = fn(*tensors)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in tensors]
    with mode:
        got = fn(*fakes)
    assert isinstance(got, FakeTensor) and got.shape == want.shape and got.dtype == want.dtype


# ---- torch.func transforms ----


def test_vmap_takes_the_registered_op(device):
    """Inside torch.func.vmap the tensors are batching wrappers without storage: the call takes
    the registered op (torch's per-sample fallback), and equals the per-sample calls."""
    a, b = torch.randn(3, 17, 24, device=device), torch.randn(24, 9, device=device)
    got = torch.func.vmap(lambda x: onegemm.matmul(x, b))(a)
    assert_close(got, torch.stack([matmul_ref(x, b) for x in a]), TOL[torch.float32])


def test_func_grad_is_refused_by_torch(device):
    """torch.func.grad differentiates through torch's custom-op autograd, which does not support
    functorch transforms (torch 2.11-2.13): an error, never a gradient computed on a wrapper."""
    a, b = torch.randn(17, 24, device=device), torch.randn(24, 9, device=device)
    with pytest.raises(RuntimeError, match="functorch transforms"):
        torch.func.grad(lambda x: onegemm.matmul(x, b).sum())(a)


def test_a_wrapper_left_by_an_exited_transform_is_unwrapped(device):
    """A tensor that escaped a torch.func transform stays a functorch wrapper (no storage)
    after the transform exits. The call unwraps it, as Function.apply's Python wrapper would,
    before anything reads its data pointer (the TMA checks, the gradient route's C entry)."""
    leaked = []

    def keep(x):
        leaked.append(x)
        return (x * x).sum()

    x = torch.randn(17, 24, device=device)
    torch.func.grad(keep)(x)
    a, b = leaked[0], torch.randn(24, 9, device=device, requires_grad=True)
    assert torch._C._functorch.is_functorch_wrapped_tensor(a) and a.requires_grad
    out = onegemm.matmul(a, b)
    assert_close(out, matmul_ref(x, b.detach()), TOL[torch.float32])
    g = torch.randn_like(out)
    out.backward(g)
    assert_close(b.grad, (x.double().t() @ g.double()).float(), TOL[torch.float32])
