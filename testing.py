"""onegemm.testing: what the tests, the benchmarks and users checking onegemm share.

* float64 torch references of every op, their gradients (``ref_grads``) and the error
  measures (``rel_err``, ``calc_diff``, ``sqnr_db``) with the tolerances the tests hold
  onegemm to;
* ``assert_route_close``: onegemm.route's choice against ``route_ref``'s, exact but for rows
  whose float64 scores nearly tie (which fp32 may order either way);
* ``assert_moe_fp8_close``: the FP8 expert FFN against ``moe_fp8_ref``, allowing for SwiGLU
  outputs that sit on an FP8 rounding midpoint (which fp32 may round either way);
* ``int4_dequantize_ref``: compressed-tensors' INT4 (pack-quantized) weights in float64.
* ``mxfp4_quantize_ref`` / ``mxfp4_dequantize_ref``: the MXFP4 format gpt-oss stores its
  experts in, in float64 (what 4-bit kernels are checked against);
* ``moe_ffn_torch``: the expert FFN in plain torch (the benchmarks' peer);
* ``moe_layer_ref``: a whole MoEFFN (router, routing, experts, shared experts) in float64;
* transformers' MoE blocks, MoEFFN's peer: ``hf_moe_config``, ``hf_moe_block`` (a block
  alone, random weights, at any size), ``randomize_moe_block``, ``hf_forward``;
* timing on a GPU: ``gpu_ms`` (CUDA-graph replays), ``eager_ms`` (calls as a user makes them)
  and ``host_us`` (the host's time per call);
* ``run_ranks``: a function in several processes joined by a gloo process group (the
  expert-parallel tests).
"""

import math
import multiprocessing
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.nn.functional as F

from .core.runtime import graph_bench

# Relative Frobenius error bounds against a float64 reference of the same inputs.
# bf16: its 8-bit mantissa, rounded once at the output cast. fp8 inputs are exact in fp64,
# so their bound is the output cast's (bf16 by default).
TOL = {
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}
TF32_TOL = 1e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64; inf if out holds any NaN or inf."""
    out = out.detach().double()
    ref = ref.detach().double().to(out.device)
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "output"):
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    n_nan = int(torch.isnan(out.detach().float()).sum()) if out.numel() else 0
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} ({n_nan} NaN of {out.numel()})"


def act_ref(x: torch.Tensor, activation):
    if activation is None:
        return x
    if activation == "relu":
        return F.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    raise ValueError(activation)


def matmul_ref(a, b, bias=None, activation=None):
    """act(a @ b + bias) in float64, on the inputs' device."""
    out = a.double() @ b.double()
    if bias is not None:
        out = out + bias.double()
    return act_ref(out, activation)


# ---- FP8 (blockscaled/) ----


