"""The MoE steps that moe_ffn's forward (moe.py), its FP8 training (moe_train.py) and expert
parallelism (ep/moe.py) share: the input checks, the sizes, the routing sort, the expert GEMM
over sorted rows and the experts' weight gradients.

Below all three (it imports none of them), so none imports another's private helpers and
moe.py and moe_train.py do not import each other.
"""

from __future__ import annotations

import torch

from ..core import checks
from ..core.dispatch import Launch, Step, Workspace
from ..core.launch import Launcher, Request
from ..core.runtime import INTERPRET, cdiv, interpretable, next_pow2, sm_count
from ..core.scaling import (INT4_MIN_GROUP, INT4_SCALE_DTYPES, MXFP4_BLOCK, MXFP4_PREPACKED, MXFP4_SCALE, SCALE_BLOCK,
                            weight_4bit)
from ..core.tiles import NO_OPERAND, Combine, Operand, Routing
from .configs import ROUTED_PREP_MAX_ELEMENTS, ROUTED_PREP_STEP_ELEMENTS, SORT_MAX_PAIRS, SortKey, gather_col_blocks
from .kernels import NO_GROUPED_SCALES, NO_ROUTES, NO_ROW_TILES, moe_prep_kernel
from .ops import gather_quantize, grouped_matmul, ragged_args, ragged_launch, row_tiles
from .w4 import w4_bytes


def sort_by_expert(topk_ids, num_experts: int):
    """Sort the (token, slot) pairs by expert, on the device.

    topk_ids [T, k] -> (pair int32 [T*k], token int32 [T*k], offs int32 [E]): row r of the
    sorted order is pair ``pair[r]`` (= t*k + j) of token ``token[r]`` (= pair // k); expert
    e owns rows [offs[e-1], offs[e]). The sort is stable, so the order (and the result) is the
    same on every run. Ids outside [0, E) (e.g. experts on another rank under expert
    parallelism) sort past offs[-1], where the grouped GEMM writes zeros: they contribute 0.
    Up to SORT_MAX_PAIRS pairs a Triton kernel sorts them (one launch, ``prep_step``); more go
    through torch.sort. Both are stable, so both give the same order.
    """
    return sorter(topk_ids, num_experts)(topk_ids)


# The MoE prep (moe_prep_kernel): up to SORT_MAX_PAIRS pairs, the sort with x's sorted rows
# and the row-tile tables in one launch.
PREP = Launcher(moe_prep_kernel, "sort")
# Pairs per program: up to 64, fewer for a decode step's few pairs (a program's [block, 128]
# column blocks are quantised whole, padding rows too).
_PAIR_BLOCK, _MIN_PAIR_BLOCK = 64, 16
_SCAN_BLOCK = 1024  # pairs per step of the expert histograms: <= 4 steps up to SORT_MAX_PAIRS
_CHUNK = 32  # row-tile table rows per table program


