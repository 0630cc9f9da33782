"""The TMA flavour of core's tile body (tensor-descriptor loads and stores) on both schedules,
against float64 torch.

The flavour runs under the interpreter too (it executes tensor descriptors), so the CPU tests
force it with tma=True; the automatic choice (tma=None) is pointer loads there.
"""

import threading

import pytest
import torch

import onegemm
from onegemm.core import tma as core_tma
from onegemm.core.configs import MATMUL_INTERPRET as INTERPRET_CONFIG
from onegemm.core.configs import cfg as _cfg
from onegemm.core.configs import warp_specialized, with_meta
from onegemm.testing import TOL, assert_close, matmul_ref

from helpers import DTYPES, FP8, make, tol_for

# Shapes whose row lengths are multiples of 16 bytes for every dtype (TMA-eligible whether an
# operand is row- or column-major), with partial tiles on every edge (32 x 32 x 32 here).
TMA_SHAPES = [(80, 48, 96), (16, 112, 48), (48, 64, 16)]
TMA_LAYOUTS = [("contig", "contig"), ("transposed", "contig"), ("contig", "transposed"), ("transposed", "transposed")]


@pytest.mark.parametrize("op", ["persistent", "matmul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout_a,layout_b", TMA_LAYOUTS)
def test_tma_flavour_layouts_and_dtypes(op, dtype, layout_a, layout_b, device):
    M, N, K = TMA_SHAPES[0]
    a = make((M, K), dtype, device, layout_a)
    b = make((K, N), dtype, device, layout_b)
    c_like = torch.empty(M, N, device=device, dtype=torch.bfloat16 if dtype in FP8 else dtype)
    layout = core_tma.tma_layout(a, b, c_like)
    assert layout == (layout_a == "contig", layout_b == "transposed")
    fn = onegemm.persistent_matmul if op == "persistent" else onegemm.matmul
    kwargs = dict(num_programs=3) if op == "persistent" else {}
    bias = torch.randn(N, device=device)
    out = fn(a, b, bias=bias, activation="gelu", tma=True, **kwargs)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), tol_for(dtype))


@pytest.mark.parametrize("M,N,K", TMA_SHAPES)
@pytest.mark.parametrize("num_programs", [1, 3, 10**6])
@pytest.mark.parametrize("split_k", [1, 3])
def test_tma_persistent_and_split_k(M, N, K, num_programs, split_k, device):
    """TMA loads and stores on the persistent walk, with and without split-K (the 1-3 K blocks
    of these shapes leave some of the 3 splits empty; the combine reads through pointers)."""
    a = make((M, K), torch.bfloat16, device)
    b = make((N, K), torch.bfloat16, device).t()
    bias = torch.randn(N, device=device, dtype=torch.bfloat16)
    if device == "cuda":
        cfg = _cfg(128, 128, 64, 8, 3)
    else:
        cfg = INTERPRET_CONFIG
    cfg = with_meta(cfg, SPLIT_K=split_k)
    out = onegemm.persistent_matmul(a, b, bias=bias, activation="gelu", num_programs=num_programs, config=cfg, tma=True)
    assert_close(out, matmul_ref(a, b, bias, "gelu"), TOL[torch.bfloat16])


# (views(v) -> (a, b), TMA-eligible?) for C = a @ b with M = 64, K = 96, N = 80 in bf16:
# v.r(*shape) is a random bf16 tensor, v.big a [M + 1, K + 8] one, v.b a contiguous [K, N].
_M, _K, _N = 64, 96, 80
VIEWS = [
    pytest.param(lambda v: (v.r(_M, _K), v.b), True, id="contiguous"),
    pytest.param(lambda v: (v.big[1:, 1 : _K + 1], v.b), False, id="odd element offset (base not 16-byte aligned)"),
    pytest.param(lambda v: (v.big[:_M, :_K], v.b), True, id="row stride of K + 8 elements (16-byte multiple)"),
    pytest.param(lambda v: (v.r(_M, _K + 1)[:, :_K], v.b), False, id="odd row stride (K + 1)"),
    pytest.param(lambda v: (v.r(2 * _M, 2 * _K)[::2, ::2], v.b), False, id="strided in both dims"),
    pytest.param(lambda v: (v.r(_K, _M).t(), v.b), True, id="transposed a (column-major)"),
    pytest.param(lambda v: (v.r(_K, _M + 1)[:, 1:].t(), v.b), False, id="transposed a with an odd leading dim"),
    pytest.param(lambda v: (v.big[:_M, :_K], v.r(_N, _K).t()), True, id="b = W.t() (K-major)"),
    pytest.param(lambda v: (v.big[:_M, :_K], v.r(_K, _N + 1)[:, 1:]), False, id="b sliced at an odd column"),
]


