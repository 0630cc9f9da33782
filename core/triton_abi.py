"""What onegemm takes from Triton's internals, in one place, for Triton 3.6.

The launcher (core/launch.py) starts compiled kernels without Triton's Python launch path. That
relies on pieces of Triton 3.6 that are not its public API:

- the specialisation rule (``INT_RULE``, ``PTR_RULE``): what a compiled kernel depends on in
  its runtime arguments, so a plan keeps one compiled kernel per specialisation it meets;
- ``JITFunction.run(..., warmup=...)``, which compiles (and launches) for given arguments and
  returns the compiled kernel;
- the compiled kernel's C launcher: ``kernel.run.launch``'s positional arguments and
  ``kernel.run(...)``'s (``direct``, and the launchers ``fast_launcher`` generates for a
  record's repeat calls);
- ``triton.runtime._allocation._allocator``, the ContextVar behind ``triton.set_allocator``
  (``ensure_allocator``), and ``AsyncCompileMode`` for autotuning's parallel compile.

``NATIVE`` says whether they are used: on a GPU with Triton 3.6. On any other Triton version
(and under the interpreter) every launch goes through the public ``kernel[grid](*args,
**constexprs)`` instead: a new Triton release costs host time, never correctness.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import triton
from triton import knobs

from . import scratch
from .runtime import INTERPRET

SUPPORTED = (3, 6)  # the Triton release whose internals this module reads


def _version(text: str) -> tuple:
    parts = []
    for p in text.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# Whether launches take the direct path (module docstring); tests switch it off to check the
# public path gives the same results.
NATIVE: bool = not INTERPRET and _version(triton.__version__) == SUPPORTED


# ---------------------------------------------------------------------------- specialisation

# Triton 3.6 compiles a kernel for, per int argument: whether it is 1, a multiple of 16 and
# within int32; per pointer: whether it is 16-byte aligned (and its dtype); None arguments;
# tuples element by element. The rule once, as expression text, for the generated preparers
# and for the loop below (tests/test_launch.py checks it against Triton's own).
INT_RULE = "(-1 if {x} == 1 else ({x} & 15 == 0) + (0 if -2147483648 <= {x} <= 2147483647 else 2))"
PTR_RULE = "({p} & 15 == 0)"
int_class = eval(f"lambda x: {INT_RULE.format(x='x')}")  # noqa: S307 - the constant above


def prepare(args) -> tuple:
    """(``spec(args)``, args with each tensor replaced by its data pointer) in one pass:
    Triton's C launcher takes an int as a pointer as it is, where for a tensor it calls
    data_ptr() and asks the driver about the address (the ops have checked the devices).
    Tuples (the tile body's NamedTuples) are prepared element by element, as Triton
    specialises them; bools and floats by their type only."""
    spec, raw = [], []
    for x in args:
        if x.__class__ is int:
            spec.append(int_class(x))
            raw.append(x)
        elif x is None:
            spec.append(None)
            raw.append(None)
        elif isinstance(x, torch.Tensor):
            p = x.data_ptr()
            spec.append((x.dtype, p & 15 == 0))
            raw.append(p)
        elif isinstance(x, tuple):
            s, r = prepare(x)
            spec.append(s)
            raw.append(r)
        else:
            spec.append(x.__class__)
            raw.append(x)
    return tuple(spec), tuple(raw)


def spec(args) -> tuple:
    """What Triton's compiled kernel depends on in the runtime arguments (``prepare``)."""
    return prepare(args)[0]


def kinds(args) -> tuple | None:
    """Each argument's kind for a generated preparer ('T' tensor, 'I' int, 'N' None, a tuple
    of kinds for a tuple), or None when an argument is of another kind (a float): those take
    ``prepare``."""
    out = []
    for x in args:
        if x.__class__ is int:
            out.append("I")
        elif x is None:
            out.append("N")
        elif isinstance(x, torch.Tensor):
            out.append("T")
        elif isinstance(x, tuple):
            inner = kinds(x)
            if inner is None:
                return None
            out.append(inner)
        else:
            return None
    return tuple(out)


_PREPARERS: dict = {}


def _tuple_src(items: list) -> str:
    return f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _prepare_src(kinds: tuple, names: list, unpack: list, guard: list, ptrs: list) -> tuple[list, list]:
    """The spec and raw expressions of arguments ``names`` of ``kinds``, with the statements
    they need: tuple unpacking (a tuple of another length raises ValueError), kind guards and
    data_ptr() reads."""
    spec, raw = [], []
    for name, kind in zip(names, kinds):
        if isinstance(kind, tuple):
            inner = [f"{name}_{i}" for i in range(len(kind))]
            unpack.append(f"    {', '.join(inner)}{',' if len(inner) == 1 else ''} = {name}")
            s, r = _prepare_src(kind, inner, unpack, guard, ptrs)
            spec.append(_tuple_src(s))
            raw.append(_tuple_src(r))
        elif kind == "T":
            ptrs.append(f"    p_{name} = {name}.data_ptr()")
            spec.append(f"({name}.dtype, {PTR_RULE.format(p=f'p_{name}')})")
            raw.append(f"p_{name}")
        elif kind == "I":
            guard.append(f"{name}.__class__ is not int")
            spec.append(INT_RULE.format(x=name))
            raw.append(name)
        else:
            guard.append(f"{name} is not None")
            spec.append("None")
            raw.append("None")
    return spec, raw


def preparer(kinds: tuple):
    """``prepare`` written out for one nesting of argument kinds (no loop, no appends): what
    a plan uses once its first launch has shown its arguments' kinds, which the plan's key
    fixes (which optional tensors are present is part of every op's key). An argument of
    another kind raises TypeError or ValueError, and the launch falls back to ``prepare``."""
    fn = _PREPARERS.get(kinds)
    if fn is not None:
        return fn
    names = [f"a{i}" for i in range(len(kinds))]
    unpack, guard, ptrs = [f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args"], [], []
    spec, raw = _prepare_src(kinds, names, unpack, guard, ptrs)
    check = [f"    if {' or '.join(guard)}:", "        raise TypeError('argument kinds changed')"] if guard else []
    src = "\n".join(["def prepare(args):", *unpack, *check, *ptrs,
                     f"    return {_tuple_src(spec)}, {_tuple_src(raw)}"]) + "\n"
    namespace: dict = {}
    exec(src, namespace)  # noqa: S102 - code generated from the kinds above, nothing else
    fn = _PREPARERS[kinds] = namespace["prepare"]
    return fn


# ---------------------------------------------------------------------------- compiling


def compile_and_launch(fn, grid, args, constexprs: dict, warmup: bool = False):
    """Triton's own launch of ``fn`` (compiling what its cache lacks); returns the compiled
    kernel. ``warmup``: compile only (autotuning's parallel compile)."""
    ensure_allocator()  # Triton's own launch allocates TMA scratch through it
    return fn.run(*args, grid=grid, warmup=warmup, **constexprs)


def async_compile(pool):
    """Triton 3.6's context in which compiles run on ``pool`` (autotuning's parallel compile)."""
    from triton.runtime._async_compile import AsyncCompileMode

    return AsyncCompileMode(pool, ignore_errors=True)


class Compiled(NamedTuple):
    """A compiled kernel and what its launch needs, read once: Triton's launcher (``run``),
    its C entry point (``raw``, None where the kernel needs profiler scratch), and the bytes
    of global scratch memory per program (TMA descriptors), which the launch supplies."""

    kernel: object
    run: object
    function: int
    packed: object
    raw: object
    scratch: int


def compiled(kernel) -> Compiled:
    run = kernel.run
    raw = None
    if (getattr(run, "profile_scratch_size", 1) == 0 and hasattr(run, "launch_cooperative_grid")
            and hasattr(run, "launch_pdl") and hasattr(run, "global_scratch_size")):
        raw = run.launch
    size = getattr(run, "global_scratch_size", 0) * getattr(run, "num_ctas", 1)
    return Compiled(kernel, run, kernel.function, kernel.packed_metadata, raw, size)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook would do anything (3.6 keeps an empty HookChain)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct(c: Compiled, grid, args, tail, device) -> None:
    """Start a compiled kernel through Triton's C launcher (what JITFunction.run ends with);
    ``args`` are the runtime arguments as ``prepare`` returns them (pointers as ints), ``tail``
    the constexprs in parameter order.

    Launch hooks (a profiler's) get their metadata; with none registered none is built. A
    kernel that builds TMA descriptors gets its global scratch from core/scratch.py's cache
    instead of an allocation per launch.
    """
    stream = torch._C._cuda_getCurrentRawStream(device)
    full = args + tail
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if c.raw is None or _hooked(enter) or _hooked(leave):
        ensure_allocator()
        metadata = c.kernel.launch_metadata(grid, stream, *full)
        c.run(grid[0], g1, g2, stream, c.function, c.packed, metadata, enter, leave, *full)
        return
    global_scratch = None
    if c.scratch:
        global_scratch = scratch.get(_DEVICES[device], "tma_descriptors", grid[0] * g1 * g2 * c.scratch, torch.int8).data_ptr()
    c.raw(grid[0], g1, g2, stream, c.function, c.run.launch_cooperative_grid, c.run.launch_pdl, global_scratch, None,
          c.packed, None, None, None, *full)


# ---------------------------------------------------------------------------- generated launchers

# recording() blocks in progress (core/launch.py): while above 0, generated launchers step
# aside so that every launch goes through Launcher.launch, where recording sees it.
PAUSED = 0


class _NotConstant(Exception):
    pass


def _raw_src(x, sources: tuple, used: dict, consts: dict) -> str:
    """The expression of one argument of ``prepare``'s raw tuple for a generated launcher: a
    source tensor's data pointer (``p<i>``), a constant, or a tuple of these."""
    if isinstance(x, torch.Tensor):
        i, offset = _source_of(x, sources)
        used[i] = f"p{i}"
        return used[i] if offset == 0 else f"(p{i} + {offset})"
    if isinstance(x, tuple):
        return _tuple_src([_raw_src(y, sources, used, consts) for y in x])
    if x is None or x.__class__ in (int, bool):
        return repr(x)
    if x.__class__ is float:
        name = f"k{len(consts)}"
        consts[name] = x
        return name
    raise _NotConstant


def _source_of(t: torch.Tensor, sources: tuple) -> tuple[int, int]:
    """(i, offset): ``t`` is source i (offset 0), or a view of the one source that shares its
    storage, ``offset`` bytes past that source's address: a transpose of it, or a part of a
    record's workspace (core/dispatch.py Workspace). The launch's builder makes such views
    from the sources' shapes and strides alone, so the offset is the same whatever the call's
    tensors. A tensor made for this launch (split-K's scratch, a copy: its storage is its
    own), one whose storage two sources share, or an offset that would change the pointer's
    16-byte alignment raises _NotConstant."""
    for i, s in enumerate(sources):
        if t is s:
            return i, 0
    storage = t.untyped_storage().data_ptr()
    hits = [i for i, s in enumerate(sources) if isinstance(s, torch.Tensor) and s.untyped_storage().data_ptr() == storage]
    if len(hits) != 1:
        raise _NotConstant
    offset = t.data_ptr() - sources[hits[0]].data_ptr()
    if offset & 15:
        raise _NotConstant
    return hits[0], offset


def fast_launcher(c: Compiled, grid: tuple, args: tuple, sources: tuple, tail: tuple, device: int):
    """A generated ``launch(*sources) -> bool`` that starts ``c`` on ``grid`` with the
    arguments ``args`` was built from, each tensor in them read from the source in its place:
    what a record (core/dispatch.py) launches again for a call of the same signature, without
    building the arguments, preparing them or looking the kernel up.

    That is the same launch because everything but the tensors' addresses is fixed by the
    signature: ``args``' ints and Nones come from shapes, strides and options, and the kernel's
    specialisation (``prepare``'s spec) from them, the dtypes and each pointer's 16-byte
    alignment. A call whose pointer is not 16-byte aligned, on another current device, with a
    launch hook registered, while ``PAUSED`` or with NATIVE off returns False and launches
    nothing: the caller takes the full launch; so does one whose source that is not a tensor
    (None, a tuple of constants) is not the same object as before. None when ``args`` hold a
    tensor that is neither a source nor a view of one (``_source_of``: made per launch, its
    address is not fixed), a value of another kind, or an unaligned pointer, and when ``c`` needs
    profiler scratch (no C entry of its own)."""
    if c.raw is None:
        return None
    used, consts = {}, {}
    try:
        raw = [_raw_src(x, sources, used, consts) for x in args]
    except _NotConstant:
        return None
    if any(sources[i].data_ptr() & 15 for i in used):
        return None
    names = [f"s{i}" for i in range(len(sources))]
    ptrs = [f"    p{i} = s{i}.data_ptr()" for i in sorted(used)]
    others = [i for i, x in enumerate(sources) if not isinstance(x, torch.Tensor)]
    consts.update({f"S{i}": sources[i] for i in others})
    aligned = f"({' | '.join(used[i] for i in sorted(used))}) & 15 or " if used else ""
    aligned += "".join(f"s{i} is not S{i} or " for i in others)
    g = (tuple(grid) + (1, 1))[:3]
    scratch_src = "_scratch()" if c.scratch else "None"
    src = "\n".join([
        f"def launch({', '.join(names)}):",
        *ptrs,
        f"    if {aligned}_current() != DEVICE or _abi.PAUSED or not _abi.NATIVE or _hooked():",
        "        return False",
        f"    _raw({g[0]}, {g[1]}, {g[2]}, _stream(DEVICE), FUNCTION, COOP, PDL, {scratch_src}, None, PACKED, None, None, None, "
        f"{', '.join(raw)}{', ' if raw else ''}*TAIL)",
        "    return True",
    ]) + "\n"
    size = g[0] * g[1] * g[2] * c.scratch
    namespace = dict(
        consts, _abi=sys.modules[__name__], _current=torch._C._cuda_getDevice, _stream=torch._C._cuda_getCurrentRawStream,
        _hooked=_hooks_registered, _raw=c.raw, DEVICE=device, FUNCTION=c.function, COOP=c.run.launch_cooperative_grid,
        PDL=c.run.launch_pdl, PACKED=c.packed, TAIL=tuple(tail),
        _scratch=lambda: scratch.get(_DEVICES[device], "tma_descriptors", size, torch.int8).data_ptr())
    exec(src, namespace)  # noqa: S102 - code generated from the arguments' structure above, nothing else
    return namespace["launch"]


def _hooks_registered() -> bool:
    return _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)


class _DeviceCache(dict):
    def __missing__(self, index):
        self[index] = torch.device("cuda", index)
        return self[index]


_DEVICES = _DeviceCache()


# ---------------------------------------------------------------------------- the allocator


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:
    # Descriptors are 128-byte records the kernel writes and the TMA unit reads; torch's
    # caching allocator returns 256-byte aligned blocks, above any alignment Triton asks for.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give this thread (this context) the scratch allocator in-kernel descriptors need.

    ``triton.set_allocator`` stores the allocator in a ContextVar: it is per thread, and a new
    ``threading.Thread`` starts without one ("Kernel requires a runtime memory allocation").
    An allocator the user set is kept; only the missing one is filled in. On a Triton without
    that ContextVar the allocator is set once per call, as the public API allows.
    """
    if INTERPRET:
        return  # the interpreter builds descriptors in Python, with no scratch memory
    try:
        from triton.runtime import _allocation

        missing = isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):
        missing = True
    if missing:
        triton.set_allocator(_alloc)
