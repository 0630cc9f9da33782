"""The one launch path (core/launch.py): plans, specialisation, scratch, threads, autotuning."""

import json
import threading
import typing
from pathlib import Path

import pytest
import torch

import onegemm
from onegemm.core import configs, hopper_configs, launch, scratch, splitk, tables, triton_abi
from onegemm.core.configs import cfg
from onegemm.blockscaled import configs as blockscaled_configs
from onegemm.grouped import configs as grouped_configs
from onegemm.core.scaling import BLOCKWISE, Granularity, Scaling
from onegemm.core.matmul import MATMUL
from onegemm.core.tiles import Operand, Scales, Vector
from onegemm.testing import (TOL, assert_close, blockscaled_matmul_ref, grouped_mm_ref, matmul_ref, moe_fp8_ref, moe_ref,
                             quantize_fp8_ref)

# ---- specialisation: a compiled kernel is reused only where Triton would reuse it ----

_INTS = [0, 1, 2, 15, 16, 17, 32, 48, 4096, 4095, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**31 + 16, 2**40, -1, -16, -17]


def _tensors():
    base = torch.empty(64, dtype=torch.float32)
    return [base, base[1:], base[4:], base[3:], base.to(torch.bfloat16), base.to(torch.bfloat16)[8:],
            base.to(torch.bfloat16)[1:], base.to(torch.int32), base.to(torch.float8_e4m3fn)[16:]]


def _values():
    return _INTS + _tensors() + [None, True, False, 2.5, 0.0]


def test_spec_key_refines_triton_specialisation():
    """Two argument values with the same triton_abi.spec key get the same specialisation from
    Triton's own rule (native_specialize_impl, what JITFunction.run keys its compiled kernels
    on), so a plan never launches a kernel compiled for other strides or alignment."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    values = _values()
    ours = [triton_abi.spec((v,)) for v in values]
    triton_spec = [native_specialize_impl(CUDABackend, v, False, True, True) for v in values]
    for i in range(len(values)):
        for j in range(len(values)):
            if ours[i] == ours[j]:
                assert triton_spec[i] == triton_spec[j], (values[i], values[j])
    # and it separates what matters: 1, multiples of 16, int64, alignment, dtype, None
    assert len(set(ours[: len(_INTS)])) == 5
    assert len({triton_abi.spec((t,)) for t in _tensors()}) == 6


def test_spec_key_recurses_into_tuples():
    assert triton_abi.spec(((16, 1), None)) == ((triton_abi.spec((16,))[0], triton_abi.spec((1,))[0]), None)


def _tile_args():
    """matmul_kernel's arguments as an op passes them: NamedTuples with tensors, ints and None."""
    t = torch.empty(8, 8)
    return (Operand(t, 8, 1), Operand(t.t(), 1, 8), Operand(torch.empty(3, 5)[:, 1:], 5, 1), Vector(torch.empty(9), 1),
            Scales(), 17, 4096, 2**31 + 5, None, None)


@pytest.mark.parametrize("kinds_of", ["flat", "mixed", "tuples"])
def test_generated_preparer_matches_prepare(kinds_of):
    """The preparer a plan generates for its argument kinds gives what _prepare gives, and
    refuses arguments of other kinds (TypeError) or tuples of another length (ValueError), so
    the launch falls back to _prepare."""
    t = torch.empty(8, 8)
    if kinds_of == "flat":
        args = (t, t.t(), torch.empty(3, 5)[:, 1:], None, 17, 1, 4096, 2**31 + 5, 16, 0, None, torch.empty(2))
    elif kinds_of == "mixed":
        args = (torch.empty(4, dtype=torch.bfloat16)[1:], 1, None)
    else:
        args = _tile_args()
    prepare = triton_abi.preparer(triton_abi.kinds(args))
    assert prepare(args) == triton_abi.prepare(args)
    other = tuple(torch.empty(2) if x.__class__ is int else x for x in args)
    with pytest.raises((TypeError, AttributeError)):
        prepare(other)
    if kinds_of == "tuples":
        with pytest.raises(ValueError):
            prepare((Operand(t, 8, 1), *args[1:3], (torch.empty(9), 1, 2), *args[4:]))
    assert triton_abi.kinds((1, 2.5)) is None  # floats take _prepare


def test_prepare_gives_the_spec_and_pointers():
    """The launch path's one pass: the same key as _spec, every tensor as its data pointer
    (what Triton's C launcher takes for a pointer argument), everything else as it was."""
    args = (*_values(), (3, torch.empty(4)))
    spec, raw = triton_abi.prepare(args)
    assert spec == triton_abi.spec(args)
    for x, r in zip(args[:-1], raw[:-1]):
        assert r == (x.data_ptr() if isinstance(x, torch.Tensor) else x) or (r is x)
    assert raw[-1] == (3, args[-1][1].data_ptr())


# ---- generated launchers (triton_abi.fast_launcher) ----


class _FakeRun:
    launch_cooperative_grid, launch_pdl = False, True