def ref_grads(ref_fn, inputs, grad_out) -> list:
    """float64 gradients of ``ref_fn(*inputs)`` against ``grad_out``: each floating-point input
    is copied to float64 (a leaf that requires grad), integer inputs pass as they are. Returns
    one gradient per input (None for the integer ones)."""
    leaves = [x.detach().double().requires_grad_() if x is not None and x.is_floating_point() else x for x in inputs]
    out = ref_fn(*leaves)
    out.backward(grad_out.double())
    return [x.grad if x is not None and x.is_floating_point() else None for x in leaves]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2<x, y> / (|x|^2 + |y|^2) in float64 (DeepSeek's measure; 0 = identical)."""
    x, y = x.detach().double(), y.detach().double().to(x.device)
    denom = (x * x + y * y).sum().item()
    return 1.0 - 2.0 * (x * y).sum().item() / denom if denom > 0 else 0.0


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of x against ref, in dB."""
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    noise = (x - ref).norm().item()
    return math.inf if noise == 0 else 20.0 * math.log10(ref.norm().item() / noise)


def _block_ids(M: int, K: int, rows_per_scale: int, cols_per_scale: int, device):
    """For every element of an [M, K] matrix, the (row, col) of its scale."""
    r = torch.arange(M, device=device) // rows_per_scale
    c = torch.arange(K, device=device) // cols_per_scale
    return r[:, None].expand(M, K), c[None, :].expand(M, K)


def block_dims(block, M: int, K: int):
    """rows and columns sharing one scale: (1, 128), (128, 128), "row", "tensor"."""
    if block == "row":
        return 1, max(K, 1)
    if block == "tensor":
        return max(M, 1), max(K, 1)
    return tuple(block)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= s (s > 0), exactly: s = m * 2^e with m in [0.5, 1), so the
    answer is 2^(e-1) when m == 0.5 (s is already a power of two) and 2^e otherwise.
    (exp2(ceil(log2(s))) is not exact on CUDA, whose log2 may miss an exact power by an ulp.)"""
    m, e = torch.frexp(s)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


def is_pow2(s: torch.Tensor) -> torch.Tensor:
    return torch.frexp(s)[0] == 0.5


def quantize_fp8_ref(x: torch.Tensor, block, dtype=torch.float8_e4m3fn, pow2_scale=False, scale_rule="onegemm"):
    """The quantiser's contract in float64, element by element through scatter/gather (an
    implementation independent of onegemm's einops/Triton ones).
    Returns (q, scale) with scale shaped as quantize_fp8 documents.
    scale_rule="torchao": torchao's float8 rule as its amax_to_scale / to_fp8_saturated write
    it: the multiplier m = fp32(FP8_MAX / max(amax, 1e-12)) (pow2_scale: 2^floor(log2 m)),
    q = fp8(clamp(fp32(x * m))), and the scale torchao's GEMMs take, fp32(1 / m)."""
    M, K = x.shape
    rb, cb = block_dims(block, M, K)
    ri, ci = _block_ids(M, K, rb, cb, x.device)
    nr, nc = -(-M // rb), -(-K // cb)
    flat = (ri * nc + ci).reshape(-1)
    ax = x.double().abs().reshape(-1)
    amax = torch.zeros(nr * nc, dtype=torch.float64, device=x.device).scatter_reduce(0, flat, ax, "amax")
    fmax = torch.finfo(dtype).max
    shape = (M, 1) if block == "row" else () if block == "tensor" else (nr, nc)
    if scale_rule == "torchao":
        mult = (fmax / amax.clamp_min(1e-12)).float().double()
        if pow2_scale:  # m = f * 2^e with f in [0.5, 1): 2^floor(log2 m) = 2^(e - 1)
            mult = torch.ldexp(torch.ones_like(mult), torch.frexp(mult)[1] - 1)
        # x * m of two fp32 values is exact in float64; one rounding to fp32 is torch's fp32 product
        q = (x.float().double() * mult[flat].reshape(M, K)).float().clamp(-fmax, fmax).to(dtype)
        return q, (1.0 / mult).float().reshape(shape)
    scale = torch.where(amax > 0, (amax / fmax).clamp_min(torch.finfo(torch.float32).tiny), 1.0)
    if pow2_scale:
        scale = pow2_ceil(scale)
    scale = scale.float().double()  # scales are fp32 (amax / fmax rounds once, as in fp32)
    q = (x.double() / scale[flat].reshape(M, K)).clamp(-fmax, fmax).to(dtype)
    return q, scale.float().reshape(shape)


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, rows_per_scale: int, cols_per_scale: int):
    """q * scale in float64, each element times the scale of its block (scale [R, C] or scalar)."""
    M, K = q.shape
    s = scale.double()
    if s.numel() == 1:
        return q.double() * s.reshape(())
    ri, ci = _block_ids(M, K, rows_per_scale, cols_per_scale, q.device)
    return q.double() * s[ri, ci]


def blockscaled_matmul_ref(a, b, scale_a, scale_b, a_block, b_block, bias=None, activation=None):
    """act((a * scale_a) @ (b * scale_b) + bias) in float64, the granularities given explicitly:
    a_block = (rows, cols) of A sharing one scale, b_block = (rows, cols) of B likewise
    (e.g. (1, 128) and (128, 128) for the DeepSeek-V3 recipe with b = W.t())."""
    return matmul_ref(dequantize_ref(a, scale_a, *a_block), dequantize_ref(b, scale_b, *b_block), bias, activation)



# How each recipe casts the operands of a Linear's three GEMMs, written out from torchao's
# Float8LinearConfig.from_recipe_name (and DeepSeek-V3's for "blockwise"), independently of
# blockscaled/recipes.py: (block, fp8 dtype) per operand along the GEMM's K, None for high
# precision; x / w / dy along their rows, x_t / w_t / dy_t along their columns (the wgrad's
# B, the dgrad's B, the wgrad's A); the scale rule and the power-of-two rounding.
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_RECIPES_REF = {
    "blockwise": dict(x=((1, 128), _E4M3), w=((128, 128), _E4M3), dy=((1, 128), _E4M3), x_t=((1, 128), _E4M3),
                      w_t=((128, 128), _E4M3), dy_t=((1, 128), _E4M3), rule="onegemm", pow2=False),
    "tensorwise": dict(x=("tensor", _E4M3), w=("tensor", _E4M3), dy=("tensor", _E5M2), x_t=("tensor", _E4M3),
                       w_t=("tensor", _E4M3), dy_t=("tensor", _E5M2), rule="torchao", pow2=False),
    "rowwise": dict(x=("row", _E4M3), w=("row", _E4M3), dy=("row", _E4M3), x_t=("row", _E4M3), w_t=("row", _E4M3),
                    dy_t=("row", _E4M3), rule="torchao", pow2=True),
    "rowwise_with_gw_hp": dict(x=("row", _E4M3), w=("row", _E4M3), dy=("row", _E4M3), x_t=None,
                               w_t=("tensor", _E4M3), dy_t=None, rule="torchao", pow2=False),
}


def fp8_linear_train_ref(x, w, bias, dy, recipe: str):
    """(y, dx, dW) of y = x @ W.T + bias in float64 from the operands each GEMM of ``recipe``
    reads (FP8_RECIPES_REF): every fp8 operand quantised as the recipe says (quantize_fp8_ref)
    and dequantised, high-precision ones as they are."""
    spec = FP8_RECIPES_REF[recipe]

    def along_rows(t, name):  # t quantised along its rows, dequantised (float64)
        if spec[name] is None:
            return t.double()
        block, dtype = spec[name]
        q, s = quantize_fp8_ref(t, block, dtype, spec["pow2"], spec["rule"])
        return dequantize_ref(q, s, *block_dims(block, *t.shape))

    x, w, dy = x.detach(), w.detach(), dy.detach()
    y = along_rows(x, "x") @ along_rows(w, "w").t()
    if bias is not None:
        y = y + bias.detach().double()
    dx = along_rows(dy, "dy") @ along_rows(w.t(), "w_t").t()
    dw = along_rows(dy.t(), "dy_t") @ along_rows(x.t(), "x_t").t()
    return y, dx, dw

# ---- grouped/ (grouped_matmul, MoE) ----


def grouped_mm_ref(a, b, offs=None, bias=None, activation=None):
    """float64 torch._grouped_mm semantics, one group at a time (see onegemm.grouped_matmul).

    Rows (columns) past offs[-1] are zero. bias [G, N] ([sum_N] for 3D x 2D).
    """
    a, b = a.double(), b.double()
    bias = None if bias is None else bias.double()
    ends = [] if offs is None else offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 3 and b.dim() == 3:
        return act_ref(a @ b + (0 if bias is None else bias[:, None, :]), activation)
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = matmul_ref(a[s:e], b[g], None if bias is None else bias[g], activation)
        return out
    if a.dim() == 2 and b.dim() == 2:
        out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[g] = matmul_ref(a[:, s:e], b[s:e], None if bias is None else bias[g], activation)
        return out
    out = a.new_zeros(a.shape[1], b.shape[1])  # 3D x 2D
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[:, s:e] = matmul_ref(a[g], b[:, s:e], None if bias is None else bias[s:e], activation)
    return out


def route_ref(logits, top_k, renormalize=True, *, scoring="softmax", correction_bias=None, n_group=1,
              topk_group=None, routed_scaling_factor=1.0, ids=None):
    """onegemm.route in float64, row by row (ties: value descending, the lower index first).

    Returns (weights float64 [T, k], ids int64 [T, k]). ``ids`` [T, k]: take these experts
    instead of choosing (their weights, for ``assert_route_close``).
    """
    given = None if ids is None else ids.detach().long().cpu()
    L = logits.detach().double().cpu()
    T, E = L.shape
    bias = None if correction_bias is None else correction_bias.detach().double().cpu()

    def best(values, k, among=None):
        order = sorted(among if among is not None else range(len(values)), key=lambda i: (-values[i], i))
        return order[:k]

    ids = torch.empty(T, top_k, dtype=torch.long)
    weights = torch.empty(T, top_k, dtype=torch.float64)
    scores = _route_scores(L, scoring)
    for t in range(T):
        row = L[t]
        if scoring in ("softmax", "sigmoid"):
            s = scores[t]
            choice = (s if bias is None else s + bias).tolist()
            candidates = range(E)
            if n_group > 1:
                size = E // n_group
                groups = [sorted(choice[g * size:(g + 1) * size], reverse=True) for g in range(n_group)]
                gscore = [g[0] if bias is None else g[0] + g[1] for g in groups]
                kept = best(gscore, topk_group)
                candidates = [e for e in range(E) if e // size in kept]
            chosen = best(choice, top_k, candidates) if given is None else given[t].tolist()
            w = s[chosen]
        else:
            chosen = best(row.tolist(), top_k) if given is None else given[t].tolist()
            w = torch.softmax(row[chosen], 0) if scoring == "topk_softmax" else torch.sigmoid(row[chosen])
        if renormalize:
            w = w / (w.sum() + 1e-20)
        ids[t] = torch.tensor(chosen)
        weights[t] = w * routed_scaling_factor
    return weights.to(logits.device), ids.to(logits.device)


def _route_scores(L, scoring):
    """float64 [T, E] scores of ``scoring`` (softmax or sigmoid); the logits themselves for the
    top-k-first scorings, which choose by logit."""
    if scoring == "softmax":
        return torch.softmax(L, -1)
    return torch.sigmoid(L) if scoring == "sigmoid" else L


def route_choice_ref(logits, *, scoring="softmax", correction_bias=None):
    """The float64 score route_ref chooses experts by, [T, E]: ``_route_scores`` plus the
    correction bias where the scoring takes one."""
    s = _route_scores(logits.detach().double(), scoring)
    if correction_bias is None or scoring not in ("softmax", "sigmoid"):
        return s
    return s + correction_bias.detach().double()


def assert_route_close(weights, ids, logits, top_k, renormalize=True, tol=1e-6, **options):
    """onegemm.route's (weights, ids) against route_ref: the same ids, except in a row whose
    float64 scores nearly tie (within ``tol``) where the two choices differ, which fp32
    arithmetic may order either way; and the weights of the ids chosen within ``tol``."""
    _, ids_ref = route_ref(logits, top_k, renormalize, **options)
    ids = ids.long()
    rows = (ids != ids_ref).any(1).nonzero().flatten()
    if rows.numel():
        choice = route_choice_ref(logits[rows], scoring=options.get("scoring", "softmax"),
                                  correction_bias=options.get("correction_bias"))
        got, want = choice.gather(1, ids[rows]), choice.gather(1, ids_ref[rows])
        worst = (got - want).abs().max().item()
        if worst > tol:
            raise AssertionError(f"route: rows {rows.tolist()[:8]} chose other experts than route_ref, with scores "
                                 f"up to {worst:.3g} apart (more than a near tie of {tol})")
    w_ref, _ = route_ref(logits, top_k, renormalize, ids=ids, **options)
    assert_close(weights, w_ref, tol, "route weights")


def moe_ref(x, w_gate_up, w_down, topk_weights, topk_ids):
    """float64 y[t] = sum_j w[t,j] * W2_e(silu(W1_e x_t) * W3_e x_t), e = ids[t,j].

    Ids outside [0, E) contribute nothing (onegemm's expert-parallel convention).
    """
    return _moe_sum(x.double(), w_gate_up, w_down, topk_weights, topk_ids)


def _moe_sum(x, w_gate_up, w_down, topk_weights, topk_ids, round_h=None, *, swiglu=None, b13=None, b2=None,
             on_input=False):
    """The expert FFN in float64 on float64 x, expert by expert (each expert's weights made
    float64 when it is used, so a real model's layer fits); ``round_h``: what happens to the
    SwiGLU output before the down projection (the FP8 pipeline quantises it). ``swiglu``:
    the activation of (gate, up) (default silu(gate) * up); ``b13``, ``b2``: the two GEMMs'
    per-expert biases (gpt-oss); ``on_input``: the routing weight scales the expert's input
    (Llama-4), not its output."""
    I = w_gate_up.shape[1] // 2
    y = torch.zeros_like(x)
    for e in range(w_gate_up.shape[0]):
        t, j = torch.nonzero(topk_ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        w = topk_weights[t, j].double()[:, None]
        gu = (x[t] * w if on_input else x[t]) @ w_gate_up[e].double().t()
        if b13 is not None:
            gu = gu + b13[e].double()
        h = swiglu(gu[:, :I], gu[:, I:]) if swiglu else F.silu(gu[:, :I]) * gu[:, I:]
        if round_h is not None:
            h = round_h(h)
        out = h @ w_down[e].double().t()
        if b2 is not None:
            out = out + b2[e].double()
        y.index_add_(0, t, out if on_input else w * out)
    return y


def assert_layer_close_to_twin(layer, twin, x, tol, min_same=0.7):
    """A quantised MoEFFN ``layer`` against float64 of its ``twin`` on the dequantised experts
    (moe_layer_ref), on x: rows whose routing differs by a near tie (the layer routes in fp32,
    the reference in float64) are left out, and at least ``min_same`` of the rows must remain.
    Returns the layer's output."""
    with torch.no_grad():
        y = layer(x)
        ids = layer.route(x)[1]
    ref, (_, ids_ref) = moe_layer_ref(twin, x)
    same = (ids.long().sort(1).values == ids_ref.sort(1).values).all(1)
    assert same.float().mean() > min_same, f"only {same.float().mean():.2f} of the rows route as float64 does"
    assert_close(y[same], ref[same], tol)
    return y


def moe_layer_ref(layer, x):
    """float64 of an MoEFFN's forward from its parameters (16/32-bit experts): the router
    (x @ gate_weight.T + gate_bias), route_ref's routing with the layer's options, the routed
    experts (gpt-oss's biases and clamped SwiGLU; Llama-4's weights on the input) and the
    shared experts. Returns (y float64 [T, H], (weights, ids) of the routing)."""
    if layer.w_gate_up_scale is not None:
        raise ValueError("layer must have 16/32-bit experts, got FP8 ones (compare an FP8 layer with the reference "
                         "of its unquantised twin)")
    with torch.no_grad():
        x = x.double()
        logits = x @ layer.gate_weight.double().t()
        if layer.gate_bias is not None:
            logits = logits + layer.gate_bias.double()
        w, ids = route_ref(logits, layer.top_k, layer.renormalize, correction_bias=layer.correction_bias,
                           **layer.routing)
        swiglu, lim, alpha = None, layer.swiglu_limit, layer.swiglu_alpha
        if layer.biased_experts:
            def swiglu(g, u):
                g = g.clamp(max=lim)
                return g * torch.sigmoid(alpha * g) * (u.clamp(-lim, lim) + 1)
        y = _moe_sum(x, layer.w_gate_up, layer.w_down, w, ids, swiglu=swiglu, b13=layer.w_gate_up_bias,
                     b2=layer.w_down_bias, on_input=layer.weights_on_input)
        if layer.shared_w_down is not None:
            gate, up = (x @ layer.shared_w_gate_up.double().t()).chunk(2, dim=-1)
            shared = (F.silu(gate) * up) @ layer.shared_w_down.double().t()
            if layer.shared_gate is not None:
                shared = torch.sigmoid(x @ layer.shared_gate.double().t()) * shared
            y = y + shared
    return y, (w, ids)


def quantize_experts_ref(w: torch.Tensor, dtype=torch.float8_e4m3fn):
    """[E, N, K] -> (fp8 [E, N, K], fp32 scales [E, ceil(N/128), ceil(K/128)]): each expert's
    matrix in 128x128 blocks (quantize_fp8_ref), as a checkpoint stores weight_scale_inv."""
    qs = [quantize_fp8_ref(w[e], (128, 128), dtype) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def dequantize_experts_ref(q: torch.Tensor, scale: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """float64 [E, N, K] from fp8 experts and their 128x128 scales. ``gate_up``: q is
    [E, 2I, H] with the gate's scale blocks, then the up's (each half quantised apart)."""
    if gate_up:
        half, blocks = q.shape[1] // 2, scale.shape[1] // 2
        return torch.cat([dequantize_experts_ref(q[:, :half], scale[:, :blocks]),
                          dequantize_experts_ref(q[:, half:], scale[:, blocks:])], dim=1)
    return torch.stack([dequantize_ref(q[e], scale[e], 128, 128) for e in range(q.shape[0])])


# MXFP4 (the OCP MX format: e2m1 values, 32 per block, one e8m0 power-of-two scale per block)
# as gpt-oss stores its experts: blocks uint8 [..., rows, K / 32, 16], two values per byte, the
# lower nibble first along K; scales uint8 [..., rows, K / 32], a block's scale 2^(s - 127)
# (s = 255: NaN). An e2m1 code is sign (bit 3) and a magnitude index (bits 0-2) into:
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32


def mxfp4_dequantize_ref(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., rows, K] of MXFP4 ``blocks`` and ``scales`` (the layout above), code by
    code through the e2m1 table, each block times its exact power of two."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != MXFP4_BLOCK // 2 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks must be uint8 [..., K / 32, 16] and scales uint8 [..., K / 32], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).long()  # [..., K / 32, 32]
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=blocks.device)
    values = table[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0).double()
    scale = torch.where(scales == 255, math.nan, torch.exp2(scales.double() - 127))
    return (values * scale[..., None]).flatten(-2)


def int4_dequantize_ref(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., rows, K] of INT4 weights as compressed-tensors' symmetric pack-quantized
    format stores them: ``packed`` int32 [..., rows, K / 8] (value j of a word in bits 4j..4j+3
    as value + 8) and ``scales`` [..., rows, K / group] (any float dtype), word by word.
    Asymmetric groups: ``scales`` int32, each word an fp32 scale whose low byte holds the
    group's zero point z (0..15); a value is then (code - z) * scale."""
    if packed.dtype != torch.int32 or packed.shape[:-1] != scales.shape[:-1] or \
            (packed.shape[-1] * 8) % max(scales.shape[-1], 1):
        raise ValueError(f"packed must be int32 [..., K / 8] and scales [..., K / group], got {packed.dtype} "
                         f"{tuple(packed.shape)} and {scales.dtype} {tuple(scales.shape)}")
    words = packed.long() & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=packed.device)
    codes = ((words[..., None] >> shifts) & 0xF).double().flatten(-2)  # [..., K]
    codes = codes.unflatten(-1, (scales.shape[-1], -1))
    if scales.dtype == torch.int32:
        bits = scales.long() & 0xFFFFFFFF
        zero = (bits & 0xFF).double()
        high = bits & 0xFFFFFF00
        scales = torch.where(high >= 2**31, high - 2**32, high).to(torch.int32).view(torch.float32)
        return ((codes - zero[..., None]) * scales.double()[..., None]).flatten(-2)
    return ((codes - 8) * scales.double()[..., None]).flatten(-2)


def mxfp4_quantize_ref(w: torch.Tensor, scale_rounding: str = "floor"):
    """w [..., rows, K] (K a multiple of 32) -> MXFP4 (blocks, scales), in float64. A block's
    scale is 2^e with e = floor(log2(amax)) - 2 ("floor", the OCP MX rule: values past 6 times
    it clamp to +-6) or e = ceil(log2(amax / 6)) ("ceil": none clamps); an all-zero block takes
    s = 0. Each value / scale rounds to the nearest e2m1 value, a tie to the even code, keeping
    its sign (-0 too)."""
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"w's last dimension must be a multiple of {MXFP4_BLOCK}, got {w.shape[-1]}")
    if scale_rounding not in ("floor", "ceil"):
        raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}")
    x = w.double().unflatten(-1, (-1, MXFP4_BLOCK))  # [..., K / 32, 32]
    amax = x.abs().amax(dim=-1)
    if scale_rounding == "floor":
        e = torch.floor(torch.log2(amax)) - 2
    else:
        e = torch.ceil(torch.log2(amax / E2M1_MAGNITUDES[-1]))
    s = torch.where(amax > 0, (e + 127).clamp(0, 254), 0.0)
    a = (x.abs() / torch.exp2(s - 127)[..., None]).clamp(max=E2M1_MAGNITUDES[-1])
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=w.device)
    hi = torch.searchsorted(table, a).clamp(max=len(E2M1_MAGNITUDES) - 1)  # first magnitude >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    idx = torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)
    codes = (idx | torch.signbit(x).long() * 8).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, s.to(torch.uint8)


