"""Helpers the test modules share (``from helpers import make, tol_for``).

pytest puts tests/ on sys.path (the folder has no ``__init__.py``, import mode "prepend"), so
this module is imported as ``helpers`` whatever the checkout's folder is called; test modules
import each other never.
"""

import torch

import onegemm
from onegemm.core.configs import MATMUL_INTERPRET, cfg, with_meta
from onegemm.blockscaled.quantize import quantize_int4
from onegemm.testing import (TF32_TOL, TOL, dequantize_ref, int4_dequantize_ref, mxfp4_dequantize_ref, mxfp4_quantize_ref,
                             quantize_experts_ref)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# The input dtypes every dense-GEMM flavour runs.
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]

# Hopper's fp8 MMA adds products inside one K block in reduced precision (6.6e-5 measured on
# the H200 with K = 70 and an fp32 output), so an fp32 output of fp8 inputs is not 1e-5-exact.
FP8_MMA_TOL = 2e-4


def make(shape, dtype, device, layout="contig", scale=1.0):
    """A random [R, C] operand of ``dtype`` laid out as asked.

    contig: row-major. transposed: a .t() view of a [C, R] tensor (column-major).
    sliced: a strided view with gaps (every other row, an offset column window).
    """
    R, C = shape
    if layout == "contig":
        t = torch.randn(R, C, device=device) * scale
    elif layout == "transposed":
        t = (torch.randn(C, R, device=device) * scale).t()
    elif layout == "sliced":
        t = (torch.randn(2 * R + 1, C + 5, device=device) * scale)[1::2, 3 : 3 + C]
    else:
        raise ValueError(layout)
    return t.to(dtype)


def tol_for(dtype, out_dtype=None):
    """The bound on a matmul of ``dtype`` inputs written as ``out_dtype`` (default: matmul's)."""
    out_dtype = out_dtype or (torch.bfloat16 if dtype in FP8 else dtype)
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return TF32_TOL
    if dtype in FP8:
        return max(TOL[out_dtype], FP8_MMA_TOL)
    return TOL[out_dtype]


def split_cfg(split, dtype=torch.float32):
    """The interpreter's config, or on the H200 a 64x64 tile with the dtype's BLOCK_K; SPLIT_K set."""
    if onegemm.INTERPRET:
        base = MATMUL_INTERPRET
    else:
        base = cfg(64, 64, {1: 128, 2: 64, 4: 32}[torch.empty(0, dtype=dtype).element_size()], 4, 3)
    return with_meta(base, SPLIT_K=split)


# ---- grouped and MoE inputs (tests/test_grouped.py, test_moe.py, test_grouped_wgmma.py) ----