def _fake_compiled(calls, scratch=0):
    """A Compiled whose C entry records its arguments instead of launching."""
    return triton_abi.Compiled(kernel=None, run=_FakeRun(), function=1234, packed="packed",
                               raw=lambda *a: calls.append(a), scratch=scratch)


def _fast_case(a, b, c, bias):
    """Arguments built as a record's builder builds them: tile tuples of the sources, ints,
    Nones, a float and a bool."""
    return (Operand(a, a.stride(0), a.stride(1)), Operand(b, *b.stride()), Operand(c, *c.stride()),
            Vector(bias, 1), Scales(), 17, 2**31 + 5, 0.5, True, None)


@pytest.fixture
def cuda_stubs(monkeypatch):
    """The two torch CUDA queries a generated launcher makes, on a machine without CUDA."""
    state = dict(device=0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["device"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 777 + device, raising=False)
    monkeypatch.setattr(triton_abi, "NATIVE", True)
    return state


def _fresh(bias=True):
    a, b = torch.randn(6, 8), torch.randn(5, 8).t()
    return a, b, torch.empty(6, 5), torch.randn(5) if bias else None


def test_fast_launcher_passes_what_the_full_launch_would(cuda_stubs):
    """Made from one call's arguments, the generated launcher started with other tensors of
    the same signature passes the C entry exactly what the full launch would pass for them:
    the grid, the current stream, the kernel's handles, prepare's raw arguments and the
    constexprs."""
    calls = []
    first = _fresh()
    tail = (64, "gelu", None, True)
    fast = triton_abi.fast_launcher(_fake_compiled(calls), (3, 2), _fast_case(*first), first, tail, 0)
    again = _fresh()
    assert fast(*again) is True
    (got,) = calls
    raw = triton_abi.prepare(_fast_case(*again))[1]
    assert got == (3, 2, 1, 777, 1234, False, True, None, None, "packed", None, None, None, *raw, *tail)
    assert got[13][0] == again[0].data_ptr() != first[0].data_ptr()


def test_fast_launcher_declines_and_refuses(cuda_stubs, monkeypatch):
    """It launches nothing and returns False where the full launch must run (an unaligned
    pointer, another current device, a launch hook, a recording block, the public path), and
    is not made (None) for arguments whose values it cannot fix."""
    calls = []
    first = _fresh()
    fast = triton_abi.fast_launcher(_fake_compiled(calls), (4,), _fast_case(*first), first, (), 0)
    a, b, c, bias = _fresh()
    unaligned = torch.randn(6 * 8 + 1)[1:].view(6, 8)
    assert fast(unaligned, b, c, bias) is False
    cuda_stubs["device"] = 1
    assert fast(a, b, c, bias) is False
    cuda_stubs["device"] = 0
    monkeypatch.setattr(triton_abi, "PAUSED", 1)
    assert fast(a, b, c, bias) is False
    monkeypatch.setattr(triton_abi, "PAUSED", 0)
    monkeypatch.setattr(triton_abi, "NATIVE", False)
    assert fast(a, b, c, bias) is False
    monkeypatch.setattr(triton_abi, "NATIVE", True)
    from triton import knobs

    hook = lambda metadata: None  # noqa: E731 - a profiler's launch hook
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert fast(a, b, c, bias) is False
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert calls == []
    assert fast(a, b, c, bias) is True and len(calls) == 1
    made = triton_abi.fast_launcher(_fake_compiled(calls), (4,), _fast_case(*first), first, (), 0)
    assert made is not None
    scratch_tensor = torch.empty(4)  # a tensor made for the launch, not a source
    assert triton_abi.fast_launcher(_fake_compiled(calls), (4,), (*_fast_case(*first), scratch_tensor), first, (), 0) is None
    assert triton_abi.fast_launcher(_fake_compiled(calls), (4,), (*_fast_case(*first), "text"), first, (), 0) is None
    odd = (unaligned, b, c, bias)
    assert triton_abi.fast_launcher(_fake_compiled(calls), (4,), _fast_case(*odd), odd, (), 0) is None
    no_entry = _fake_compiled(calls)._replace(raw=None)
    assert triton_abi.fast_launcher(no_entry, (4,), _fast_case(*first), first, (), 0) is None


def test_fast_launcher_reads_views_from_their_source(cuda_stubs):
    """A view the builder makes of a source (grouped experts read as w.transpose(1, 2), a part
    of a record's workspace) is read as that source's pointer plus the view's fixed offset, so
    a later call gets its own tensor's; a view two sources could account for, or one whose
    offset is not a multiple of 16 bytes, gets no launcher. A source that is not a tensor must
    be the same object again."""
    calls = []
    w0, c0, scales = torch.randn(3, 8, 4), torch.empty(5), (None, None)

    def build(c, w, scales):
        return (Operand(w.transpose(1, 2), 4, 1), c, 7, scales, w[1, 2:].view(torch.int32))

    fast = triton_abi.fast_launcher(_fake_compiled(calls), (1,), build(c0, w0, scales), (c0, w0, scales), (), 0)
    w1, c1 = torch.randn(3, 8, 4), torch.empty(5)
    assert fast(c1, w1, scales) is True
    assert calls[-1][13:] == triton_abi.prepare(build(c1, w1, scales))[1]
    assert calls[-1][13][0] == w1.data_ptr() and calls[-1][-1] == w1.data_ptr() + (32 + 8) * 4
    assert fast(c1, w1, tuple([None, None])) is False  # an equal tuple, not the same object
    twin = w0.view(3, 32)
    assert triton_abi.fast_launcher(_fake_compiled(calls), (1,), build(c0, w0, scales), (c0, w0, twin), (), 0) is None
    odd = (Operand(w0[0, 1:], 4, 1), c0)  # 16 bytes past w0's address: fine; 4 bytes: not
    assert triton_abi.fast_launcher(_fake_compiled(calls), (1,), odd, (c0, w0), (), 0) is not None
    odd = (Operand(w0[0, 0, 1:], 4, 1), c0)
    assert triton_abi.fast_launcher(_fake_compiled(calls), (1,), odd, (c0, w0), (), 0) is None


def test_fast_launcher_gets_tma_scratch_per_launch(cuda_stubs, monkeypatch):
    """A kernel that builds TMA descriptors gets its global scratch from core/scratch.py on
    every launch (per stream, fresh under graph capture), sized for the grid."""
    calls, asked = [], []
    monkeypatch.setattr(scratch, "get", lambda device, kind, numel, dtype: asked.append((kind, numel)) or torch.empty(numel))
    first = _fresh(bias=False)
    fast = triton_abi.fast_launcher(_fake_compiled(calls, scratch=128), (5, 2), _fast_case(*first[:3], torch.empty(5)),
                                    (*first[:3], None), (), 0)
    assert fast is None  # the bias tensor is not a source
    args = (Operand(first[0], 8, 1), None, 3)
    fast = triton_abi.fast_launcher(_fake_compiled(calls, scratch=128), (5, 2), args, first, (), 0)
    assert fast(*first) and fast(*first)
    assert asked == [("tma_descriptors", 5 * 2 * 128)] * 2
    assert calls[0][7] is not None


def test_record_launch_generates_its_launcher_on_the_second_call():
    """A record's Launch runs the full launch on its first two calls, makes its generated
    launcher from the second call's arguments, and from then on uses it while it launches,
    falling back to the full launch whenever it declines; a Launch that cannot have one keeps
    the full launch without asking again."""
    from onegemm.core.dispatch import Launch

    events = []

    class Launcher:
        def launch(self, plan, grid, args):
            events.append(("full", args))

        def fast(self, plan, grid, args, sources):
            events.append(("make", sources))
            return lambda *t: events.append(("fast", t)) or t[1] != "decline"

    one = Launch(Launcher(), None, (1,), lambda out, x: (out, x))
    for x in ("x1", "x2", "x3", "decline", "x5"):
        one("out", x)
    assert events == [("full", ("out", "x1")), ("full", ("out", "x2")), ("make", ("out", "x2")), ("fast", ("out", "x3")),
                      ("fast", ("out", "decline")), ("full", ("out", "decline")), ("fast", ("out", "x5"))]

    class Never(Launcher):
        def fast(self, plan, grid, args, sources):
            events.append(("make", sources))
            return None

    events.clear()
    never = Launch(Never(), None, (1,), lambda out, x: (out, x))
    for x in ("x1", "x2", "x3", "x4"):
        never("out", x)
    assert [e[0] for e in events] == ["full", "full", "make", "full", "full"]


def test_recording_pauses_generated_launchers(device):
    assert triton_abi.PAUSED == 0
    with launch.recording():
        assert triton_abi.PAUSED == 1
        with launch.recording():
            assert triton_abi.PAUSED == 2
    assert triton_abi.PAUSED == 0


# ---- the plan cache ----


def _plans():
    return launch.plans("matmul")


@pytest.fixture
def fresh_plans():
    launch.clear_plans()
    yield
    launch.clear_plans()


def test_recording_sees_the_launches_of_its_block_only(device):
    """launch.recording: one Launched per launch inside the block (nested blocks both see it),
    none after it; the launchers run their own method again once it ends."""
    a = torch.randn(20, 24, device=device)
    b = torch.randn(24, 8, device=device)
    with launch.recording() as outer:
        onegemm.matmul(a, b)
        with launch.recording() as inner:
            onegemm.grouped_matmul([a], [b])
    onegemm.matmul(a, b)
    assert [x.family for x in outer] == ["matmul", "list"] and [x.family for x in inner] == ["list"]
    assert any(outer[0].plan is p for p in launch.plans("matmul").values())
    assert all("launch" not in vars(x) for x in launch.launchers())


def test_plan_reused_for_the_same_call(fresh_plans, device):
    a = torch.randn(40, 50, device=device)
    b = torch.randn(50, 30, device=device)
    onegemm.matmul(a, b)
    (plan,) = _plans().values()
    a2 = torch.randn(33, 50, device=device)  # another M in the same bucket (64)
    out = onegemm.matmul(a2, b)
    assert list(_plans().values()) == [plan]
    assert_close(out, matmul_ref(a2, b), TOL[torch.float32])


@pytest.mark.skipif(not triton_abi.NATIVE, reason="generated preparers serve Triton 3.6's C launcher on a GPU; "
                    "the interpreter launches through Triton's public path")
def test_plan_keeps_a_preparer_per_argument_nesting(fresh_plans, device, monkeypatch):
    """matmul with and without a bias shares one plan (the bias is not part of the config
    choice) but nests its arguments apart (Vector(bias, 1) against NO_VECTOR): the plan keeps
    a generated preparer for each, so neither call falls back to triton_abi.prepare's loop."""
    a = torch.randn(40, 64, device=device)
    b = torch.randn(64, 48, device=device)
    bias = torch.randn(48, device=device)
    plain, biased = onegemm.matmul(a, b), onegemm.matmul(a, b, bias=bias)
    assert_close(biased, matmul_ref(a, b, bias), TOL[torch.float32])
    (plan,) = _plans().values()
    assert len(plan.preparers) == 2
    fallbacks = []
    generic = triton_abi.prepare
    monkeypatch.setattr(triton_abi, "prepare", lambda args: fallbacks.append(args) or generic(args))
    assert torch.equal(onegemm.matmul(a, b), plain) and torch.equal(onegemm.matmul(a, b, bias=bias), biased)
    assert fallbacks == []


# Each case changes one thing a plan depends on; the call must get a plan of its own (and
# the right answer), never the first call's.
def _variants(device):
    a = torch.randn(40, 50, device=device)
    b = torch.randn(50, 30, device=device)
    bias = torch.randn(30, device=device)
    return {
        "a transposed": dict(a=a.t().contiguous().t(), b=b),
        "b transposed": dict(a=a, b=b.t().contiguous().t()),
        "dtype": dict(a=a.half(), b=b.half()),
        "out_dtype": dict(a=a, b=b, out_dtype=torch.float16),
        "bias": dict(a=a, b=b, bias=bias),
        "bias dtype": dict(a=a, b=b, bias=bias.half()),
        "activation": dict(a=a, b=b, activation="silu"),
        "another M bucket": dict(a=torch.randn(200, 50, device=device), b=b),
        "forced config": dict(a=a, b=b, config=cfg(16, 16, 16, 4, 2, group_m=1)),
        "persistent": dict(a=a, b=b, persistent=True),
    }


# What only the compiled kernel's specialisation depends on (a dtype or a None among the
# runtime arguments): one plan, whose kernels are keyed by the argument specialisation.
_SPEC_ONLY = ("out_dtype", "bias", "bias dtype")


@pytest.mark.parametrize("change", list(_variants("cpu")))
def test_plan_not_reused_across_what_it_depends_on(change, fresh_plans, device):
    base = _variants(device)["a transposed"]
    base = dict(a=base["a"].contiguous(), b=base["b"])
    onegemm.matmul(**base)
    first = list(_plans().values())
    kwargs = _variants(device)[change]
    out = onegemm.matmul(**kwargs)
    plans = list(_plans().values())
    assert len(plans) == (1 if change in _SPEC_ONLY else 2) and plans[0] is first[0]
    ref = matmul_ref(kwargs["a"], kwargs["b"], kwargs.get("bias"), kwargs.get("activation"))
    assert_close(out, ref, TOL[out.dtype])
    if change == "forced config":
        assert plans[1].source == "forced" and plans[1].meta["BLOCK_M"] == 16


def test_plan_key_holds_what_a_plan_is_made_from():
    """launch.plan_key: the family key, the constexprs, the device and the forced config; a
    request that differs in any of them gets a plan of its own."""
    from onegemm.core.launch import Request, plan_key

    base = Request(("key",), dict(ACTIVATION=None), torch.device("cuda", 0))
    others = [base._replace(key=("other",)), base._replace(constexprs=dict(ACTIVATION="relu")),
              base._replace(device=torch.device("cuda", 1)), base._replace(forced=cfg(16, 16, 16, 4, 2))]
    keys = {plan_key(r) for r in [base, *others]}
    assert len(keys) == 5
    assert plan_key(base._replace(trial=lambda plan: None)) == plan_key(base)  # how to time it is not what it is


def test_plan_for_with_a_key_builds_the_request_on_a_miss_only(fresh_plans, device):
    """Launcher.plan_for(make, key), what a call site looking its plan up on every call passes
    (grouped/ops.py row_tiles): ``make()`` runs at the key's first lookup only, never on a hit,
    and the plan is stored under that key; a Request passed itself is stored under plan_key."""
    from onegemm.core.launch import Request, plan_key
    from onegemm.grouped.ops import ROW_TILES

    made, where = [], torch.empty(0, device=device).device  # cuda:0, with its index, on a GPU

    def make():
        made.append(1)
        return Request(configs.PrepKey("row_tiles", 4), dict(BLOCK_M=64, G_BLOCK=4, TAIL=True), where)

    first = ROW_TILES.plan_for(make, ("site", 64))
    assert all(ROW_TILES.plan_for(make, ("site", 64)) is first for _ in range(3)) and made == [1]
    req = make()
    plan = ROW_TILES.plan_for(req)
    assert ROW_TILES.plan_for(req) is plan and made == [1, 1]
    assert launch.plans("row_tiles") == {("site", 64): first, plan_key(req): plan}
    assert (plan.config, plan.meta, plan.source) == (first.config, first.meta, first.source)


def test_plan_for_is_the_one_way_to_a_plan():
    """Launcher.plan_for is the only method that reads the plan table (core/launch.py, parsed):
    a second lookup (a plan(key, request) beside plan_for, each with its own copy of the
    double-checked lock) fails here. The lock itself is Launcher._once's alone."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(launch.Launcher))
    (cls,) = tree.body

    def uses(method, attr):
        return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
                   and n.value.id == "self" for n in ast.walk(method))

    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    assert [m.name for m in methods if uses(m, "_plans")] == ["__init__", "plan_for"]
    assert [m.name for m in methods if uses(m, "_lock") and m.name != "__init__"] == ["_once"]


def test_forced_config_then_unforced(fresh_plans, device):
    """A forced config does not leak into later unforced calls of the same shape."""
    a = torch.randn(70, 40, device=device)
    b = torch.randn(40, 50, device=device)
    forced = onegemm.matmul(a, b, config=cfg(16, 16, 16, 4, 2, group_m=1))
    free = onegemm.matmul(a, b)
    sources = sorted(p.source for p in _plans().values())
    assert sources == sorted(["forced", "interpreter" if onegemm.INTERPRET else free_source()])
    assert_close(forced, matmul_ref(a, b), TOL[torch.float32])
    assert_close(free, matmul_ref(a, b), TOL[torch.float32])


def free_source():
    sources = {p.source for p in _plans().values()} - {"forced"}
    (source,) = sources
    assert source in ("table", "heuristic", "tuned")
    return source


def test_plan_holds_every_constexpr(fresh_plans, device):
    """A plan passes every constexpr of the kernel, in parameter order (the direct launch
    hands Triton's C launcher all parameters positionally)."""
    onegemm.matmul(torch.randn(8, 8, device=device), torch.randn(8, 8, device=device))
    (plan,) = _plans().values()
    names = [p.name for p in MATMUL.params if p.is_constexpr]
    assert tuple(plan.meta[n] for n in names) == plan.tail
    assert len(names) + MATMUL.num_args == len(MATMUL.params)


def test_launcher_rejects_runtime_after_constexpr():
    import triton
    import triton.language as tl

    @triton.jit
    def bad(x_ptr, N: tl.constexpr, y_ptr):
        pass

    with pytest.raises(TypeError, match="must come after the runtime ones"):
        launch.Launcher(bad, configs.Family("bad", None, None, cfg(16, 16, 16, 1, 1)))


# ---- split-K scratch ----


@pytest.mark.gpu
def test_gpu_split_k_scratch_per_stream(device):
    """Buffers are keyed by device and stream: two streams never share one."""
    launch.reset()
    dev = torch.device(device)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        w1, c1 = splitk.buffers(dev, 100, 4)
    with torch.cuda.stream(s2):
        w2, c2 = splitk.buffers(dev, 100, 4)
    assert w1.data_ptr() != w2.data_ptr() and c1.data_ptr() != c2.data_ptr()
    assert len(scratch._held) == 4


# ---- threads ----


def _mixed_ops(device):
    """(name, fn, reference) for several public ops on small fresh inputs."""
    a = torch.randn(37, 48, device=device)
    b = torch.randn(48, 29, device=device)
    sizes = [5, 0, 9]
    ga = torch.randn(sum(sizes), 32, device=device)
    gb = torch.randn(3, 32, 24, device=device)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(20, 256, device=device)
    qa, sa = quantize_fp8_ref(torch.randn(24, 256, device=device), (1, 128))
    qw, sw = quantize_fp8_ref(torch.randn(40, 256, device=device), (128, 128))
    return [
        ("matmul", lambda: onegemm.matmul(a, b, activation="relu"), matmul_ref(a, b, None, "relu"), 1e-5),
        ("grouped", lambda: onegemm.grouped_matmul(ga, gb, offs), grouped_mm_ref(ga, gb, offs), 1e-5),
        ("quantize", lambda: onegemm.quantize_fp8(x, (1, 128))[1], quantize_fp8_ref(x, (1, 128))[1], 0.0),
        ("blockscaled", lambda: onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t(), out_dtype=torch.float32),
         blockscaled_matmul_ref(qa, qw.t(), sa, sw.t(), (1, 128), (128, 128)), 1e-3),
    ]


def test_concurrent_threads_mixed_ops(device):
    """Four threads, each running every op three times: every result equals its reference.
    Under the interpreter the launcher serialises launches (the interpreter is not
    thread-safe); on a GPU each thread launches on its own."""
    ops = _mixed_ops(device)
    errors = []

    def work(seed):
        try:
            for _ in range(3):
                for name, fn, ref, tol in ops[seed % 4:] + ops[:seed % 4]:
                    out = fn()
                    if tol == 0.0:
                        ok = torch.equal(out.cpu(), ref.cpu())
                    else:
                        ok = torch.isfinite(out).all() and (out.double() - ref).norm() <= tol * ref.norm()
                    if not ok:
                        errors.append(name)
        except Exception as e:  # noqa: BLE001 - report it in the main thread
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# ---- autotuning switch and tables ----


def test_autotune_switch():
    before = launch.autotune_enabled()
    with onegemm.autotune():
        assert launch.autotune_enabled()
        with onegemm.autotune(False):
            assert not launch.autotune_enabled()
        assert launch.autotune_enabled()
    assert launch.autotune_enabled() == before
    with pytest.raises(TypeError, match="enabled must be a bool"):
        onegemm.autotune("yes")


def test_table_reader_ignores_a_broken_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"configs": {"matmul": {"k": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, '
                    '"num_warps": 4, "num_stages": 3}}}}')
    (config,) = tables.read(good)["matmul"].values()
    assert config.kwargs["BLOCK_M"] == 64 and config.num_warps == 4 and config.num_stages == 3
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the config table"):
        assert tables.read(broken) == {}
    assert tables.read(tmp_path / "missing.json") == {}


# The key type each family's entries are stored under (str(key) is the table's key).
KEY_TYPES = {
    "matmul": configs.MatmulKey, "blockscaled": blockscaled_configs.BlockscaledKey, "blockscaled_wgmma": hopper_configs.WgmmaKey,
    "ragged": grouped_configs.RaggedKey, "list": grouped_configs.ListKey, "quantize": blockscaled_configs.QuantKey,
    "quantize_pair": blockscaled_configs.QuantKey, "sort": grouped_configs.SortKey,
    "row_tiles": configs.PrepKey, "gather_quantize": configs.PrepKey, "combine": configs.PrepKey, "swiglu_backward": configs.PrepKey,
    "transpose": configs.PrepKey, "route": grouped_configs.RouteKey,
}
TUNED = Path(configs.__file__).parent / "tuned"  # shipped as package data (pyproject.toml)
H200_SMS = 132


def _parse_key(key_type, text):
    """The key whose str() is ``text``: its tokens are the fields in order, ``name=value`` (the
    name a prefix of the field's) or a bare value; trailing fields left out take their default."""
    tokens, fields = text.split(" "), key_type._fields
    assert len(tokens) <= len(fields), text
    values = []
    for token, field in zip(tokens, fields):
        name, _, value = token.rpartition("=")
        assert field.startswith(name), (text, token, field)
        kind = typing.get_type_hints(key_type)[field]
        if field == "scaling":
            values.append(Scaling.parse(value))
        elif kind is Granularity:
            values.append(Granularity.parse(value))
        else:
            values.append(bool(int(value)) if kind is bool else int(value) if kind is int else "" if value == "-" else value)
    return key_type(*values)


def test_key_types_cover_every_family():
    assert set(KEY_TYPES) == set(configs.FAMILIES)
    key = grouped_configs.RaggedKey("bf16", "", 16, 64, 32, True, False, 2, True, False)
    assert _parse_key(grouped_configs.RaggedKey, str(key)) == key
    with pytest.raises(AssertionError):
        _parse_key(configs.MatmulKey, str(blockscaled_configs.BlockscaledKey(16, 64, 32, True, False, 2, BLOCKWISE)))


def test_the_h200_table_ships():
    table = json.loads((TUNED / "NVIDIA_H200.json").read_text())
    assert table["gpu"] == "NVIDIA H200"
    assert len(table["configs"]["matmul"]) > 100 and len(table["configs"]["blockscaled"]) > 20


@pytest.mark.parametrize("path", sorted(TUNED.glob("*.json")), ids=lambda p: p.name)
def test_shipped_table_entries_round_trip_through_their_family(path):
    """Every entry of every family: the key parses back to the family's key type (and prints
    as stored), the config reads back to the same JSON, and it is one of the candidates its
    family offers for that key, so the autotuner could have picked it."""
    table = json.loads(path.read_text())["configs"]
    for family, entries in table.items():
        assert family in configs.FAMILIES, (path.name, family)
        policy = configs.FAMILIES[family]
        for text, raw in entries.items():
            key = _parse_key(KEY_TYPES[family], text)
            assert str(key) == text, (family, text)
            config = configs.from_json(raw)
            assert configs.to_json(config) == raw, (family, text)
            candidates = {configs.config_id(c) for c in policy.candidates(key, H200_SMS)}
            assert configs.config_id(config) in candidates, (family, text, configs.label(config))
            policy.heuristic(key, H200_SMS)  # the heuristic takes the key too


@pytest.mark.gpu
def test_gpu_autotune_writes_the_cache_and_later_calls_read_it(tmp_path, monkeypatch, device):
    """With autotuning on, a key no table holds is timed (GPU time) and its winner stored in
    the user's cache file; after reloading the tables the same key comes from the table, and
    with autotuning off a new key gets the heuristic's config at once."""
    monkeypatch.setenv("ONEGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_TUNE_REP_MS", 2)
    launch.reload_tables()
    M, N, K = 97, 208, 336  # no shipped table holds this
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=device, dtype=torch.bfloat16).t()
    try:
        with onegemm.autotune():
            out = onegemm.matmul(a, b)
        (plan,) = [p for p in _plans().values()]
        assert plan.source == "tuned"
        assert_close(out, matmul_ref(a, b), TOL[torch.bfloat16])
        files = list(tmp_path.glob("*.json"))
        assert len(files) == 1 and "m=128 n=208 k=336" in files[0].read_text()
        launch.reload_tables()
        onegemm.matmul(a, b)
        (again,) = _plans().values()
        assert again.source == "table" and again.config.kwargs == plan.config.kwargs
        onegemm.matmul(torch.randn(5, K, device=device, dtype=torch.bfloat16), b)
        assert {p.source for p in _plans().values()} == {"table", "heuristic"}
    finally:
        launch.reload_tables()


@pytest.mark.gpu
def test_gpu_plan_keeps_one_kernel_per_alignment(fresh_plans, device):
    """The same key with a 16-byte aligned and a misaligned operand: one plan, two compiled
    kernels (Triton specialises on alignment), both right."""
    w = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    big = torch.randn(40 * 256 + 8, device=device, dtype=torch.bfloat16)
    aligned = big[: 40 * 256].view(40, 256)
    shifted = big[1 : 1 + 40 * 256].view(40, 256)
    for a in (aligned, shifted, aligned):
        assert_close(onegemm.matmul(a, w.t(), tma=False), matmul_ref(a, w.t()), TOL[torch.bfloat16])
    (plan,) = _plans().values()
    assert len(plan.kernels) == 2


def _generated_cases(device):
    """(name, make inputs, onegemm call, float64 reference) of ops whose records launch
    through generated launchers; each call gets fresh inputs of one signature."""
    bf16 = torch.bfloat16

    def dense():
        return torch.randn(37, 256, device=device, dtype=bf16), torch.randn(300, 256, device=device, dtype=bf16).t()

    def linear():
        return (torch.randn(2, 17, 256, device=device, dtype=bf16), torch.randn(127, 256, device=device, dtype=bf16),
                torch.randn(127, device=device, dtype=bf16))

    def grouped():
        return (torch.randn(90, 64, device=device, dtype=bf16), torch.randn(3, 64, 48, device=device, dtype=bf16),
                torch.tensor([17, 17, 90], dtype=torch.int32, device=device))

    def scaled():
        qa, sa = quantize_fp8_ref(torch.randn(24, 256, device=device), (1, 128))
        qb, sb = quantize_fp8_ref(torch.randn(40, 256, device=device), (128, 128))
        return qa, qb.t(), sa, sb.t()

    def moe():
        E, T, H, I, k = 6, 17, 64, 96, 2
        weights, ids = torch.randn(T, E, device=device).softmax(-1).topk(k)
        return (torch.randn(T, H, device=device, dtype=bf16), torch.randn(E, 2 * I, H, device=device, dtype=bf16) / 8,
                torch.randn(E, H, I, device=device, dtype=bf16) / 8, weights, ids)

    def fp8_linear():  # a fresh layer each call: its weight's address changes too
        layer = onegemm.Fp8Linear(256, 136, device=device, dtype=bf16)
        return torch.randn(33, 256, device=device, dtype=bf16), layer

    def fp8_linear_ref(x, layer):
        qx, sx = quantize_fp8_ref(x.float(), (1, 128))
        return blockscaled_matmul_ref(qx, layer.weight.t(), sx, layer.weight_scale.t(), (1, 128), (128, 128),
                                      layer.bias.float())

    def moe_fp8():
        x, w_gate_up, w_down, weights, ids = moe()
        q_gu, s_gu, q_dn, s_dn = onegemm.quantize_experts(w_gate_up, w_down)
        return x, q_gu, q_dn, weights, ids, s_gu, s_dn

    return [
        ("matmul", dense, lambda a, b: onegemm.matmul(a, b, activation="gelu"), lambda a, b: matmul_ref(a, b, None, "gelu")),
        ("persistent_matmul", dense, lambda a, b: onegemm.persistent_matmul(a, b), matmul_ref),
        ("linear", linear, onegemm.linear, lambda x, w, bias: matmul_ref(x.reshape(-1, 256), w.t(), bias).reshape(2, 17, 127)),
        ("grouped_matmul", grouped, onegemm.grouped_matmul, grouped_mm_ref),
        ("blockscaled_matmul", scaled, onegemm.blockscaled_matmul,
         lambda qa, qb, sa, sb: blockscaled_matmul_ref(qa, qb, sa, sb, (1, 128), (128, 128))),
        ("quantize_fp8", lambda: (torch.randn(33, 384, device=device, dtype=bf16),), lambda x: onegemm.quantize_fp8(x)[0],
         lambda x: quantize_fp8_ref(x, (1, 128))[0]),
        ("moe_ffn", moe, onegemm.moe_ffn, moe_ref),
        ("Fp8Linear", fp8_linear, lambda x, layer: layer(x), fp8_linear_ref),
        ("moe_ffn fp8", moe_fp8, lambda x, a, b, w, i, sa, sb: onegemm.moe_ffn(x, a, b, w, i, w_gate_up_scale=sa, w_down_scale=sb),
         moe_fp8_ref),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(9), ids=["matmul", "persistent_matmul", "linear", "grouped_matmul",
                                                 "blockscaled_matmul", "quantize_fp8", "moe_ffn", "Fp8Linear",
                                                 "moe_ffn fp8"])
def test_gpu_records_launch_through_generated_launchers(case, fresh_plans, device, monkeypatch):
    """Five calls of one signature on fresh inputs: from the third on the record's launches go
    through their generated launchers, and every result matches the float64 reference (a
    launcher that kept the second call's pointers would return that call's values). Inside
    launch.recording() the same call is seen launching."""
    from onegemm.core.dispatch import Launch, _first, _never, _second

    name, make, call, ref = _generated_cases(device)[case]
    made = []
    original = Launch.__call__

    def watched(self, *tensors):
        original(self, *tensors)
        made.append(self._fast)

    with monkeypatch.context() as patch:
        patch.setattr(Launch, "__call__", watched)
        for _ in range(5):
            inputs = make()
            out = call(*inputs)
            want = ref(*inputs)
            if out.dtype == torch.float8_e4m3fn:
                assert torch.equal(out.float(), want.float()), name
            else:
                assert_close(out, want, 2e-2, name)
    assert made and all(f not in (_first, _second, _never) for f in made[-2:]), name
    with launch.recording() as seen:
        call(*make())
    assert seen, name


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_with_split_k_and_quantize(device):
    """Capture a split-K matmul, quantize_fp8 and Fp8Linear in one CUDA graph; replays on new
    inputs give the right results (no host sync, scratch from the graph's pool)."""
    a = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(1024, 4096, device=device, dtype=torch.bfloat16)
    lin = onegemm.Fp8Linear.from_linear(torch.nn.Linear(4096, 256, device=device, dtype=torch.bfloat16))
    split = cfg(64, 64, 64, 4, 3, SPLIT_K=4)
    outs = {}

    def step():
        outs["mm"] = onegemm.matmul(a, w.t(), config=split)
        outs["q"] = onegemm.quantize_fp8(a, (1, 128))
        outs["lin"] = lin(a)

    step()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(outs["mm"], matmul_ref(a, w.t()), TOL[torch.bfloat16])
        q_ref, s_ref = quantize_fp8_ref(a, (1, 128))
        assert torch.equal(outs["q"][1], s_ref)
        qa, sa = quantize_fp8_ref(a, (1, 128))
        ref = blockscaled_matmul_ref(qa, lin.weight.t(), sa, lin.weight_scale.t(), (1, 128), (128, 128)) + lin.bias.double()
        assert_close(outs["lin"], ref, TOL[torch.bfloat16])


# ---- Triton's internals in one place: the public launch on any other Triton ----


def test_triton_version_check():
    """Only the Triton release core/triton_abi.py was written for takes the direct launch."""
    assert triton_abi._version("3.6.0") == triton_abi.SUPPORTED
    assert triton_abi._version("3.7.0+git1a2b") != triton_abi.SUPPORTED
    assert triton_abi._version("4.0") != triton_abi.SUPPORTED
    if onegemm.INTERPRET:
        assert not triton_abi.NATIVE  # the interpreter always launches through Triton's public path


def _fallback_calls(device):
    a, b = torch.randn(37, 48, device=device), torch.randn(48, 29, device=device)
    ga, gb = torch.randn(14, 32, device=device), torch.randn(3, 32, 24, device=device)
    offs = torch.tensor([5, 5, 14], dtype=torch.int32, device=device)
    qa, sa = quantize_fp8_ref(torch.randn(24, 256, device=device), (1, 128))
    qb, sb = quantize_fp8_ref(torch.randn(40, 256, device=device), (128, 128))
    return [
        lambda: onegemm.matmul(a, b, activation="relu"),
        lambda: onegemm.grouped_matmul(ga, gb, offs),
        lambda: onegemm.blockscaled_matmul(qa, qb.t(), sa, sb.t()),
    ]


def test_public_launch_fallback_gives_the_same_results(fresh_plans, monkeypatch, device):
    """With triton_abi.NATIVE off (what any other Triton version gets) every launch takes
    Triton's public kernel[grid](...) path, with the same results bit for bit."""
    calls = _fallback_calls(device)
    want = [fn() for fn in calls]
    public = []
    original = launch.Launcher._public_launch
    monkeypatch.setattr(triton_abi, "NATIVE", False)
    monkeypatch.setattr(launch.Launcher, "_public_launch", lambda self, *a: (public.append(1), original(self, *a)))
    launch.clear_plans()
    got = [fn() for fn in calls]
    assert len(public) == len(calls)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