def moe_fp8_ref(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, *,
                flip_bound: bool = False):
    """float64 of moe_ffn's FP8 pipeline on fp8 experts: x and each (token, slot)'s SwiGLU
    output quantised in 1x128 blocks (quantize_fp8_ref), the weights dequantised, every
    product and sum in float64. Ids outside [0, E) contribute nothing.

    ``flip_bound``: also return, per element of y, how far it moves (root of the sum of
    squares) if every SwiGLU output within FP8_MIDPOINT_REL of a rounding midpoint rounds to
    its other neighbour: the kernels compute it in fp32 (FP8 wgmma accumulates in less), so
    such an element may round either way."""
    fp8 = w_gate_up.dtype
    w13 = _LazyExperts(w_gate_up.shape, lambda e: dequantize_experts_ref(w_gate_up[e:e + 1], w_gate_up_scale[e:e + 1],
                                                                        gate_up=True)[0])
    w2 = _LazyExperts(w_down.shape, lambda e: dequantize_experts_ref(w_down[e:e + 1], w_down_scale[e:e + 1])[0])

    def per_token_blocks(t):
        return dequantize_ref(*quantize_fp8_ref(t, (1, 128), fp8), 1, 128)

    xq = per_token_blocks(x)
    y = _moe_sum(xq, w13, w2, topk_weights, topk_ids, per_token_blocks)
    if not flip_bound:
        return y
    # each near-midpoint element flips either way, independently: the root of the sum of squares
    steps2 = lambda h: _fp8_flip_steps(h, fp8) ** 2  # noqa: E731
    w2_squared = _LazyExperts(w_down.shape, lambda e: w2[e] ** 2)
    return y, _moe_sum(xq, w13, w2_squared, topk_weights**2, topk_ids, steps2).sqrt()


