"""The one launch path: every kernel launch in onegemm goes through a ``Launcher``.

An op's full path (core/dispatch.py) checks its inputs and builds a ``Request``: the family's
key (dtypes, the M bucket, N, K, the layout class), the call's constexprs, the device and a
forced config. The launcher keeps one *plan* per request (``plan_key``): the config chosen
for it (core/configs.py: forced, tuned table, opt-in autotuning or the heuristic), the
kernel's constexprs, and the compiled kernels by argument specialisation. A launch builds the
argument tuple and starts the compiled kernel through Triton's C launcher, skipping Triton's
Python launch path (argument binding, cache-key hashing, the autotuner); nothing on that path
scans configs, queries the device or allocates scratch memory. A record's repeat launches skip
even that: ``Launcher.fast`` generates a launcher for their arguments (core/dispatch.py Launch,
triton_abi.fast_launcher).

Specialisation: Triton compiles a kernel for the divisibility by 16 of its integer arguments
and pointers, integers equal to 1 and None arguments (core/triton_abi.py states the rule;
tests/test_launch.py checks it against Triton's own). A plan holds one compiled kernel per
specialisation it has met, so a call with other strides or alignment never reuses a kernel
compiled for different ones. On a Triton other than the one triton_abi.py knows, launches go
through Triton's public ``kernel[grid](...)`` instead.

Under Triton's interpreter there is nothing to compile: a launch runs the kernel in Python,
with one lock for the whole process (the interpreter patches global state and is not safe to
run from two threads at once).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch
import triton

from . import checks, configs, runtime, scratch, tables
from .runtime import INTERPRET, sm_count
from . import triton_abi
from .triton_abi import async_compile, compile_and_launch, compiled, direct, preparer

_INTERPRET_LOCK = threading.Lock()
_MAX_PREPARERS = 4  # argument nestings a plan keeps a generated preparer for; others take triton_abi.prepare


# ---------------------------------------------------------------------------- plans


class Request(NamedTuple):
    """What a plan is built from (``Launcher.plan_for``); an op on a per-call path passes a
    callable that makes one, built only when its key has no plan yet.

    key: the family's key (core/configs.py): what the config choice depends on.
    constexprs: the call's kernel constexprs that are not a config's (activation, layout flags).
    device: where the call runs. forced: a config the caller forced, or None.
    trial: ``trial(plan)`` launches the call once with ``plan``: autotuning times it.
    """

    key: tuple
    constexprs: dict
    device: torch.device
    forced: triton.Config | None = None
    trial: Callable | None = None


def kernel_params(fn) -> list:
    """A kernel's parameters as Triton describes them (name, is_constexpr, default), also for
    the interpreter's InterpretedFunction, which does not keep them."""
    if hasattr(fn, "params"):
        return fn.params
    from triton.runtime.jit import KernelParam

    return [KernelParam(i, p, False, False) for i, p in enumerate(inspect.signature(fn.fn).parameters.values())]


def plan_key(req: Request) -> tuple:
    """What ``Launcher._make_plan`` reads from a request, as a key: a plan made from one
    request serves every request with the same key."""
    forced = None if req.forced is None else configs.config_id(req.forced)
    return (req.key, tuple(req.constexprs.items()), req.device, forced)


class Plan:
    """A key's chosen config, its constexprs and the kernels compiled for it.

    config: the triton.Config; ``source``: where it came from ("forced", "table", "tuned",
    "heuristic" or "interpreter").
    meta: every constexpr the kernel takes, by name (the call's, overridden by the config's):
    what grids read. tail: their values in parameter order.
    """

    __slots__ = ("config", "source", "meta", "tail", "options", "kernels", "device_index", "preparers")

    def __init__(self, params, config: triton.Config, constexprs: dict, device: torch.device, source: str):
        self.config = config
        self.source = source
        meta = {**constexprs, **config.kwargs}
        unknown = set(meta) - {p.name for p in params if p.is_constexpr}
        if unknown:
            raise TypeError(f"the kernel has no constexpr {sorted(unknown)} (config {config})")
        for p in params:
            if p.is_constexpr and p.name not in meta:
                if p.default is inspect.Parameter.empty:
                    raise TypeError(f"no value for the kernel's constexpr {p.name}")
                meta[p.name] = p.default
        self.meta = meta
        self.tail = tuple(meta[p.name] for p in params if p.is_constexpr)
        self.options = {k: v for k, v in config.all_kwargs().items() if k not in config.kwargs}
        self.kernels = {}
        self.device_index = device.index if device.type == "cuda" else None
        # One generated preparer per argument nesting met (triton_abi.preparer): a plan can serve
        # calls with and without an optional tensor (matmul's bias), whose arguments nest apart.
        self.preparers = ()