def prep_step(topk_ids, E: int, x=None, dtype=None, block_ms: tuple = (), route=None, sorted_x: bool = True):
    """The step before the expert GEMMs for arguments of these signatures: the routing sort;
    with ``x`` [T, H] also its rows in sorted order, in ``dtype`` (fp8: quantised in 1x128
    blocks with their scales; rows of experts on other ranks unwritten), or with ``sorted_x``
    False its T rows in token order, each quantised once, for a GEMM1 that gathers by token
    (q [T, H], s [T, ceil(H/128)]: k times fewer rows to quantise, and no sort on the
    quantising programs' path); the row-tile tables
    (ops.row_tiles without the tail group) of each tile height in ``block_ms``; and zeros
    (GEMM2's combine tickets). A Launch (``moe_prep_kernel``, one launch up to
    SORT_MAX_PAIRS contiguous pairs) or a Step (torch.sort, gather_quantize, row_tiles); its
    builder takes (ids, pair, token, offs, x, q, s, zeros, tables, routes), the outputs given
    (a record's workspace parts): q [P, H], s [P, ceil(H/128)] or None, zeros int32 or None,
    a kernels.RowTiles per height, and kernels.Routes or NO_ROUTES.

    ``route``: a kernels.RouteSpec (``routes_in_prep`` says where it may be given): the
    launch routes the tokens too, writing the weights and ids (int32 [T, k]) that it sorts."""
    T, k = topk_ids.shape
    P = T * k
    if P <= SORT_MAX_PAIRS and topk_ids.is_contiguous():
        e_block = next_pow2(E + 1)
        pair_block = max(_MIN_PAIR_BLOCK, min(_PAIR_BLOCK, next_pow2(P)))
        meta = dict(E_BLOCK=e_block, PAIR_BLOCK=pair_block, SCAN_BLOCK=_SCAN_BLOCK, CHUNK=_CHUNK, SORTED_X=sorted_x,
                    **{f"BLOCK_M{i + 1}": m for i, m in enumerate(block_ms)})
        if route is not None:
            step = ROUTED_PREP_STEP_ELEMENTS // (route.G_BLOCK * route.GROUP_BLOCK)
            meta.update(ROUTE=route, ROUTE_TOKENS=max(2, min(next_pow2(T), step)))
        plan = PREP.plan_for(Request(SortKey(e_block), meta, topk_ids.device))
        programs = cdiv(P, pair_block)
        table_programs = max([cdiv(cdiv(P, m) + E + 1, _CHUNK) for m in block_ms], default=1)
        kb = cdiv(x.shape[1], SCALE_BLOCK) if x is not None else 1
        # Sorted rows: each quantising program also sorts all the pairs, so one per SM; in token
        # order they only quantise, as gather_quantize's programs.
        per = gather_col_blocks(programs if sorted_x else cdiv(T, pair_block), kb,
                                1 if INTERPRET else sm_count(plan.device_index), per_sm=1 if sorted_x else 4)

        def build(ids, pair, token, offs, x=None, q=None, s=None, zeros=None, tables=(), routes=NO_ROUTES):
            tiles = tuple(tables) + (NO_ROW_TILES,) * (2 - len(tables))
            n_zero = 0 if zeros is None else zeros.numel()
            if x is None:
                return (ids.view(-1), pair, token, offs, NO_OPERAND, NO_OPERAND, NO_OPERAND, zeros, *tiles, routes, P, E,
                        k, 0, 1, n_zero)
            return (ids.view(-1), pair, token, offs, Operand(interpretable(x), *x.stride()), Operand(q, *q.stride()),
                    NO_OPERAND if s is None else Operand(s, *s.stride()), zeros, *tiles, routes, P, E, k, x.shape[1], per,
                    n_zero)

        return Launch(PREP, plan, (programs + table_programs, cdiv(kb, per)), build)
    if route is not None:
        raise AssertionError("prep_step: routes only in the launch (routes_in_prep)")
    experts = torch.arange(E, device=topk_ids.device, dtype=torch.int32)

    def prep(ids, pair, token, offs, x=None, q=None, s=None, zeros=None, tables=(), routes=None):
        flat = ids.reshape(-1)
        # Range-check in the ids' own width before narrowing: an int64 id of 2**32 + 1 is not expert 1.
        flat = torch.where((flat >= 0) & (flat < E), flat, E).to(torch.int32)
        sorted_ids, order = torch.sort(flat, stable=True)
        pair.copy_(order)
        torch.floor_divide(order, k, out=token)
        # searchsorted, not bincount: CUDA bincount reads the max id back to the host (a sync).
        torch.searchsorted(sorted_ids, experts, right=True, out_int32=True, out=offs)
        if x is not None:
            gather_quantize(x, token if sorted_x else None, q.dtype, offs if sorted_x else None, out=(q, s))
        for tiles, block_m in zip(tables, block_ms):
            row_tiles(offs, E, P, block_m, tail=False, out=tiles)
        if zeros is not None:
            zeros.zero_()

    return Step(prep)