class _LazyExperts:
    """[E, N, K] experts made float64 one at a time, as _moe_sum reaches them: a real model's
    stack in float64 (DeepSeek-V3's 32 local experts: 7.5 GB for gate_up) need not fit beside
    other test processes on one GPU."""

    def __init__(self, shape, expert):
        self.shape, self._expert = tuple(shape), expert

    def __getitem__(self, e: int) -> torch.Tensor:
        return self._expert(e)


# How close (relative) to a rounding midpoint a float64 value must be for a kernel's fp32
# value of it to round to the other neighbour: FP8 wgmma sums its products with ~14 bits.
FP8_MIDPOINT_REL = 2.0**-11


def _fp8_flip_steps(h: torch.Tensor, dtype) -> torch.Tensor:
    """|the step between h's two nearest values| (in h's units) where h, quantised in 1x128
    blocks, lies within FP8_MIDPOINT_REL of their midpoint; 0 elsewhere."""
    q, scale = quantize_fp8_ref(h, (1, 128), dtype)
    s = dequantize_ref(torch.ones_like(q, dtype=torch.float64), scale, 1, 128)
    v = h / s  # the value the quantiser rounds
    info = torch.finfo(dtype)
    exp = torch.floor(torch.log2(v.abs().clamp_min(info.smallest_normal)))
    spacing = torch.exp2(exp) * info.eps  # between v's neighbours (subnormals: the smallest binade's)
    near = ((v - q.double()).abs() - spacing / 2).abs() <= FP8_MIDPOINT_REL * v.abs()
    return torch.where(near, spacing * s, 0.0)


