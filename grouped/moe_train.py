"""moe_ffn's FP8 training (``moe_ffn(..., fp8_training=True)``): high-precision master experts,
the expert GEMMs of the forward and of the input gradient in FP8 with block scales.

The recipe is DeepSeek-V3's, on the grouped flavour of core's FP8 body: each GEMM's operands
are quantised along its own reduction dim, activations and output gradients in 1x128 blocks,
the experts in 128x128 blocks. Every step quantises each expert stack once; its blocks serve
W and W^T (the block grid is transpose-symmetric), and the same quantiser call writes W^T's
fp8 copy (quantize_fp8(..., transposed=True)), which the backward's GEMMs read K-major with
the experts side by side along K. The router, the SwiGLU, the combine and the two weight gradients stay in
high precision (the grouped FP8 body has no ragged-K mode, which the weight gradients need).

Rows r are the (token, slot) pairs sorted by expert e; g | u the gate and up halves of GEMM1:
    forward   h_pre = q(x[token]) @ q(W13_e)^T;   h = silu(g) * u;   y_pairs[pair] = w * q(h) @ q(W2_e)^T
    backward  dh_u = q(dy[token]) @ q(W2_e);      dh_pre, dw = SwiGLU backward
              dx_pairs[pair] = q(dh_pre) @ q(W13_e);  dW13_e = dh_pre_e^T @ x[token]_e;  dW2_e = dy[token]_e^T @ (w h)_e
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..blockscaled.quantize import QUANTIZE_OP, QUANTIZE_T_OP
from ..core import checks, configs, hopper_configs
from ..core.dispatch import Op, first_order_only
from ..core.runtime import cdiv, empty
from ..core.scaling import BLOCKS, BLOCKWISE, ROW_BLOCKS, SCALE_BLOCK
from .kernels import grouped_scales
from .moe_steps import check_moe, expert_gemm, expert_weight_grads, moe_sizes, sort_by_expert, sorter
from .ops import combine, gather_quantize, row_tiles, swiglu_backward, swiglu_quantize
from .wgmma import gluon_grouped_mode, run_wgmma_grouped

E4M3 = torch.float8_e4m3fn


class Experts(NamedTuple):
    """One expert matrix stack in fp8 for one GEMM: w [E, N, K] (stacked, or side by side
    along K) and its 128x128 scales of W^T [E, ceil(K/128), ceil(N/128)], as
    wgmma.run_wgmma_grouped and the ragged kernel read them."""

    w: torch.Tensor
    scale: torch.Tensor


def quantize_experts_pair(w):
    """Experts w [E, R, C] (R a multiple of 128) -> (q, s, q_t): quantize_fp8 of w viewed as
    [E * R, C] in 128x128 blocks (which never straddle two experts) and its transposed fp8 copy
    q_t [C, E * R], from one registered quantiser call. ``stacked`` and ``side_by_side`` turn
    them into the forward's and the backward's Experts."""
    E, R, C = w.shape
    q, s, q_t, _ = QUANTIZE_T_OP(w.reshape(E * R, C), str(BLOCKS), E4M3, False, False, "onegemm")
    return q, s, q_t


def stacked(q, s, E: int) -> Experts:
    """W_e [R, C] of q [E * R, C], for c = a @ W_e^T (K = C)."""
    R = q.shape[0] // E
    return Experts(q.view(E, R, q.shape[1]), s.view(E, R // SCALE_BLOCK, -1).transpose(1, 2))


def side_by_side(q_t, s, E: int) -> Experts:
    """W_e^T [C, R] of the transposed copy q_t [C, E * R], for c = a @ W_e (K = R): the experts
    side by side along K, read in place; W^T's 128x128 scales are W's own blocks."""
    C, R = q_t.shape[0], q_t.shape[1] // E
    return Experts(torch.as_strided(q_t, (E, C, R), (R, q_t.stride(0), 1)), s.view(E, R // SCALE_BLOCK, -1))


def fp8_expert_gemm(a, a_scale, experts: Experts, c, offs, scatter=None, weight=None):
    """c[rows of expert e] = (a * a_scale) @ (W_e * scale_e)^T (times ``weight`` per c row,
    rows stored at ``scatter`` when given): a fp8 [P, K] sorted by expert, a_scale its 1x128
    scales [P, ceil(K/128)]; offs int32 [E] the experts' row ends. Rows past offs[-1] are
    zeros. The Gluon body on sm_90 where it takes the operands, core's Triton body elsewhere."""
    P, K = a.shape
    E, N = experts.w.shape[:2]
    mode = gluon_grouped_mode(experts.w, P, E, a=a)
    if mode is not None:
        key = hopper_configs.WgmmaKey(configs.m_bucket(P // E), N, K, BLOCKWISE, configs.dtype_name(c.dtype), mode)
        run_wgmma_grouped(a, experts.w, c, lambda block_m: row_tiles(offs, E, P, block_m), a_scale, experts.scale,
                          N=N, key=key, scatter=scatter, weight=weight)
    else:
        expert_gemm(a, experts.w, c, offs, c_rows=scatter, weight=weight,
                    scales=grouped_scales(a=a_scale, b=experts.scale), scaling=BLOCKWISE)


def _quantize_rows(t):
    """quantize_fp8(t) in 1x128 blocks: (q, scales [rows, ceil(cols/128)])."""
    q, s = QUANTIZE_OP(t, str(ROW_BLOCKS), E4M3, False, False, "onegemm")
    return q, s.t()


def check_fp8_training(w_gate_up) -> None:
    """fp8_training's shape rule: w_gate_up [E, 2I, H] with 2I and H multiples of 128, so that
    the 128x128 blocks of the experts viewed as [E * 2I, H] and [E * H, I] never straddle two
    experts."""
    E, two_i, H = w_gate_up.shape
    if two_i % SCALE_BLOCK or H % SCALE_BLOCK:
        raise checks.bad_shape("w_gate_up", "[E, 2I, H] with 2I and H multiples of 128 for fp8_training (each "
                               "128x128 weight block within one expert)", w_gate_up.shape)


def _train_impl(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor, torch.Tensor]:
    """The FP8 training forward -> (y, h_pre, q13_t, s13, q2_t, s2): y [T, H] in x's dtype, and
    what the backward reads: GEMM1's output h_pre [P, 2I] (x's dtype, rows sorted by expert)
    and each expert stack's transposed fp8 copy with its 128x128 scales (quantize_fp8 of
    w_gate_up as [E * 2I, H] and of w_down as [E * H, I], transposed=True)."""
    return MOE_FP8_TRAIN.direct(x, w_gate_up, w_down, topk_weights, topk_ids)


def _train_record(x, w_gate_up, w_down, topk_weights, topk_ids):
    _check(x, w_gate_up, w_down, topk_weights, topk_ids)
    T, H, E, I, k, P = moe_sizes(x, w_gate_up, topk_ids)
    sort = sorter(topk_ids, E)

    def run(x, w_gate_up, w_down, topk_weights, topk_ids):
        q13, s13, q13_t = quantize_experts_pair(w_gate_up)
        q2, s2, q2_t = quantize_experts_pair(w_down)
        w13, w2 = stacked(q13, s13, E), stacked(q2, s2, E)
        h_pre = empty((P, 2 * I), dtype=x.dtype, device=x.device)
        y_pairs = empty((P, H), dtype=x.dtype, device=x.device)
        if P:
            pair, token, offs = sort(topk_ids)
            xq, xs = gather_quantize(x, token, E4M3, offs)
            fp8_expert_gemm(xq, xs, w13, h_pre, offs)
            hq, hs = swiglu_quantize(h_pre)
            weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
            fp8_expert_gemm(hq, hs, w2, y_pairs, offs, scatter=pair, weight=weights)
            y = combine(y_pairs, topk_ids, E, x.dtype)
        else:
            y = torch.zeros_like(x)
        return y, h_pre, q13_t, s13, q2_t, s2

    return run


def _train_fake(x, w_gate_up, w_down, topk_weights, topk_ids):
    _check(x, w_gate_up, w_down, topk_weights, topk_ids)
    H, (E, two_i, _), P = x.shape[1], w_gate_up.shape, topk_ids.numel()
    I = two_i // 2
    return (torch.empty_like(x), x.new_empty((P, two_i)), x.new_empty((H, E * two_i), dtype=E4M3),
            x.new_empty((E * two_i // SCALE_BLOCK, H // SCALE_BLOCK), dtype=torch.float32),
            x.new_empty((I, E * H), dtype=E4M3), x.new_empty((E * H // SCALE_BLOCK, cdiv(I, SCALE_BLOCK)),
                                                            dtype=torch.float32))


def _check(x, w_gate_up, w_down, topk_weights, topk_ids):
    check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    check_fp8_training(w_gate_up)


def _train_setup(ctx, inputs, output):
    x, w_gate_up, w_down, topk_weights, topk_ids = inputs
    ctx.save_for_backward(x, topk_weights, topk_ids, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients of the fp8 copies (hundreds of MB)
    ctx.weight_dtypes = (w_gate_up.dtype, w_down.dtype)


def _train_backward(ctx, dy, *_):
    x, topk_weights, topk_ids, h_pre, q13_t, s13, q2_t, s2 = ctx.saved_tensors
    dx, dw13, dw2, dweights = MOE_FP8_TRAIN_BACKWARD(dy, x, topk_weights, topk_ids, h_pre, q13_t, s13, q2_t, s2,
                                                     *ctx.weight_dtypes)
    return dx, dw13, dw2, dweights, None


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   h_pre: torch.Tensor, q13_t: torch.Tensor, s13: torch.Tensor, q2_t: torch.Tensor, s2: torch.Tensor,
                   w13_dtype: torch.dtype, w2_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw_gate_up, dw_down, dtopk_weights) of the FP8 training forward (module docstring):
    the input gradient's two GEMMs in FP8 on the forward's transposed expert copies, the
    weight gradients in high precision on the same sorted rows. A registered op of its own."""
    (T, H), k = x.shape, topk_ids.shape[1]
    two_i, E = h_pre.shape[1], q13_t.shape[1] // h_pre.shape[1]
    I, P = two_i // 2, T * k
    if P == 0:
        return (torch.zeros_like(x), x.new_zeros((E, two_i, H), dtype=w13_dtype),
                x.new_zeros((E, H, I), dtype=w2_dtype), torch.zeros_like(topk_weights))
    w13_t, w2_t = side_by_side(q13_t, s13, E), side_by_side(q2_t, s2, E)
    pair, token, offs = sort_by_expert(topk_ids, E)
    w_s = topk_weights.reshape(-1)[pair].float().contiguous()
    dy_x = dy.to(x.dtype)
    dyq, dys = gather_quantize(dy_x, token, E4M3, offs)
    dh_u = empty((P, I), dtype=torch.float32, device=x.device)
    fp8_expert_gemm(dyq, dys, w2_t, dh_u, offs)
    dh_pre, h_w, dw_s = swiglu_backward(h_pre, dh_u, w_s, x.dtype)
    dweights = torch.empty(P, device=x.device, dtype=torch.float32)
    dweights[pair] = dw_s
    dhq, dhs = _quantize_rows(dh_pre)
    dx_pairs = empty((P, H), dtype=torch.float32, device=x.device)
    fp8_expert_gemm(dhq, dhs, w13_t, dx_pairs, offs, scatter=pair)
    dx = combine(dx_pairs, topk_ids, E, x.dtype)
    dw13, dw2 = expert_weight_grads(dh_pre, dy_x, x, h_w, token, offs, w13_dtype, w2_dtype)
    return dx, dw13, dw2, dweights.view(T, k).to(topk_weights.dtype)


def _backward_fake(dy, x, topk_weights, topk_ids, h_pre, q13_t, s13, q2_t, s2, w13_dtype, w2_dtype):
    two_i, H = h_pre.shape[1], x.shape[1]
    E = q13_t.shape[1] // two_i
    return (torch.empty_like(x), x.new_empty((E, two_i, H), dtype=w13_dtype),
            x.new_empty((E, H, two_i // 2), dtype=w2_dtype), torch.empty_like(topk_weights))


MOE_FP8_TRAIN_BACKWARD = Op("moe_ffn_fp8_train_backward", _backward_impl, _backward_fake)
# The backward quantises dy and runs FP8 GEMMs: no second derivative, and an error says so.
MOE_FP8_TRAIN = Op("moe_ffn_fp8_train", _train_impl, _train_fake, _train_setup,
                   first_order_only(_train_backward, "moe_ffn(fp8_training=True)"), record=_train_record, tensors=5)