class Launcher:
    """One ``@triton.jit`` kernel and its family's tuning policy (core/configs.py FAMILIES by
    name, where each package registers its own families).

    The kernel takes its runtime arguments first and its constexprs last (checked here): a
    launch passes ``args`` (the runtime arguments, in order) and the plan supplies the rest.
    """

    def __init__(self, fn, family: str | configs.Family):
        self.fn = fn
        self.family = family = configs.FAMILIES[family] if isinstance(family, str) else family
        self.params = kernel_params(fn)
        flags = [p.is_constexpr for p in self.params]
        if flags != sorted(flags):
            raise TypeError(f"{family.name}: the kernel's constexpr parameters must come after the runtime ones")
        self.num_args = flags.count(False)
        self._plans: dict = {}
        self._variants: dict = {}  # (plan, changed kwargs) -> Plan (``variant``)
        self._lock = threading.RLock()
        _LAUNCHERS[family.name] = self

    # -- plans --

    def plan_for(self, req: Request | Callable[[], Request], key: tuple | None = None) -> Plan:
        """The plan for a request, made from it the first time its key is met: the one way to a
        plan.

        key: by default ``plan_key(req)``, everything a plan is made from (the family key, the
        constexprs, the device and the forced config). A call site that looks its plan up on
        every call, outside the eager path's records (core/dispatch.py: a record keeps its
        plans), passes a key of its own instead: a tuple of values it has at hand that
        determines the request. ``req`` may then be a callable that returns the Request, called
        only when the key has no plan yet, so a hit builds no Request, no constexpr dict and no
        ``plan_key`` (about 0.4 to 2.5 us a lookup under CPython 3.11). Such sites pass the key
        positionally: a keyword argument costs each call some 15 ns more."""
        if key is None:
            key = plan_key(req)
        plan = self._plans.get(key)
        if plan is None:  # no closure here: one would cost every hit its cells
            plan = self._once(self._plans, key, self._make_plan, req)
        return plan

    def variant(self, plan: Plan, **kwargs) -> Plan:
        """``plan`` with these config kwargs changed (same constexprs, device and source), made
        once per plan and change: a launch whose shape makes an option pointless runs without
        it (core/matmul.py: stream-K with no tile to share)."""
        key = (plan, tuple(sorted(kwargs.items())))
        found = self._variants.get(key)
        if found is None:
            device = torch.device("cpu") if plan.device_index is None else torch.device("cuda", plan.device_index)
            found = self._once(self._variants, key, Plan, self.params, configs.with_meta(plan.config, **kwargs),
                               plan.meta, device, plan.source)
        return found

    def _once(self, table: dict, key, make: Callable, *args):
        """``table[key]``, made by ``make(*args)`` under the launcher's lock unless another
        thread made it first: the slow half of a lookup whose lock-free ``table.get(key)``
        missed (plan_for, variant)."""
        with self._lock:
            found = table.get(key)
            if found is None:
                found = table[key] = make(*args)
            return found

    def _make_plan(self, req: Request | Callable[[], Request]) -> Plan:
        if callable(req):  # plan_for's lazy request
            req = req()
        if req.forced is not None:
            return Plan(self.params, req.forced, req.constexprs, req.device, "forced")
        if INTERPRET:
            config = self.family.interpret
            config = config(req.key) if callable(config) else config
            return Plan(self.params, config, req.constexprs, req.device, "interpreter")
        config = tables.tuned_config(self.family.name, req.key, req.device)
        if config is not None:
            return Plan(self.params, config, req.constexprs, req.device, "table")
        if autotune_enabled() and req.trial is not None:
            return self._tune(req)
        config = self.family.heuristic(req.key, sm_count(req.device.index))
        return Plan(self.params, config, req.constexprs, req.device, "heuristic")

    # -- launching --

    def launch(self, plan: Plan, grid: tuple, args: tuple) -> None:
        """Run the kernel on ``grid`` with ``args`` (runtime arguments) and ``plan``."""
        if not triton_abi.NATIVE:
            self._public_launch(plan, grid, args)
            return
        spec, raw = _prepared(plan, args)
        kernel = plan.kernels.get(spec)
        device = plan.device_index
        if kernel is None or torch._C._cuda_getDevice() != device:
            with torch.cuda.device(device):
                if kernel is None:
                    self._first_launch(plan, spec, grid, args)
                else:
                    direct(kernel, grid, raw, plan.tail, device)
            return
        direct(kernel, grid, raw, plan.tail, device)

    def fast(self, plan: Plan, grid: tuple, args: tuple, sources: tuple):
        """A generated launcher of ``plan``'s kernel for arguments built like ``args`` from
        ``sources`` (triton_abi.fast_launcher), or None: off the direct path, before the kernel
        is compiled, or for arguments it cannot take."""
        if not triton_abi.NATIVE or _WARMUP.on:
            return None
        kernel = plan.kernels.get(_prepared(plan, args)[0])
        if kernel is None:
            return None
        return triton_abi.fast_launcher(kernel, grid, args, sources, plan.tail, plan.device_index)

    def _public_launch(self, plan: Plan, grid: tuple, args: tuple) -> None:
        """Triton's public ``kernel[grid](...)`` launch: under the interpreter (one launch at a
        time in the process), and on a GPU with a Triton whose internals core/triton_abi.py
        does not know."""
        if INTERPRET:
            with _INTERPRET_LOCK:
                self.fn[grid](*args, **plan.meta, **plan.options)
            return
        _join_prewarm()
        triton_abi.ensure_allocator()
        with torch.cuda.device(plan.device_index):
            self.fn[grid](*args, **plan.meta, **plan.options)

    def _first_launch(self, plan: Plan, spec: tuple, grid: tuple, args: tuple) -> None:
        if len(args) != self.num_args:
            raise TypeError(f"the {self.family.name} kernel takes {self.num_args} runtime arguments, got {len(args)}")
        _join_prewarm()
        constexprs = {**plan.meta, **plan.options}
        if _WARMUP.on:  # autotuning's parallel compile: compile only, launch nothing
            compile_and_launch(self.fn, grid, args, constexprs, warmup=True)
            return
        plan.kernels[spec] = compiled(compile_and_launch(self.fn, grid, args, constexprs))
        kinds = triton_abi.kinds(args)
        if kinds is not None and len(plan.preparers) < _MAX_PREPARERS:
            fn = preparer(kinds)
            if fn not in plan.preparers:
                plan.preparers += (fn,)

    # -- autotuning (opt-in) --

    def _tune(self, req: Request) -> Plan:
        """Time every candidate for ``req.key`` in GPU time, keep the fastest, store it."""
        plans = [Plan(self.params, c, req.constexprs, req.device, "tuned")
                 for c in self.family.candidates(req.key, sm_count(req.device.index))]
        # Compile every candidate first, in parallel threads (ptxas runs as a subprocess); on a
        # Triton core/triton_abi.py does not know, each compiles at its first timed launch.
        with ThreadPoolExecutor(max(1, min(16, (os.cpu_count() or 2) - 1))) as pool:
            with (async_compile(pool) if triton_abi.NATIVE else contextlib.nullcontext()):
                _WARMUP.on = True
                try:
                    for p in plans:
                        try:
                            req.trial(p)
                        except Exception:  # noqa: BLE001 - a candidate that cannot compile is skipped below
                            pass
                finally:
                    _WARMUP.on = False
        timed, errors = [], []
        for p in plans:
            try:
                timed.append((runtime.graph_bench(lambda p=p: req.trial(p), warmup=_TUNE_WARMUP_MS, rep=_TUNE_REP_MS), p))
            except Exception as e:  # noqa: BLE001 - out of shared memory and the like: not a candidate
                errors.append(f"{configs.label(p.config)}: {type(e).__name__}")
        if not timed:
            raise RuntimeError(f"{self.family.name}: no candidate config ran for {req.key}: {errors}")
        # The front runners again, timed longer: a few percent between candidates is within
        # one short timing's noise.
        finalists = [p for _, p in sorted(timed, key=lambda t: t[0])[:_FINALISTS]]
        best = min(finalists, key=lambda p: runtime.graph_bench(lambda: req.trial(p), warmup=_TUNE_WARMUP_MS,
                                                                rep=4 * _TUNE_REP_MS, return_mode="median"))
        tables.record(self.family.name, req.key, req.device, best.config)
        return best