def assert_moe_fp8_close(y, x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                         tol: float = 1e-2, what: str = "FP8 moe_ffn"):
    """y against moe_fp8_ref: relative error at most tol plus the reference's flip bound
    (where few (token, slot) pairs make y, as at T = 1, one large SwiGLU output rounded to
    its other FP8 neighbour moves y by up to ~3e-2; the bound is 0 where none is near)."""
    ref, bound = moe_fp8_ref(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                             flip_bound=True)
    norm = ref.norm().item()
    assert_close(y, ref, tol + (bound.norm().item() / norm if norm > 0 else 0.0), what)


def moe_fp8_train_ref(x, w_gate_up, w_down, topk_weights, topk_ids, dy):
    """float64 of moe_ffn(..., fp8_training=True) and its gradients: (y, dx, dw_gate_up, dw_down,
    dtopk_weights), expert by expert. The recipe's operands are quantised as it does
    (quantize_fp8_ref): x[token], the SwiGLU output, dy[token] and dh_pre in 1x128 blocks, each
    expert's whole matrix in 128x128 blocks; what the kernels store in x's dtype (GEMM1's
    output h_pre, the SwiGLU output, dh_pre) is rounded to it; the weight gradients take the
    unquantised operands."""
    dt, fp8 = x.dtype, torch.float8_e4m3fn
    I = w_gate_up.shape[1] // 2

    def rows(t):  # 1x128-quantised, dequantised
        return dequantize_ref(*quantize_fp8_ref(t, (1, 128), fp8), 1, 128)

    def rounded(t):
        return t.to(dt).double()

    w13 = dequantize_experts_ref(*quantize_experts_ref(w_gate_up.detach(), fp8))
    w2 = dequantize_experts_ref(*quantize_experts_ref(w_down.detach(), fp8))
    y, dx = torch.zeros_like(x, dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64)
    dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
    dweights = torch.zeros_like(topk_weights, dtype=torch.float64)
    x, dy = x.detach(), dy.to(dt)
    for e in range(w13.shape[0]):
        t, j = torch.nonzero(topk_ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        w = topk_weights[t, j].detach().double()[:, None]
        h_pre = rounded(rows(x[t]) @ w13[e].t())
        g, u = h_pre[:, :I], h_pre[:, I:]
        h = rounded((F.silu(g.float()) * u.float()).double())
        y.index_add_(0, t, w * (rows(h) @ w2[e].t()))
        dh_u = rows(dy[t]) @ w2[e]
        sig = torch.sigmoid(g)
        dweights[t, j] = (dh_u * F.silu(g) * u).sum(1)
        dh = dh_u * w
        dh_pre = rounded(torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * F.silu(g)], dim=1))
        dx.index_add_(0, t, rows(dh_pre) @ w13[e])
        dw13[e] = dh_pre.t() @ x[t].double()
        dw2[e] = rounded(w * dy[t].double()).t() @ h
    return y, dx, dw13, dw2, dweights