def routes_in_prep(T: int, k: int, route) -> bool:
    """Whether ``prep_step`` can route T tokens' top-k by ``route`` (a kernels.RouteSpec) in
    its launch: every program routes all of them (configs.ROUTED_PREP_MAX_ELEMENTS)."""
    return 0 < T * k <= SORT_MAX_PAIRS and T * route.G_BLOCK * route.GROUP_BLOCK <= ROUTED_PREP_MAX_ELEMENTS


def sort_parts(P: int, E: int) -> tuple:
    """The sort's outputs (pair, token, offs) as Workspace parts."""
    return ((P,), torch.int32), ((P,), torch.int32), ((E,), torch.int32)


def sorter(topk_ids, E: int):
    """``sort_by_expert`` for ids of topk_ids' signature, as a callable ids -> (pair, token, offs)
    (the three in one allocation: each torch.empty costs the host more than a view)."""
    T, k = topk_ids.shape
    workspace = Workspace(topk_ids.device, *sort_parts(T * k, E))
    step = prep_step(topk_ids, E)

    def sort(ids):
        parts = workspace.parts(workspace.new())
        step(ids, *parts)
        return parts

    return sort


def check_expert_weights(w_gate_up, w_down, H: int) -> None:
    """w_gate_up [E, 2I, H] (E >= 1, gate rows then up rows) and w_down [E, H, I]."""
    E, two_i, H1 = w_gate_up.shape
    if H1 != H or two_i % 2 or E == 0:
        raise checks.bad_shape("w_gate_up", f"[E, 2I, H] = [E >= 1, 2I, {H}] (gate rows then up rows)", w_gate_up.shape)
    checks.check_shape("w_down", w_down, (E, H, two_i // 2), f"[E, H, I] = {[E, H, two_i // 2]}")


def check_w4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, H: int) -> tuple:
    """4-bit experts (weight-only; core/scaling.py): w_gate_up [E, 2I, H/p] and w_down
    [E, H, I/p] (E >= 1) in one format, MXFP4 (float4_e2m1fn_x2, p = 2; H and I multiples of
    32) with e8m0 block scales [E, 2I, H/32] and [E, H, I/32], or INT4 (int32, p = 8, unit
    stride along the packed dimension) with float group scales [E, 2I, H/g1] and [E, H, I/g2]
    (int32: with zero points, blockscaled.pack_int4_zeros), each group a power of two >= 32.
    Returns (format, g1, g2)."""
    fmt = weight_4bit(w_gate_up)
    dtype, name = w_gate_up.dtype, fmt.upper()
    for arg, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        checks.check_tensor(arg, w, ndim=3, dtypes=(dtype,))
    per = 2 if fmt == "mxfp4" else 8
    align = MXFP4_BLOCK if fmt == "mxfp4" else per  # (INT4: its groups' own check below)
    frag = dtype == MXFP4_PREPACKED  # (moe_experts unwrapped PrepackedMxfp4s: K padded to 128)
    packed = (lambda k: cdiv(k, 128) * 64) if frag else (lambda k: k // per)
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    if H % align or E == 0 or two_i % 2 or I % align:
        raise checks.bad_shape("w_gate_up", f"{name} [E, 2I, H/{per}] with E >= 1 and H ({H}) and I multiples of "
                               f"{align}", w_gate_up.shape)
    checks.check_shape("w_gate_up", w_gate_up, (E, two_i, packed(H)),
                       f"{name} [E, 2I, H/{per}] = {[E, two_i, packed(H)]}")
    checks.check_shape("w_down", w_down, (E, H, packed(I)), f"{name} [E, H, I/{per}] = {[E, H, packed(I)]}")
    groups = []
    for arg, t, w, wt, rows, K in (("w_gate_up_scale", w_gate_up_scale, "w_gate_up", w_gate_up, two_i, H),
                                   ("w_down_scale", w_down_scale, "w_down", w_down, H, I)):
        if fmt == "mxfp4":
            shape = (E, rows, packed(K) // 16 if frag else K // MXFP4_BLOCK)
            if t is None:
                raise checks.bad_value(arg, f"the e8m0 block scales {list(shape)} of the MXFP4 experts", None)
            checks.check_tensor(arg, t, ndim=3, dtypes=(MXFP4_SCALE,))
            checks.check_shape(arg, t, shape, f"{list(shape)} (one e8m0 scale per {MXFP4_BLOCK} values)")
            groups.append(MXFP4_BLOCK)
            continue
        if t is None:
            raise checks.bad_value(arg, f"the group scales [E, {rows}, {K}/group] of the INT4 experts", None)
        checks.check_tensor(arg, t, ndim=3, dtypes=INT4_SCALE_DTYPES)
        g = K // t.shape[2] if t.shape[2] and K % t.shape[2] == 0 else 0
        if g < INT4_MIN_GROUP or g & (g - 1) or t.shape[:2] != (E, rows):
            raise checks.bad_shape(arg, f"[E, {rows}, {K}/group] with the group a power of two >= {INT4_MIN_GROUP}",
                                   t.shape)
        if wt.stride(2) != 1:
            raise checks.bad_value(w, "INT4 experts with unit stride along the packed dimension (as stored)",
                                   f"strides {tuple(wt.stride())}")
        groups.append(g)
    checks.check_same_device(w_gate_up=w_gate_up, w_down=w_down, w_gate_up_scale=w_gate_up_scale,
                             w_down_scale=w_down_scale)
    return fmt, *groups


def check_layer_tensors(gate_weight, w_gate_up, w_down, w_gate_up_scale=None, w_down_scale=None) -> bool:
    """A layer's router gate_weight [E, H] (a float dtype) and its experts: 3-D, in the router's
    dtype or float8_e4m3fn when scales are given or the experts are fp8. Returns whether FP8."""
    checks.check_tensor("gate_weight", gate_weight, ndim=2, dtypes=checks.FLOAT_DTYPES)
    fp8 = w_gate_up_scale is not None or w_down_scale is not None or (
        isinstance(w_gate_up, torch.Tensor) and w_gate_up.dtype in checks.FP8_DTYPES)
    expert_dtypes = (torch.float8_e4m3fn,) if fp8 else (gate_weight.dtype,)
    checks.check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=expert_dtypes)
    checks.check_tensor("w_down", w_down, ndim=3, dtypes=expert_dtypes)
    return fp8


def check_moe(x, w_gate_up, w_down, topk_weights, topk_ids, weight_dtypes=None, x_dtypes=checks.FLOAT_DTYPES):
    """The checks every moe_ffn makes; the weights have x's dtype unless ``weight_dtypes``."""
    checks.check_tensor("x", x, ndim=2, dtypes=x_dtypes)
    checks.check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=weight_dtypes or (x.dtype,))
    checks.check_tensor("w_down", w_down, ndim=3, dtypes=weight_dtypes or (x.dtype,))
    check_expert_weights(w_gate_up, w_down, x.shape[1])
    check_routing(x, topk_weights, topk_ids)
    checks.check_same_device(x=x, w_gate_up=w_gate_up, w_down=w_down)


def check_routing(x, topk_weights, topk_ids) -> None:
    """topk_weights (float) and topk_ids (int32 / int64) [T, k] for x's T rows, on x's device."""
    checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=checks.FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    T = x.shape[0]
    if topk_ids.shape[0] != T:
        raise checks.bad_shape("topk_ids", f"[T, k] with T = {T} (x's rows)", topk_ids.shape)
    checks.check_shape("topk_weights", topk_weights, topk_ids.shape, f"[T, k] = {list(topk_ids.shape)} (topk_ids' shape)")
    checks.check_same_device(x=x, topk_weights=topk_weights, topk_ids=topk_ids)


def check_expert_scales(w_gate_up, w_down, w_gate_up_scale, w_down_scale) -> None:
    """FP8 experts (float8_e4m3fn [E, 2I, H] / [E, H, I], shapes already checked) and their
    fp32 128x128 block scales [E, 2 * ceil(I/128), ceil(H/128)] / [E, ceil(H/128), ceil(I/128)]."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        checks.check_tensor(name, w, ndim=3, dtypes=(torch.float8_e4m3fn,))
    for name, t, weight in (("w_gate_up_scale", w_gate_up_scale, "w_gate_up"), ("w_down_scale", w_down_scale, "w_down")):
        if t is None:
            raise checks.bad_value(name, f"the fp32 128x128 block scales of the fp8 {weight} (a checkpoint's "
                                   "weight_scale_inv)", None)
        checks.check_tensor(name, t, ndim=3, dtypes=(torch.float32,))
    E, two_i, H = w_gate_up.shape
    kh, ki = cdiv(H, SCALE_BLOCK), cdiv(two_i // 2, SCALE_BLOCK)
    checks.check_shape("w_gate_up_scale", w_gate_up_scale, (E, 2 * ki, kh),
                       f"[E, 2 * ceil(I/128), ceil(H/128)] = {[E, 2 * ki, kh]} (gate blocks, then up blocks)")
    checks.check_shape("w_down_scale", w_down_scale, (E, kh, ki), f"[E, ceil(H/128), ceil(I/128)] = {[E, kh, ki]}")
    checks.check_same_device(w_gate_up=w_gate_up, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)


def moe_sizes(x, w_gate_up, topk_ids):
    """(T, H, E, I, k, P): tokens, hidden size, experts, intermediate size, top-k, pairs."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    k = topk_ids.shape[1]
    return T, H, E, two_i // 2, k, T * k


def expert_gemm(a, w, c, offs, **kwargs):
    """c[r] = a[r] @ w[e].T for the rows r of expert e (2D x 3D, offs over rows; ``kwargs``:
    ragged_launch's MoE options). w [E, N or 2N, K] is read in place through its transpose."""
    expert_launch(a, w, c, offs, **kwargs).run(c, a, w, offs, kwargs.get("a_rows"), kwargs.get("c_rows"),
                                               kwargs.get("weight"), kwargs.get("scales", NO_GROUPED_SCALES))


def expert_launch(a, w, c, offs, **kwargs):
    """``expert_gemm``'s launch for operands shaped like these: a core/dispatch.py Launch whose
    builder takes (c, a, w, offs, a_rows, c_rows, weight, scales, combine): combine a
    core/tiles.py Combine (GEMM2 sums each token's rows too; Combine(): none)."""
    wt = w4_bytes(w.transpose(1, 2)) if kwargs.get("w4") else w.transpose(1, 2)  # (4-bit: strides in bytes)
    G, N, K, M = w.shape[0], c.shape[1], a.shape[1], c.shape[0]
    strides = ((0, a.stride(0), a.stride(1)), tuple(wt.stride()), (0, c.stride(0), c.stride(1)))

    def build(c, a, w, offs, a_rows, c_rows, weight, scales, combine=Combine()):
        return ragged_args(a, w.transpose(1, 2), c, None, offs, strides, Routing(a_rows, c_rows, weight, *combine), scales,
                           G, M, N, K)

    return ragged_launch(a, wt, c, offs, ragged="M", G=G, M=M, N=N, K=K, strides_a=strides[0], strides_b=strides[1],
                         strides_c=strides[2], rows_per_group=M // G, build=build, **kwargs)


def expert_weight_grads(dh_pre, dy, x, h_w, token, offs, w13_dtype, w2_dtype):
    """The experts' weight gradients over the sorted rows (2D x 2D grouped GEMMs, ragged K):
    dW13_e = dh_pre_e^T @ x[token]_e and dW2_e = dy[token]_e^T @ h_w_e, where h_w = w * h (the
    routing weight on h's rows, as swiglu_backward writes it: no weighted copy of dy's rows)."""
    dw13 = grouped_matmul(dh_pre.t(), x[token], offs, out_dtype=w13_dtype)
    dw2 = grouped_matmul(dy[token].t(), h_w, offs, out_dtype=w2_dtype)
    return dw13, dw2