class _Views:
    def __init__(self, device):
        self.r = lambda *shape: torch.randn(*shape, device=device).to(torch.bfloat16)
        self.big, self.b = self.r(_M + 1, _K + 8), self.r(_K, _N)


@pytest.mark.parametrize("views,eligible", VIEWS)
@pytest.mark.parametrize("op", ["persistent", "matmul"])
def test_tma_eligibility_and_automatic_fallback(views, eligible, op, device):
    """Ineligible views are detected, and tma=None gives the right answer for every view (on
    a GPU: TMA where eligible, pointer loads otherwise; on the interpreter: pointer loads)."""
    a, b = views(_Views(device))
    name = f"{a.shape} {a.stride()} x {b.shape} {b.stride()}"
    c_like = torch.empty(a.shape[0], b.shape[1], device=device, dtype=a.dtype)
    assert (core_tma.tma_layout(a, b, c_like) is not None) == eligible, name
    fn = onegemm.persistent_matmul if op == "persistent" else onegemm.matmul
    assert_close(fn(a, b, activation="silu"), matmul_ref(a, b, None, "silu"), TOL[torch.bfloat16], name)
    if eligible:
        assert_close(fn(a, b, tma=True), matmul_ref(a, b), TOL[torch.bfloat16], name)
    else:
        with pytest.raises(ValueError, match="tma must be None .automatic. or False for these operands"):
            fn(a, b, tma=True)


def test_matmul_config_names_its_flavour(device):
    """matmul with a config that carries USE_TMA (as table entries do): True runs the TMA
    flavour, and is refused on a view TMA cannot read (an odd column offset)."""
    a = make((40, 64), torch.bfloat16, device)
    b = make((64, 48), torch.bfloat16, device)
    cfg = with_meta(INTERPRET_CONFIG, USE_TMA=True)
    assert_close(onegemm.matmul(a, b, config=cfg, tma=True), matmul_ref(a, b), TOL[torch.bfloat16])
    odd = make((40, 65), torch.bfloat16, device)[:, 1:]
    with pytest.raises(ValueError, match="config must be free of USE_TMA=True"):
        onegemm.matmul(odd, b, config=cfg)


@pytest.mark.parametrize("op", ["persistent", "matmul"])
def test_warp_specialize_switch(op, device):
    """A config with WARP_SPECIALIZE reaches core's K loop in both schedules and gives the same
    product (the interpreter runs the loop as written; the H200 compiles it warp-specialised)."""
    a = make((70, 96), torch.bfloat16, device)
    b = make((80, 96), torch.bfloat16, device).t()
    base = _cfg(128, 128, 64, 4, 4) if not onegemm.INTERPRET else INTERPRET_CONFIG
    fn = onegemm.persistent_matmul if op == "persistent" else onegemm.matmul
    bias = torch.randn(80, device=device, dtype=torch.bfloat16)
    out = fn(a, b, bias=bias, activation="silu", config=warp_specialized(base), tma=True)
    assert_close(out, matmul_ref(a, b, bias, "silu"), TOL[torch.bfloat16])


def test_tma_output_row_not_16_byte_multiple(device):
    """N = 17 fp16: the output's rows are 34 bytes, so C cannot take a descriptor."""
    a = make((32, 64), torch.float16, device)
    b = make((64, 17), torch.float16, device, "transposed")
    with pytest.raises(ValueError, match="output"):
        onegemm.persistent_matmul(a, b, tma=True)
    assert_close(onegemm.persistent_matmul(a, b), matmul_ref(a, b), TOL[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("layout_a,layout_b", TMA_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_gpu_tma_orientations(layout_a, layout_b, dtype, device):
    """Column-major A and row-major B are read through transposed descriptors."""
    a = make((1008, 2048), dtype, device, layout_a)  # 1008: partial tiles, and 16-byte rows in fp8
    b = make((2048, 1536), dtype, device, layout_b)
    for fn in (onegemm.persistent_matmul, onegemm.matmul):
        assert_close(fn(a, b, tma=True), matmul_ref(a, b), tol_for(dtype))


@pytest.mark.gpu
def test_gpu_from_a_new_thread(device):
    """triton.set_allocator is per thread (a ContextVar): the TMA flavour in a fresh thread
    must set it there, or the launch fails with 'no allocator was set'."""
    a = make((512, 1024), torch.bfloat16, device)
    b = make((1024, 768), torch.bfloat16, device)
    results, errors = {}, []

    def work():
        try:
            results["persistent"] = onegemm.persistent_matmul(a, b, tma=True)
            results["matmul"] = onegemm.matmul(a, b, tma=True)
            torch.cuda.synchronize()
        except Exception as e:  # re-raised in the main thread below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    for name, out in results.items():
        assert_close(out, matmul_ref(a, b), TOL[torch.bfloat16], name)