def moe_ffn_torch(x, w_gate_up, w_down, topk_weights, topk_ids, *, use_grouped_mm: bool = False):
    """The expert FFN in plain torch, in x's dtype: the peer that benchmarks and
    ``python -m onegemm`` compare against (in float64 it is a reference).

    The usual eager recipe, in torch alone (a peer that ran onegemm's kernels would measure
    onegemm): sort the pairs by expert (torch.sort, stable; ids outside [0, E) last),
    torch.searchsorted for the group ends, copy the token rows into that order, one GEMM per
    expert (a loop of torch.mm, which reads the group sizes on the host) or torch._grouped_mm
    (``use_grouped_mm``; bf16 on a GPU is its fast path), SwiGLU, the down GEMM, scale by the
    routing weight and index_add the rows back per token.
    """
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    expert = torch.where((flat >= 0) & (flat < E), flat, E)  # range-checked in the ids' own width
    sorted_ids, pair = torch.sort(expert, stable=True)
    experts = torch.arange(E, device=flat.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    token = pair // k
    xs = x[token]
    if use_grouped_mm:
        gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs, out_dtype=x.dtype)
    else:
        gu = torch.empty(xs.shape[0], two_i, dtype=x.dtype, device=x.device)
        ends = offs.tolist()
        for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
            gu[s:t] = xs[s:t] @ w_gate_up[e].t()
    h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    if use_grouped_mm:
        down = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs, out_dtype=x.dtype)
    else:
        down = torch.empty(h.shape[0], H, dtype=x.dtype, device=x.device)
        for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
            down[s:t] = h[s:t] @ w_down[e].t()
    ids = topk_ids.reshape(-1)[pair]
    valid = (ids >= 0) & (ids < E)  # rows past offs[-1] hold no product (grouped_mm leaves them)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = topk_weights.reshape(-1)[pair].to(acc_dtype)
    rows = torch.where(valid[:, None], down.to(acc_dtype) * w[:, None], 0)
    return torch.zeros(T, H, dtype=acc_dtype, device=x.device).index_add_(0, token, rows).to(x.dtype)