def _prepared(plan: Plan, args: tuple) -> tuple:
    """(spec, raw) of ``args``: by one of the plan's generated preparers, else prepare's loop."""
    for prepare in plan.preparers:
        try:
            return prepare(args)
        except (TypeError, ValueError, AttributeError):  # arguments of another nesting
            pass
    return triton_abi.prepare(args)


class _Warmup(threading.local):
    on = False


_WARMUP = _Warmup()
_TUNE_WARMUP_MS, _TUNE_REP_MS, _FINALISTS = 5, 25, 3


_LAUNCHERS: dict[str, Launcher] = {}


def launchers() -> list[Launcher]:
    """Every launcher, one per kernel family (tools/ptx_snapshot.py compiles through them)."""
    return list(_LAUNCHERS.values())


def plans(family: str) -> dict:
    """The plans a family's launcher holds, by key (what tests and benchmarks inspect)."""
    return dict(_LAUNCHERS[family]._plans)


def clear_plans() -> None:
    """Forget every plan and the eager path's records, which hold plans (core/dispatch.py):
    after the tables or the autotune setting changed, or when a test changes a rule that
    the records' decisions were made under."""
    for launcher in _LAUNCHERS.values():
        with launcher._lock:
            launcher._plans.clear()
            launcher._variants.clear()
    for hook in _ON_CLEAR:
        hook()