def capture(fn):
    """fn() once (its plans made and kernels compiled outside the capture), then captured in a
    CUDA graph: (graph, the captured call's output, which each replay overwrites)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def offs_of(sizes, device):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def fp8_grouped_inputs(kind_a, kind_b, sizes, K, N, device, tail=3):
    """(qa, qb, scale_a, scale_b, offs, dequantised a, dequantised b) for a 2D x 3D FP8 call:
    activations quantised per token (1x128 or row), expert weights [G, N, K] per 128x128 block
    or with a random per-channel scale, b and scale_b handed over transposed as checkpoints
    store them. ``tail``: rows of a past offs[-1]."""
    G = len(sizes)
    x = torch.randn(sum(sizes) + tail, K, device=device)
    qa, sa = onegemm.quantize_fp8(x, (1, 128) if kind_a == "1x128" else "row")
    w = torch.randn(G, N, K, device=device) * K**-0.5
    if kind_b == "128x128":
        qw, sw = (torch.stack(t) for t in zip(*[onegemm.quantize_fp8(w[g], (128, 128)) for g in range(G)]))
        sb = sw.transpose(1, 2)  # [G, ceil(K/128), ceil(N/128)]
        b_deq = torch.stack([dequantize_ref(qw[g], sw[g], 128, 128) for g in range(G)]).transpose(1, 2)
    else:
        qw = w.to(torch.float8_e4m3fn)
        sb = torch.rand(G, 1, N, device=device) + 0.5
        b_deq = qw.double().transpose(1, 2) * sb.double()
    a_deq = dequantize_ref(qa, sa, 1, 128) if kind_a == "1x128" else qa.double() * sa.double()
    return qa, qw.transpose(1, 2), sa, sb, offs_of(sizes, device), a_deq, b_deq


def moe_inputs(T, H, I, E, k, dtype, device, skewed=False):
    """x, experts at 1/sqrt(fan-in) and routing of random logits (``skewed``: most tokens pick
    experts 0 and 1)."""
    x = torch.randn(T, H, device=device).to(dtype)
    w_gate_up = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype)
    w_down = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    logits = torch.randn(T, E, device=device)
    if skewed:
        logits[:, :2] += 4.0
    weights, ids = onegemm.route(logits, k)
    return x, w_gate_up, w_down, weights, ids


def fp8_moe_inputs(T, H, I, E, k, dtype, device, bad_ids=False, skewed=False):
    """Random bf16-scale experts quantised by the reference quantiser (gate and up apart)."""
    x, w13, w2, weights, ids = moe_inputs(T, H, I, E, k, torch.float32, device, skewed)
    gate_q, gate_s = quantize_experts_ref(w13[:, :I])
    up_q, up_s = quantize_experts_ref(w13[:, I:])
    w2q, w2s = quantize_experts_ref(w2)
    if bad_ids:  # expert-parallel: ids of experts on other ranks contribute nothing
        ids[::3, 0] = E + 1
        ids[1::4, -1] = -1
    return (x.to(dtype), torch.cat([gate_q, up_q], 1), w2q, weights, ids,
            dict(w_gate_up_scale=torch.cat([gate_s, up_s], 1), w_down_scale=w2s), (w13, w2))


def fp8_layer_diff_bound(y: torch.Tensor) -> float:
    """The calc_diff bound of an FP8 layer's output y against the unquantised layer's: 5e-3,
    about twice the format's error, where y has 1024 values or more. calc_diff averages over
    y's values, so a single token's 128 of them spread wider (up to 3.5x the median over 300
    seeds): the bound grows as 1 / sqrt(y.numel()) below 1024."""
    return 5e-3 * max(1.0, (1024 / max(y.numel(), 1)) ** 0.5)


# ---- 4-bit experts (tests/test_int4.py, test_mxfp4.py) ----


def int4_experts(G, N, K, group, device, scale_dtype=torch.bfloat16):
    """Random experts [G, N, K] quantised to INT4 as stored ([G, N, K/8] int32, scales
    [G, N, K/group]), handed to grouped_matmul transposed; and their float64 decode [G, K, N].
    scale_dtype "zero": asymmetric groups (bf16 scales with zero points, int32 words)."""
    w = torch.randn(G, N, K, device=device) * K**-0.5
    if scale_dtype == "zero":
        q, s = quantize_int4(w + K**-0.5, group, torch.bfloat16, zero_point=True)  # off-centre: zero points vary
    else:
        q, s = quantize_int4(w, group, scale_dtype)
    return q.transpose(1, 2), s.transpose(1, 2), int4_dequantize_ref(q, s).transpose(1, 2)


def mxfp4_experts(G, N, K, device, layout="transposed"):
    """Random experts [G, N, K] in MXFP4 as gpt-oss stores them, handed to grouped_matmul as
    b [G, K / 2, N] and scale_b [G, K / 32, N]: the transpose(1, 2) of [G, N, K / 2] and
    [G, N, K / 32] ("transposed"), or those made N-contiguous ("n_major"); and their float64
    decode [G, K, N]."""
    blocks, scales = mxfp4_quantize_ref(torch.randn(G, N, K, device=device))
    w4 = blocks.flatten(-2).view(torch.float4_e2m1fn_x2).transpose(1, 2)
    s8 = scales.view(torch.float8_e8m0fnu).transpose(1, 2)
    if layout == "n_major":
        w4 = w4.view(torch.uint8).contiguous().view(torch.float4_e2m1fn_x2)
        s8 = s8.view(torch.uint8).contiguous().view(torch.float8_e8m0fnu)
    return w4, s8, mxfp4_dequantize_ref(blocks, scales).transpose(1, 2)
