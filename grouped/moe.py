"""MoE expert FFN on grouped_matmul's kernel: sort by expert, two fused GEMMs, combine.

    y[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t)),   e = ids[t, j]

The (token, slot) pairs are sorted by expert on the device; GEMM1 gathers the token rows of x
inside the kernel and applies SwiGLU in its epilogue, GEMM2 multiplies by the routing weight in
its epilogue and writes each pair's row to its own place, and the top-k rows of a token are then
summed in a fixed order. No step reads a value back to the host, so a forward pass can be
captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core import checks, configs, hopper_configs
from ..core.dispatch import Cached, Op, Workspace, wants_grad
from ..core.launch import autotune_enabled
from ..blockscaled.quantize import quantize_fp8, quantize_int4, quantize_mxfp4
from ..core.runtime import cdiv, empty, empty_strided
from ..core.tiles import Combine
from ..core.scaling import BLOCKWISE, MXFP4_BLOCK, MXFP4_PREPACKED, SCALE_BLOCK, weight_4bit
from .kernels import NO_GROUPED_SCALES, NO_ROUTES, Routes, RowTiles, grouped_scales
from .moe_steps import (check_expert_scales, check_expert_weights, check_moe, check_routing, check_w4_experts,
                        expert_gemm, expert_launch, expert_weight_grads, moe_sizes, prep_step, routes_in_prep,
                        sort_by_expert, sort_parts)
from .moe_train import MOE_FP8_TRAIN
from .prepack import moe_experts, prepacked
from .ops import combine, combine_launch, grouped_matmul, row_tiles, swiglu_backward, swiglu_forward
from .routing import route, route_spec
from .wgmma import gluon_grouped_mode, wgmma_grouped_launch


def moe_ffn(x, w_gate_up, w_down, topk_weights, topk_ids, *, w_gate_up_scale=None, w_down_scale=None, x_scale=None,
            fp8_training=False):
    """SwiGLU expert FFN: y[t] = sum_j w[t,j] * W2_e(silu(W1_e x_t) * W3_e x_t), e = ids[t,j].

    x [T, H] (fp16, bf16, fp32); w_gate_up [E, 2I, H] (gate rows W1 then up rows W3);
    w_down [E, H, I]; topk_weights [T, k]; topk_ids [T, k] int32/int64 (ids outside [0, E)
    contribute nothing). Returns [T, H] in x's dtype. Deterministic: bitwise the same on a rerun.
    Differentiable in x, w_gate_up, w_down and topk_weights (docs/autograd.md); traceable by
    torch.compile.

    FP8 experts (DeepSeek-V3's format): w_gate_up and w_down in float8_e4m3fn with their
    128x128 block scales (the checkpoints' ``weight_scale_inv``): w_gate_up_scale
    [E, 2 * ceil(I/128), ceil(H/128)] (gate blocks, then up blocks: the stacked scales of the
    separately quantised gate_proj and up_proj) and w_down_scale [E, ceil(H/128), ceil(I/128)],
    fp32. x keeps its dtype; the activations are quantised per token in 1x128 blocks: x once
    before the gather, the SwiGLU output inside GEMM1's epilogue (GEMM1 writes it as fp8 plus
    scales). Not differentiable. ``x_scale``: x is already quantised (expert parallelism
    quantises before sending): x float8_e4m3fn [T, H] with its fp32 1x128 scales x_scale
    [T, ceil(H/128)] (quantize_fp8(x), any strides); nothing is quantised again and the output
    is bfloat16.

    4-bit experts (weight-only). MXFP4 (gpt-oss's format): w_gate_up [E, 2I, H/2] and w_down
    [E, H, I/2] of torch.float4_e2m1fn_x2 (two e2m1 values per element along the reduction
    dimension, the first in the lower nibble; H and I multiples of 32) with their e8m0 block
    scales w_gate_up_scale [E, 2I, H/32] and w_down_scale [E, H, I/32] (torch.float8_e8m0fnu,
    one per 32 values; gate rows then up rows, as above). INT4 (compressed-tensors' symmetric
    pack-quantized format): w_gate_up [E, 2I, H/8] and w_down [E, H, I/8] of torch.int32 (eight
    values along the reduction dimension, each stored as value + 8, the first lowest) with
    16-bit / fp32 group scales [E, 2I, H/g1] and [E, H, I/g2] (groups powers of two >= 32).
    x stays bf16 / fp16; both GEMMs dequantise the weights in core's K loop. Not differentiable.
    MXFP4 experts prepacked once (``onegemm.prepack_mxfp4``: w_gate_up with gate_up=True, its
    rows gate then up as above; w_down without) come as w_gate_up and w_down alone, no scales:
    the same values in the order the fast 4-bit K loop reads.

    ``fp8_training=True`` (high-precision experts; 2I and H multiples of 128): the expert GEMMs
    of the forward and of the input gradient run in FP8 with DeepSeek-V3's block scales (the
    experts quantised 128x128 on every call, activations and output gradients 1x128), the
    weight gradients and everything outside the expert GEMMs in x's dtype (grouped/moe_train.py).
    Differentiable as above, first order only.
    """
    if prepacked(w_gate_up, w_down):
        w_gate_up, w_down, w_gate_up_scale, w_down_scale = moe_experts(x, w_gate_up, w_down, w_gate_up_scale,
                                                                       w_down_scale)
    checks.check_optional_tensors(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids,
                                  w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale, x_scale=x_scale)
    fp8_weights = w_gate_up is not None and (w_gate_up.dtype in checks.FP8_DTYPES or bool(weight_4bit(w_gate_up)))
    if fp8_training is not False:  # (checked only when given: moe_ffn's hot path)
        checks.check_bool("fp8_training", fp8_training)
        if w_gate_up_scale is not None or w_down_scale is not None or x_scale is not None or fp8_weights:
            raise checks.bad_value("fp8_training", "False with fp8 experts or scales (FP8 training quantises "
                                   "high-precision experts itself)", fp8_training)
        return MOE_FP8_TRAIN.call(x, w_gate_up, w_down, topk_weights, topk_ids)[0]
    if w_gate_up_scale is not None or w_down_scale is not None or x_scale is not None or fp8_weights:
        return MOE_FP8.call(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale)
    if wants_grad(x, w_gate_up, w_down, topk_weights):  # training: GEMM1's output is kept for the backward
        return MOE_TRAIN.call(x, w_gate_up, w_down, topk_weights, topk_ids)[0]
    return MOE.call(x, w_gate_up, w_down, topk_weights, topk_ids)


def moe_routed(x, logits, w_gate_up, w_down, correction_bias=None, w_gate_up_scale=None, w_down_scale=None, *,
               top_k: int, renormalize: bool = True, scoring: str = "softmax", n_group: int = 1, topk_group=None,
               routed_scaling_factor: float = 1.0):
    """``moe_ffn(x, w_gate_up, w_down, *route(logits, top_k, ...), ...)`` without a gradient
    (MoEFFN's inference forward): up to configs.ROUTED_PREP_MAX_ELEMENTS logits the prep
    launch routes the tokens itself (moe_steps.routes_in_prep), so a decode call is the
    prep and the two GEMMs. The arguments are route's and moe_ffn's."""
    if prepacked(w_gate_up, w_down):
        w_gate_up, w_down, w_gate_up_scale, w_down_scale = moe_experts(x, w_gate_up, w_down, w_gate_up_scale,
                                                                       w_down_scale)
    return MOE_ROUTED(x, logits, w_gate_up, w_down, correction_bias, w_gate_up_scale, w_down_scale, top_k, renormalize,
                      scoring, n_group, topk_group, routed_scaling_factor)


def _moe_routed_record(x, logits, w_gate_up, w_down, correction_bias, w_gate_up_scale, w_down_scale, top_k,
                       renormalize, scoring, n_group, topk_group, routed_scaling_factor):
    """moe_routed's path for its arguments' signature: route's and moe_ffn's checks on a first
    routing (the build's example weights and ids), then moe_ffn's record with the prep routing."""
    checks.check_not_differentiable("moe_routed (inference only: MoEFFN trains through route and moe_ffn)", x=x,
                                    logits=logits, w_gate_up=w_gate_up, w_down=w_down, correction_bias=correction_bias)
    choices = dict(scoring=scoring, n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    weights, ids = route(logits, top_k, renormalize, correction_bias=correction_bias, **choices)
    checks.check_tensor("x", x, ndim=2)
    if logits.shape[0] != x.shape[0]:
        raise checks.bad_shape("logits", f"[T, E] with T = {x.shape[0]} (x's rows)", logits.shape)
    scales = dict(w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
    spec = route_spec(logits.shape[1], top_k, renormalize, scoring, correction_bias is not None, n_group, topk_group)
    if not routes_in_prep(x.shape[0], top_k, spec) or (correction_bias is not None and correction_bias.stride(0) != 1):
        def route_first(x, logits, w_gate_up, w_down, correction_bias, w_gate_up_scale, w_down_scale):
            weights, ids = route(logits, top_k, renormalize, correction_bias=correction_bias, **choices)
            return moe_ffn(x, w_gate_up, w_down, weights, ids, w_gate_up_scale=w_gate_up_scale,
                           w_down_scale=w_down_scale)

        return route_first
    fused = (spec, float(routed_scaling_factor))
    if w_gate_up_scale is None and w_down_scale is None and not weight_4bit(w_gate_up):
        run = _moe_record(x, w_gate_up, w_down, weights, ids, route=fused)
    else:
        run = _moe_fp8_record(x, w_gate_up, w_down, weights, ids, *scales.values(), route=fused)
    return lambda x, logits, w13, w2, bias, s13, s2: run(x, w13, w2, logits, bias, s13, s2)


def quantize_experts(w_gate_up, w_down, *, format: str = "fp8", group: int = 32):
    """Expert weights -> moe_ffn's quantised experts: (w_gate_up, w_gate_up_scale, w_down, w_down_scale).

    w_gate_up [E, 2I, H], w_down [E, H, I] (fp32, bf16, fp16). ``format``:
    "fp8": each expert's matrix quantised to float8_e4m3fn in 128x128 blocks (quantize_fp8), the
    gate and up halves apart, as the DeepSeek-V3 format stores gate_proj and up_proj: scales
    [E, 2 * ceil(I/128), ceil(H/128)] and [E, ceil(H/128), ceil(I/128)]; one launch per matrix.
    "mxfp4" (H and I multiples of 32): MXFP4 as gpt-oss stores it, every row's 32-value blocks
    along the reduction dimension (the OCP MX rule): w_gate_up [E, 2I, H/2] and w_down
    [E, H, I/2] in float4_e2m1fn_x2, scales [E, 2I, H/32] and [E, H, I/32] in float8_e8m0fnu.
    "int4" (H and I multiples of ``group``, a power of two >= 32): compressed-tensors' symmetric
    pack-quantized INT4 (blockscaled.quantize_int4), every row's ``group``-value groups along the
    reduction dimension: w_gate_up [E, 2I, H/8] and w_down [E, H, I/8] in int32, scales
    [E, 2I, H/group] and [E, H, I/group] in the weights' dtype. A one-time conversion.
    """
    checks.check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=checks.FLOAT_DTYPES)
    checks.check_tensor("w_down", w_down, ndim=3, dtypes=(w_gate_up.dtype,))
    check_expert_weights(w_gate_up, w_down, w_gate_up.shape[2])
    checks.check_choice("format", format, ("fp8", "mxfp4", "int4"))
    I = w_down.shape[2]
    if format == "mxfp4":
        if w_gate_up.shape[2] % MXFP4_BLOCK or I % MXFP4_BLOCK:
            raise checks.bad_shape("w_gate_up", f"[E, 2I, H] with H and I multiples of {MXFP4_BLOCK} for "
                                   "format='mxfp4' (its 32-value blocks along H and I)", w_gate_up.shape)
        q13, s13 = quantize_mxfp4(w_gate_up)
        q2, s2 = quantize_mxfp4(w_down)
        return q13, s13, q2, s2
    if format == "int4":
        checks.check_int("group", group)
        if w_gate_up.shape[2] % group or I % group:
            raise checks.bad_shape("w_gate_up", f"[E, 2I, H] with H and I multiples of group ({group}) for "
                                   "format='int4'", w_gate_up.shape)
        q13, s13 = quantize_int4(w_gate_up, group)
        q2, s2 = quantize_int4(w_down, group)
        return q13, s13, q2, s2

    def blocks(w):
        qs = [quantize_fp8(m, (SCALE_BLOCK, SCALE_BLOCK)) for m in w.detach()]
        return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])

    with torch.no_grad():
        gate_q, gate_s = blocks(w_gate_up[:, :I])
        up_q, up_s = blocks(w_gate_up[:, I:])
        down_q, down_s = blocks(w_down)
    return torch.cat([gate_q, up_q], 1), torch.cat([gate_s, up_s], 1), down_q, down_s


def _moe_impl(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    return MOE.direct(x, w_gate_up, w_down, topk_weights, topk_ids)


def _moe_record(x, w_gate_up, w_down, topk_weights, topk_ids, route=None):
    """moe_ffn's full path for its arguments' signature: the checks, then the sort's and both
    GEMMs' launches made once, as one callable of the five tensors."""
    check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return _moe_pipeline(x, w_gate_up, w_down, topk_weights, topk_ids, route=route)


class _Intermediates:
    """moe_ffn's intermediates for one call signature: where each lives in the call's one
    workspace (core/dispatch.py Workspace: the sort's pair / token / offs, x's rows in fp8
    ``xq`` and their 1x128 scales ``xs`` stored [kh, rows] (rows: P in sorted order with
    ``sorted_x``, else T in token order, which GEMM1 gathers), h and its scales ``hs``
    stored [ki, P], ``y_pairs``; then what ``complete`` adds), and the tensors each step of the
    pipeline takes from it, in its launch builder's order (each step's ``.on``)."""

    def __init__(self, sizes, device, dtype, h_dtype, fp8_dtype, fp8: bool, quantize_x: bool, w4: bool = False,
                 sorted_x: bool = False, route=None):
        T, H, E, I, k, P = sizes
        kh, ki = cdiv(H, SCALE_BLOCK), cdiv(I, SCALE_BLOCK)
        parts = dict(zip(("pair", "token", "offs"), sort_parts(P, E)))
        if route is not None:  # the prep routes: its weights and ids
            parts.update(weights=((T, k), torch.float32), ids=((T, k), torch.int32))
        if quantize_x or sorted_x:
            rows = P if sorted_x else T
            parts.update(xq=((rows, H), fp8_dtype), xs=((kh, rows), torch.float32))
        parts["h"] = ((P, I), h_dtype)
        if fp8:
            parts["hs"] = ((ki, P), torch.float32)
        parts["y_pairs"] = ((P, H), dtype)
        self.sizes, self.device, self.parts = sizes, device, parts
        self.fp8, self.quantize_x, self.w4, self.tables, self.tickets = fp8, quantize_x, w4, 0, False
        self.route = route  # (kernels.RouteSpec, the routed scaling factor) or None
        self.complete()

    def complete(self, tickets: int = 0, block_ms: tuple = ()):
        """Add the parts that the GEMMs' plans size: GEMM2's combine tickets (``tickets``
        int32, core/tiles.py Combine) and the row-tile tables of each of ``block_ms`` (the Gluon
        GEMMs' kernels.RowTiles), after the others, which keep their places."""
        T, H, E, I, k, P = self.sizes
        if tickets:
            self.parts["tickets"], self.tickets = ((tickets,), torch.int32), True
        for i, block_m in enumerate(block_ms):
            self.parts.update({f"sched{i}": ((cdiv(P, block_m) + E + 1, 4), torch.int32), f"count{i}": ((1,), torch.int32)})
        self.tables = len(block_ms)
        self.names = tuple(self.parts)
        self.workspace = Workspace(self.device, *self.parts.values())
        self._h = self.names.index("h")

    def views(self, buffer) -> dict:
        out = dict(zip(self.names, self.workspace.parts(buffer)))
        for name in ("xs", "hs"):  # 1x128 scales: [rows, kb] views of their [kb, rows] storage
            if name in out:
                out[name] = out[name].t()
        return out

    def h(self, buffer):
        """h's part alone (the training forward's SwiGLU writes it)."""
        return self.workspace.part(buffer, self._h)

    def prep_tensors(self, ids, x, buffer, weights):
        """The prep's (moe_steps.prep_step): the sort's outputs, x's quantised rows, the
        tickets to zero, the row-tile tables; routed, the logits it routes and their bias (in
        the weights' and the ids' places: moe_routed's order) and the routing it writes."""
        v = self.views(buffer)
        routes = NO_ROUTES
        if self.route is not None:
            logits, bias = weights, ids
            ids, routes = v["ids"], Routes(logits, *logits.stride(), bias, v["weights"], self.route[1])
        return ((ids, v["pair"], v["token"], v["offs"]) + ((x, v["xq"], v["xs"]) if self.quantize_x else (None,) * 3)
                + (v.get("tickets"), self.row_tiles(v), routes))

    def routing(self, v, weights, ids):
        """GEMM2's routing weights (fp32 [P]) and the ids (for the combine): the call's, or
        the prep's when it routes."""
        return (v["weights"].view(-1), v["ids"]) if self.route is not None else (weights, ids)

    def row_tiles(self, v) -> tuple:
        return tuple(RowTiles(v[f"sched{i}"], v[f"count{i}"]) for i in range(self.tables))

    def scales1(self, v, x_scale, w_gate_up_scale):
        """GEMM1's tiles.Scales (FP8 experts): x's rows' (gathered in the kernel, like the rows), W13's, h's
        (written); 4-bit experts: W13's scales (MXFP4's e8m0 as bytes)."""
        if self.w4:
            return grouped_scales(b=_w4_scale(w_gate_up_scale))
        if not self.fp8:
            return NO_GROUPED_SCALES
        return grouped_scales(a=v["xs"] if self.quantize_x else x_scale, b=w_gate_up_scale.transpose(1, 2), out=v["hs"])

    def scales2(self, v, w_down_scale):
        if self.w4:
            return grouped_scales(b=_w4_scale(w_down_scale))
        return grouped_scales(a=v["hs"], b=w_down_scale.transpose(1, 2)) if self.fp8 else NO_GROUPED_SCALES

    def gemm1_tensors(self, c, buffer, x, x_scale, w_gate_up, w_gate_up_scale):
        """GEMM1's: h (or the pre-activation ``c``) of x's rows token[r], gathered in the
        kernel (from the prep's quantised rows when it quantised them)."""
        v = self.views(buffer)
        return ((v["h"] if c is None else c), v["xq"] if self.quantize_x else x, w_gate_up, v["offs"], v["token"], None,
                None, self.scales1(v, x_scale, w_gate_up_scale))

    def fused_gemm1_tensors(self, buffer, *rest):
        return self.gemm1_tensors(None, buffer, *rest)

    def gemm2_tensors(self, buffer, w_down, w_down_scale, weights, out, ids):
        """GEMM2's: y_pairs[pair[r]] = w[pair[r]] * (h[r] @ W2_e^T) (scattered), and out[t]
        the sum of token t's rows (tiles.Combine, on the tickets the prep zeroed)."""
        v = self.views(buffer)
        T, H, E, I, k, P = self.sizes
        weights, ids = self.routing(v, weights, ids)
        combine = Combine(out, *out.stride(), v["tickets"], ids, *ids.stride(), k, E)
        return (v["y_pairs"], v["h"], w_down, v["offs"], None, v["pair"], weights.view(-1), self.scales2(v, w_down_scale),
                combine)

    def wgmma1_tensors(self, buffer, w_gate_up, w_gate_up_scale):
        """The Gluon GEMM1's (wgmma.wgmma_grouped_launch): h of x's sorted fp8 rows, the first table."""
        v = self.views(buffer)
        return (v["xq"], w_gate_up, v["h"], self.row_tiles(v)[0], v["xs"], w_gate_up_scale.transpose(1, 2), None, None,
                None, v["hs"])

    def wgmma2_tensors(self, buffer, w_down, w_down_scale, weights):
        """The Gluon GEMM2's: y_pairs[pair[r]] = w[pair[r]] * (h[r] @ W2_e^T), the last table."""
        v = self.views(buffer)
        return (v["h"], w_down, v["y_pairs"], self.row_tiles(v)[-1], v["hs"], w_down_scale.transpose(1, 2), None,
                v["pair"], self.routing(v, weights, None)[0], None)

    def combine_tensors(self, out, buffer, ids):
        v = self.views(buffer)
        return out, v["y_pairs"], self.routing(v, None, ids)[1]


def _moe_pipeline(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None, x_scale=None,
                  keep_pre=False, route=None):
    """The prep (the sort), GEMM1 (gather + SwiGLU), GEMM2 (routing weight, scatter, and the
    top-k combine after its stores): their plans and grids made here, once; the callable runs
    them on a call's tensors, three launches at decode sizes.

    GEMM1: h[r] = silu(x[token[r]] @ W1_e^T) * (x[token[r]] @ W3_e^T), rows sorted by expert;
    B = w_gate_up[e].T, read in place (stride 1 along K: the K-major layout Hopper wants).
    GEMM2 writes y_pairs[pair[r]] = w[pair[r]] * (h[r] @ W2_e^T) in x's dtype (16-bit x: half
    an fp32 intermediate's bytes). The combine (core/tiles.py combine_pairs, in GEMM2: the
    last of a token's k rows stored sums them) adds the k rows in slot order in fp32, no
    atomics on values: the same bits on every run. One workspace per call holds the rest.

    FP8 experts (the scales given): the prep quantises x's rows once per token (the Gluon
    pipeline, which cannot gather, once per pair); GEMM1 gathers them and writes
    silu(gate) * up as fp8 with its 1x128 scales, stored [ceil(I/128), P] (the outer-dim-major
    layout quantize_fp8 gives, so GEMM2's K loop reads them coalesced). ``x_scale``: x is
    already quantised (fp8 rows, 1x128 scales): nothing is quantised again; bfloat16 out.

    ``keep_pre`` (16/32-bit experts; moe_ffn's training forward): GEMM1 writes its
    pre-activation h_pre [P, 2I] (gate | up, sorted rows) in fp32 instead of fusing SwiGLU,
    SwiGLU runs on those fp32 sums (ops.swiglu_forward, one pass; what the fused epilogue computes),
    and the callable returns (y, h_pre): the backward keeps h_pre rather than recomputing
    GEMM1, the largest of the expert GEMMs.

    ``route`` (moe_routed: a kernels.RouteSpec, the scaling factor): the prep routes; the build's
    topk_weights / topk_ids are examples, the callable's are the logits and the bias (or None).
    """
    sizes = moe_sizes(x, w_gate_up, topk_ids)
    T, H, E, I, k, P = sizes
    device, dtype = x.device, _out_dtype(x)
    if P == 0:
        if keep_pre:
            return lambda x, *rest: (torch.zeros_like(x), x.new_empty((0, 2 * I), dtype=torch.float32))
        return lambda x, *rest: torch.zeros_like(x, dtype=dtype)
    w4 = weight_4bit(w_gate_up)  # weight-only: x, h and the GEMMs' operands in x's dtype
    fp8 = w_gate_up_scale is not None and not w4
    quantize_x = fp8 and x_scale is None
    h_dtype = w_gate_up.dtype if fp8 else dtype
    inter = _Intermediates(sizes, device, dtype, h_dtype, w_gate_up.dtype, fp8, quantize_x, bool(w4), route=route)
    # a 4-bit GEMM's (format, values per scale along K): H / GEMM1's scale columns, I / GEMM2's
    w4_1, w4_2 = _w4_gemms(w4, w_gate_up, w_gate_up_scale, w_down_scale, H, I)
    prep = prep_step(topk_ids, E, x if quantize_x else None, w_gate_up.dtype, route=route and route[0], sorted_x=False)
    prep = prep.on(inter.prep_tensors)
    # the routing weights as GEMM2 reads them: fp32, one per pair (a view when they are already)
    fp32_weights = route is not None or topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
    v = inter.views(buffer := inter.workspace.new())
    if autotune_enabled():  # the GEMMs' trials gather and scatter by v's indices: this call's, not stale memory
        prep(topk_ids, x, buffer, topk_weights)
    a1, a_rows = (v["xq"] if quantize_x else x), v["token"]  # the prep's quantised rows, or x's, gathered
    weights = topk_weights.to(torch.float32).contiguous()
    if keep_pre:
        gemm1 = expert_launch(a1, w_gate_up, empty((P, 2 * I), dtype=torch.float32, device=device), v["offs"],
                              a_rows=a_rows).on(inter.gemm1_tensors)
    else:
        gemm1 = expert_launch(a1, w_gate_up, v["h"], v["offs"], a_rows=a_rows, swiglu=True, w4=w4_1,
                              scales=inter.scales1(v, x_scale, w_gate_up_scale),
                              **(dict(scaling=BLOCKWISE._replace(fp8_out=True)) if fp8 else {}))
        gemm1 = gemm1.on(inter.fused_gemm1_tensors)
    gemm2 = expert_launch(v["h"], w_down, v["y_pairs"], v["offs"], c_rows=v["pair"], weight=weights.view(-1),
                          scales=inter.scales2(v, w_down_scale), w4=w4_2, **(dict(scaling=BLOCKWISE) if fp8 else {}))
    inter.complete(tickets=16 * cdiv(T * cdiv(H, gemm2.plan.meta["BLOCK_N"]), 16))  # per (token, column tile); 16s keep 1 int class
    gemm2 = gemm2.on(inter.gemm2_tensors)
    new_buffer = inter.workspace.new

    def run(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None, x_scale=None):
        buffer = new_buffer()
        prep(topk_ids, x, buffer, topk_weights)
        if keep_pre:
            h_pre = empty((P, 2 * I), dtype=torch.float32, device=device)
            gemm1(h_pre, buffer, x, x_scale, w_gate_up, w_gate_up_scale)
            swiglu_forward(h_pre, h_dtype, out=inter.h(buffer))
        else:
            gemm1(buffer, x, x_scale, w_gate_up, w_gate_up_scale)
        y = empty_strided((T, H), (H, 1), dtype=dtype, device=device)
        gemm2(buffer, w_down, w_down_scale, topk_weights if fp32_weights else topk_weights.to(torch.float32).contiguous(),
              y, topk_ids)
        return (y, h_pre) if keep_pre else y

    return run


def _check_moe_fp8(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale=None):
    if w_gate_up is not None and weight_4bit(w_gate_up):
        return _check_moe_w4(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale)
    x_dtypes = checks.FLOAT_DTYPES if x_scale is None else (torch.float8_e4m3fn,)
    check_moe(x, w_gate_up, w_down, topk_weights, topk_ids, weight_dtypes=(torch.float8_e4m3fn,), x_dtypes=x_dtypes)
    check_expert_scales(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    if x_scale is not None:
        checks.check_tensor("x_scale", x_scale, ndim=2, dtypes=(torch.float32,))
        T, H = x.shape
        checks.check_shape("x_scale", x_scale, (T, cdiv(H, SCALE_BLOCK)), f"[T, ceil(H/128)] = {[T, cdiv(H, SCALE_BLOCK)]} "
                           "(x's 1x128 scales, as quantize_fp8(x) gives)")
        checks.check_same_device(x=x, x_scale=x_scale)


def _check_moe_w4(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale):
    """4-bit experts (check_w4_experts) under a bf16 / fp16 x [T, H], nothing quantised."""
    checks.check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    if x_scale is not None:
        raise checks.bad_value("x_scale", f"None with {weight_4bit(w_gate_up).upper()} experts (weight-only: x is not "
                               "quantised)", "a tensor")
    check_w4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, x.shape[1])
    check_routing(x, topk_weights, topk_ids)
    checks.check_same_device(x=x, w_gate_up=w_gate_up)


def _w4_gemms(w4, w_gate_up, w_gate_up_scale, w_down_scale, H, I):
    """The two GEMMs' ``w4`` (ragged_launch's): (format, values per scale along K, fragment
    order), (None, None) for other experts. Prepacked experts pad K: their group is MXFP4's."""
    if not w4:
        return None, None
    if w_gate_up.dtype == MXFP4_PREPACKED:
        return (w4, MXFP4_BLOCK, True), (w4, MXFP4_BLOCK, True)
    return (w4, H // w_gate_up_scale.shape[2], False), (w4, I // w_down_scale.shape[2], False)


def _w4_scale(scale):
    """A 4-bit expert stack's scales [E, rows, K / group] as the GEMM reads them: transposed, an
    e8m0 (MXFP4) scale as its bytes."""
    scale = scale.transpose(1, 2)
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _out_dtype(x):
    """moe_ffn's output dtype: x's, bfloat16 for an already-quantised fp8 x."""
    return torch.bfloat16 if x.dtype in checks.FP8_DTYPES else x.dtype


def _moe_fp8_impl(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w_gate_up_scale: Optional[torch.Tensor],
                  w_down_scale: Optional[torch.Tensor], x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """moe_ffn with fp8 experts: _moe_impl's pipeline on fp8 operands with 1x128 x 128x128 scales."""
    return MOE_FP8.direct(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale)


def _moe_fp8_no_grad(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale=None):
    what = f"moe_ffn with {(weight_4bit(w_gate_up) or 'fp8').upper().replace('FP8', 'fp8')} experts"
    checks.check_not_differentiable(what, x=x, w_gate_up=w_gate_up, w_down=w_down,
                                    topk_weights=topk_weights, w_gate_up_scale=w_gate_up_scale,
                                    w_down_scale=w_down_scale, x_scale=x_scale)


def _moe_fp8_record(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale=None,
                    route=None):
    """The FP8 moe_ffn's full path for its arguments' signature: the checks, then the Gluon
    pipeline (on sm_90, ``wgmma.gluon_grouped_mode``) or the Triton body's (_moe_pipeline);
    ``route``: _moe_pipeline's."""
    _check_moe_fp8(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale)
    _moe_fp8_no_grad(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale)
    T, H, E, I, k, P = moe_sizes(x, w_gate_up, topk_ids)
    mode = gluon_grouped_mode(w_gate_up, P, E, moe=True) if P else None
    if mode is not None and gluon_grouped_mode(w_down, P, E, moe=True) == mode:
        return _moe_fp8_wgmma_pipeline(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale,
                                       x_scale, mode, route)
    return _moe_pipeline(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale,
                         route=route)


def _moe_fp8_wgmma_pipeline(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale,
                            mode, route=None):
    """The FP8 expert FFN on core's Gluon body (sm_90; ``mode`` "grouped" or "decode", from
    wgmma.gluon_grouped_mode), its launches made once: TMA cannot gather rows, so the prep
    (moe_steps.prep_step: one launch at decode sizes) writes x's rows quantised in
    expert-sorted order with the GEMMs' row-tile tables; GEMM1 (its two warpgroups the gate
    and the up product) writes silu(gate) * up as fp8 with 1x128 scales; GEMM2 scatters each
    pair's weighted row; the combine sums each token's rows in slot order (fp32). The rows
    of experts on other ranks get no tiles. At decode both GEMMs compute their tiles
    transposed (the weights' rows on wgmma's 64-row side, the few tokens of an expert on its
    N side). An already-quantised x (``x_scale``) has its rows and scales gathered as they are.
    ``route``: _moe_pipeline's."""
    sizes = moe_sizes(x, w_gate_up, topk_ids)
    T, H, E, I, k, P = sizes
    out_dtype = _out_dtype(x)
    quantize_x = x_scale is None
    inter = _Intermediates(sizes, x.device, out_dtype, w_gate_up.dtype, w_gate_up.dtype, True, quantize_x,
                           sorted_x=True, route=route)
    v = inter.views(inter.workspace.new())
    prep_step(topk_ids, E)(topk_ids, v["pair"], v["token"], v["offs"])  # real tables for autotuning's trials
    m = configs.m_bucket(P // E)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    schedule = lambda block_m: row_tiles(v["offs"], E, P, block_m, tail=False)  # noqa: E731
    gemm1 = wgmma_grouped_launch(v["xq"], w_gate_up, v["h"], schedule, v["xs"], w_gate_up_scale.transpose(1, 2), N=I,
                                 out_scale=v["hs"], key=hopper_configs.WgmmaKey(
                                     m, I, H, BLOCKWISE, "fp8", "swiglu" if mode == "grouped" else "decode_swiglu"))
    gemm2 = wgmma_grouped_launch(v["h"], w_down, v["y_pairs"], schedule, v["hs"], w_down_scale.transpose(1, 2), N=H,
                                 scatter=v["pair"], weight=weights, key=hopper_configs.WgmmaKey(
                                     m, H, I, BLOCKWISE, configs.dtype_name(out_dtype), mode))
    block_ms = tuple(dict.fromkeys((gemm1.plan.meta["BLOCK_M"], gemm2.plan.meta["BLOCK_M"])))  # one table if the same
    inter.complete(block_ms=block_ms)  # the tables the prep writes: GEMM1 reads the first, GEMM2 the last
    prep = prep_step(topk_ids, E, x if quantize_x else None, w_gate_up.dtype, block_ms, route and route[0])
    prep = prep.on(inter.prep_tensors)
    gemm1, gemm2 = gemm1.on(inter.wgmma1_tensors), gemm2.on(inter.wgmma2_tensors)
    combine = combine_launch(v["y_pairs"], topk_ids, E, out_dtype).on(inter.combine_tensors)
    new_buffer = inter.workspace.new
    fp32_weights = route is not None or topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()

    def run(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale=None):
        buffer = new_buffer()
        prep(topk_ids, x, buffer, topk_weights)
        if x_scale is not None:  # fp8 rows move as bytes (torch indexes no float8 dtype on every device)
            u = inter.views(buffer)
            torch.index_select(x.view(torch.uint8), 0, u["token"], out=u["xq"].view(torch.uint8))
            u["xs"].copy_(x_scale.index_select(0, u["token"]))
        gemm1(buffer, w_gate_up, w_gate_up_scale)
        gemm2(buffer, w_down, w_down_scale, topk_weights.view(-1) if fp32_weights else
              topk_weights.reshape(-1).to(torch.float32).contiguous())  # (unread when routed)
        y = empty_strided((T, H), (H, 1), dtype=out_dtype, device=x.device)
        combine(y, buffer, topk_ids)
        return y

    return run


def _moe_fp8_fake(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale=None):
    _check_moe_fp8(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, x_scale)
    return torch.empty_like(x, dtype=_out_dtype(x))


def _moe_train_impl(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return MOE_TRAIN.direct(x, w_gate_up, w_down, topk_weights, topk_ids)


def _moe_train_record(x, w_gate_up, w_down, topk_weights, topk_ids):
    """moe_ffn's forward when it records gradients -> (y, h_pre): ``_moe_pipeline`` keeping
    GEMM1's fp32 pre-activation for the backward."""
    check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return _moe_pipeline(x, w_gate_up, w_down, topk_weights, topk_ids, keep_pre=True)


def _moe_train_fake(x, w_gate_up, w_down, topk_weights, topk_ids):
    check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    P = topk_ids.shape[0] * topk_ids.shape[1]
    return torch.empty_like(x), x.new_empty((P, w_gate_up.shape[1]), dtype=torch.float32)


def _moe_train_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _moe_train_backward(ctx, dy, _):
    *inputs, h_pre = ctx.saved_tensors
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # double backward: as _moe_backward
        dx, dw13, dw2, dweights = _moe_grads(dy, *inputs, differentiable=True)
    else:
        dx, dw13, dw2, dweights = MOE_BACKWARD(dy, *inputs, h_pre)
    return dx, dw13, dw2, dweights, None


def _moe_fake(x, w_gate_up, w_down, topk_weights, topk_ids):
    check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return torch.empty_like(x)


def _moe_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _moe_backward(ctx, dy):
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # create_graph=True: these gradients are differentiated in turn, so every piece of
        # them must be differentiable (GEMM1's recompute included).
        dx, dw13, dw2, dweights = _moe_grads(dy, *ctx.saved_tensors, differentiable=True)
    else:
        dx, dw13, dw2, dweights = MOE_BACKWARD(dy, *ctx.saved_tensors)
    return dx, dw13, dw2, dweights, None


def _moe_backward_impl(dy: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, h_pre: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _moe_grads(dy, x, w_gate_up, w_down, topk_weights, topk_ids, differentiable=False, h_pre=h_pre)


def _moe_grads(dy, x, w_gate_up, w_down, topk_weights, topk_ids, differentiable: bool, h_pre=None):
    """moe_ffn's gradients (dx, dw_gate_up, dw_down, dtopk_weights) in the same sorted order
    as the forward, with onegemm's grouped GEMMs; every sum runs in a fixed order, so two
    backward passes give the same bits. A registered op of its own: under torch.compile the
    backward is traced as one call, like the forward.

    The routing sort is recomputed. GEMM1's pre-activation [P, 2I] is ``h_pre`` when the
    forward kept it (moe_ffn's training forward, ``_moe_train_record``), else recomputed (one
    extra grouped GEMM: the registered moe_ffn op keeps nothing but its inputs).
    Rows r are (token, slot) pairs sorted by expert e, g/u the gate/up halves of GEMM1:
      dh_u = dy[token] @ W2_e;  dw[pair] = <dh_u, h>;  dh = w * dh_u
      dg = dh * u * silu'(g);  du = dh * silu(g);  dx[token] += [dg, du] @ W13_e
      dW13_e = [dg, du]_e^T @ x[token]_e;  dW2_e = dy[token]_e^T @ (w * h)_e
    ``differentiable`` (double backward): GEMM1 runs as grouped_matmul on the gathered rows
    x[token] (one [P, H] copy) instead of the gathering kernel, which autograd cannot see
    into; every other step is already a differentiable op.
    """
    T, H, E, I, k, P = moe_sizes(x, w_gate_up, topk_ids)
    if P == 0:
        return torch.zeros_like(x), torch.zeros_like(w_gate_up), torch.zeros_like(w_down), torch.zeros_like(topk_weights)
    pair, token, offs = sort_by_expert(topk_ids, E)
    w_s = topk_weights.reshape(-1)[pair].float()
    dy_x = dy.to(x.dtype)
    if differentiable:
        pair = pair.long()
        h_pre = grouped_matmul(x[token], w_gate_up.transpose(1, 2), offs)
        g, u = h_pre[:, :I].float(), h_pre[:, I:].float()
        sig = torch.sigmoid(g)
        silu = g * sig
        h = silu * u
        dh_u = grouped_matmul(dy_x[token], w_down, offs, out_dtype=torch.float32)  # [P, I]: b = W2_e [H, I]
        dweights = torch.empty(P, device=x.device, dtype=torch.float32)
        dweights[pair] = (dh_u * h).sum(1)
        dh = dh_u * w_s[:, None]
        dh_pre = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * silu], dim=1).to(x.dtype)
        h_w = (h * w_s[:, None]).to(x.dtype)
        dx_pairs = torch.empty(P, H, device=x.device, dtype=torch.float32)
        dx_pairs[pair] = grouped_matmul(dh_pre, w_gate_up, offs, out_dtype=torch.float32)  # [P, H]: b = W13_e
        dx = dx_pairs.view(T, k, H).sum(1).to(x.dtype)
    else:  # the gathers and the scatter inside the GEMMs, the activation's backward in one pass
        if h_pre is None:
            h_pre = empty((P, 2 * I), dtype=x.dtype, device=x.device)
            expert_gemm(x, w_gate_up, h_pre, offs, a_rows=token)
        dh_u = empty((P, I), dtype=torch.float32, device=x.device)
        expert_gemm(dy_x, w_down.transpose(1, 2), dh_u, offs, a_rows=token)
        dh_pre, h_w, dw_s = swiglu_backward(h_pre, dh_u, w_s.contiguous(), x.dtype)
        dweights = torch.empty(P, device=x.device, dtype=torch.float32)
        dweights[pair] = dw_s
        dx_pairs = empty((P, H), dtype=torch.float32, device=x.device)
        expert_gemm(dh_pre, w_gate_up.transpose(1, 2), dx_pairs, offs, c_rows=pair)
        dx = combine(dx_pairs, topk_ids, E, x.dtype)
    dw13, dw2 = expert_weight_grads(dh_pre, dy_x, x, h_w, token, offs, w_gate_up.dtype, w_down.dtype)
    return dx, dw13, dw2, dweights.view(T, k).to(topk_weights.dtype)


def _moe_backward_fake(dy, x, w_gate_up, w_down, topk_weights, topk_ids, h_pre=None):
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down), torch.empty_like(topk_weights)


MOE_BACKWARD = Op("moe_ffn_backward", _moe_backward_impl, _moe_backward_fake)
MOE = Op("moe_ffn", _moe_impl, _moe_fake, _moe_setup, _moe_backward, record=_moe_record, tensors=5)
MOE_TRAIN = Op("moe_ffn_train", _moe_train_impl, _moe_train_fake, _moe_train_setup, _moe_train_backward,
               record=_moe_train_record, tensors=5)
# FP8 experts: a registered op of its own (optional scale tensors on moe_ffn's schema would
# be traced on every bf16 call too), without a gradient.
MOE_ROUTED = Cached(7, lambda args: _moe_routed_record(*args))
MOE_FP8 = Op("moe_ffn_fp8", _moe_fp8_impl, _moe_fp8_fake, record=_moe_fp8_record, tensors=8, no_grad=_moe_fp8_no_grad)