def reset() -> None:
    """Forget everything onegemm caches, as a fresh process would start: the plans and records,
    the tables read from disk (read again at the next plan) and the scratch buffers (their
    memory given back)."""
    reload_tables()
    scratch.clear()


class Launched(NamedTuple):
    """One launch inside ``recording()``: the kernel family's name, the plan (its config,
    ``source`` and constexprs) and the grid."""

    family: str
    plan: Plan
    grid: tuple


@contextlib.contextmanager
def recording():
    """Record every kernel launch inside the block (tests and benchmarks ask what ran):

        with launch.recording() as launched:
            onegemm.matmul(a, b)
        (one,) = launched  # a Launched

    Each launcher's ``launch`` is wrapped for the block only, so calls outside it run the
    launch path unchanged. Blocks nest; one thread at a time should record."""
    seen: list[Launched] = []
    wrapped = []
    for name, launcher in _LAUNCHERS.items():
        inner = launcher.launch  # an outer recording's wrapper, or the method

        def launch(plan, grid, args, _name=name, _inner=inner):
            seen.append(Launched(_name, plan, grid))
            return _inner(plan, grid, args)

        wrapped.append((launcher, launcher.__dict__.get("launch")))
        launcher.launch = launch
    triton_abi.PAUSED += 1  # records' generated launchers bypass Launcher.launch: off meanwhile
    try:
        yield seen
    finally:
        triton_abi.PAUSED -= 1
        for launcher, previous in wrapped:
            if previous is None:
                del launcher.launch  # the class's method again
            else:
                launcher.launch = previous


_ON_CLEAR: list = []


def on_clear(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever plans are dropped (the eager path's records hold plans)."""
    _ON_CLEAR.append(hook)


# ---------------------------------------------------------------------------- prewarm


def _prewarm() -> None:
    # Before its first compile-cache lookup in a process Triton hashes its own sources and
    # shared library (triton.runtime.cache.triton_key) and imports gluon, once, whatever is
    # compiled: a fixed part of the first call (bench/results/overhead.md measures it).
    try:
        from triton.runtime.cache import triton_key

        triton_key()
        import triton.experimental.gluon  # noqa: F401
    except Exception:  # noqa: BLE001 - a head start only: the first launch does it otherwise
        pass


_prewarm_thread: threading.Thread | None = None


def start_prewarm() -> None:
    """Do Triton's once-per-process start-up work in a background thread (called at import on
    a GPU; ONEGEMM_PREWARM=0 turns it off): the first call then waits for its compile-cache
    lookup alone. hashlib releases the GIL while it hashes, so the thread hardly competes."""
    global _prewarm_thread
    if INTERPRET or os.environ.get("ONEGEMM_PREWARM", "1") == "0":
        return
    _prewarm_thread = threading.Thread(target=_prewarm, name="onegemm-prewarm", daemon=True)
    _prewarm_thread.start()


def _join_prewarm() -> None:
    # A first launch while the thread still hashes waits for it rather than hashing again
    # (triton_key's cache does not hold back a second caller).
    thread = _prewarm_thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join()


# ---------------------------------------------------------------------------- tuned tables (core/tables.py)


def reload_tables(shipped: bool = True) -> None:
    """Read the tables again (after bench/tune.py or another process wrote them) and forget the
    plans built from the old ones. ``shipped`` False: from now on read only the user's cache,
    not the table shipped for the GPU (bench/tune.py then tunes every key it holds too)."""
    tables.forget(shipped)
    clear_plans()


# ---------------------------------------------------------------------------- autotune switch

_autotune = os.environ.get("ONEGEMM_AUTOTUNE", "0").strip().lower() not in ("", "0", "false", "no")


def autotune_enabled() -> bool:
    return _autotune


class autotune:
    """Switch autotuning on (or off) for keys the tables do not hold.

    By default a call whose key has no tuned config runs the heuristic's config at once. With
    autotuning on, such a call times every candidate config in GPU time (CUDA-graph replays),
    keeps the fastest and writes it to the user's cache (``cache_dir()``), which later calls
    and later processes read. Keys already tuned are not timed again.

        onegemm.autotune()            # on from here (as ONEGEMM_AUTOTUNE=1 in the environment)
        with onegemm.autotune():      # on inside the block only
            model(x)

    Switching it on forgets the plans made without it, so each key's next call is tuned;
    switching it off keeps the tuned plans.
    """

    def __init__(self, enabled: bool = True):
        global _autotune
        checks.check_bool("enabled", enabled)
        self._previous = _autotune
        _autotune = enabled
        if enabled and not self._previous:
            clear_plans()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _autotune
        _autotune = self._previous
        return False