# ---- transformers' MoE blocks: MoEFFN's peer (tests/test_transformers.py, bench/bench_layers.py, python -m onegemm) ----

# model_type -> (config class, modeling module, the MoE block's class, the decoder layer's attribute holding it)
HF_MOE_BLOCKS = {
    "mixtral": ("MixtralConfig", "mixtral", "MixtralSparseMoeBlock", "mlp"),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "mlp"),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "mlp"),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE", "mlp"),
    "glm4_moe": ("Glm4MoeConfig", "glm4_moe", "Glm4MoeMoE", "mlp"),
    "llama4_text": ("Llama4TextConfig", "llama4", "Llama4TextMoe", "feed_forward"),
    "gpt_oss": ("GptOssConfig", "gpt_oss", "GptOssMLP", "mlp"),
}


def hf_moe_config(model_type: str, **fields):
    """transformers' config of ``model_type`` with ``fields``, the config class's defaults
    for the rest; None when the installed transformers lacks the family. The fields are
    set as attributes too: some versions map renamed fields in __init__."""
    import transformers

    cls = getattr(transformers, HF_MOE_BLOCKS[model_type][0], None)
    if cls is None:
        return None
    cfg = cls(**fields)
    for name, value in fields.items():
        if value is not None:
            setattr(cfg, name, value)
    return cfg


def hf_moe_block(config, *, dtype=torch.float32, device="cpu", experts_implementation: str = "grouped_mm"):
    """transformers' MoE block of ``config``'s family, alone (not in a model), built on
    ``device`` in ``dtype`` with random weights (``randomize_moe_block``), in eval mode.
    ``experts_implementation``: transformers' expert loop ("grouped_mm", what a model picks
    on a GPU by default; "eager": a Python loop over the experts hit)."""
    import importlib

    _, module, name, _ = HF_MOE_BLOCKS[config.model_type]
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    config._experts_implementation = experts_implementation
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the weights are made in dtype at once: a real layer fits only once
    try:
        with torch.device(device):
            block = cls(config)
    finally:
        torch.set_default_dtype(default)
    block.to(dtype)  # the routers that ask for fp32 weights
    randomize_moe_block(block, config)
    return block.eval()


def randomize_moe_block(block, config) -> None:
    """In place: every weight of a transformers MoE block N(0, 1 / fan-in) (the routers then
    spread the tokens over the experts), every bias N(0, 1 / hidden), DeepSeek's correction
    bias N(0, 0.1^2); gpt-oss's clamped SwiGLU set from the config (transformers before 5.2x
    hard-codes limit 7.0 and alpha 1.702, which its checkpoints, and onegemm, read from it)."""
    H = config.hidden_size
    with torch.no_grad():
        for name, p in block.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1 or leaf.endswith("_bias"):
                fan_in = H
            elif leaf == "gate_up_proj":  # fused experts, [E, 2I, H] or [E, H, 2I]
                fan_in = H
            elif leaf == "down_proj":  # [E, H, I] or [E, I, H]
                fan_in = p.shape[1] * p.shape[2] // H
            else:  # routers and linears, [out, in]
                fan_in = p.shape[-1]
            p.normal_(0, fan_in**-0.5)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    for module in block.modules():
        if type(module).__name__ == "GptOssExperts":
            module.limit, module.alpha = config.swiglu_limit, getattr(config, "swiglu_alpha", 1.702)


def hf_forward(block, x):
    """A transformers MoE block on x [T, H] -> [T, H]. The blocks take [B, S, H]; some return
    the hidden states, some (hidden, router logits or scores) (Llama-4, gpt-oss)."""
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


# ---- timing (GPU) ----


def gpu_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median GPU time of fn() in ms: one call captured in a CUDA graph, its replays timed
    (L2 flushed between them). What the kernels cost, without the host's launch time."""
    fn()
    torch.cuda.synchronize()
    return graph_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def eager_ms(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of fn() called eagerly in ms (triton.testing.do_bench): what a user who
    calls the op from Python sees; the host's launch time counts where it exceeds the GPU's."""
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def host_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Host time per call in us: ``calls`` back-to-back calls and one sync at the end, best of
    ``repeats``. With tiny shapes the GPU keeps up, so this is the Python + launch cost."""
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def launched(fn) -> list[dict]:
    """Run fn() once and say which kernel configs it launched: one dict per launch with the
    kernel ``family``, the ``config``'s label (e.g. '128x256x64 w8 s3 pers TMA'), the
    triton.Config itself (``triton_config``) and where it came from (``source``: 'table',
    'tuned', 'heuristic', 'forced' or 'interpreter')."""
    from .core import configs, launch

    with launch.recording() as seen:
        fn()
    return [dict(family=x.family, config=configs.label(x.plan.config), triton_config=x.plan.config,
                 source=x.plan.source) for x in seen]


# ---- several processes (onegemm.ep) ----


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, args, results, timeout):
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, with its traceback
        results.put((rank, traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes (``fn`` and args picklable),
    each a rank of a gloo process group on 127.0.0.1 at a free port, destroyed when ``fn``
    returns. Raises AssertionError with every failing rank's traceback, or when the ranks
    have not finished within ``timeout`` seconds (they are then killed)."""
    # A fork server that has imported onegemm once forks the ranks: a rank then starts in
    # milliseconds instead of the seconds that importing torch takes (spawn), and it starts
    # from a clean process, not a fork of the caller's threads.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["onegemm"])
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, results, timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    done, failures = set(), []
    try:
        while len(done) < world and time.monotonic() < deadline:
            if results.empty():
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
                time.sleep(0.05)
                continue
            rank, error = results.get()
            done.add(rank)
            if error is not None:
                failures.append(f"rank {rank}:\n{error}")
                # The others may wait for it in a collective: a few seconds to report, then killed.
                deadline = min(deadline, time.monotonic() + 10)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) if len(done) == world else 0)
            if p.is_alive():
                p.kill()
                p.join()
    missing = sorted(set(range(world)) - done)
    if missing:
        why = "after another rank failed" if failures else f"within {timeout:.0f} s"
        failures.append(f"ranks {missing} did not finish {why} (killed) or died (exit codes "
                        f"{[p.exitcode for p in procs]})")
    assert not failures, "\n".join(failures)
