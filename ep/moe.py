"""Expert parallelism: moe_ffn with the experts sharded over a torch.distributed process group.

Rank r of W holds experts [r * E_local, (r + 1) * E_local) of E = W * E_local; every rank
routes its own tokens over all E. Two ways to bring tokens to their experts (docs/ep.md):

* "allgather": all-gather x, the routing weights and ids over the group, run the local
  experts on every token (moe_ffn skips ids outside [0, E_local)), reduce-scatter the sums.
  Shapes are known in advance: nothing is read back to the host, a CUDA graph can capture it.
* "alltoall": send each token once to each rank that holds one of its experts, with
  rank-local ids (-1 for the other slots); each rank weights and sums its own slots and
  sends the partial sums back. The split sizes are read to the host once per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..blockscaled.quantize import quantize_fp8
from ..core import checks
from ..core.matmul import matmul
from ..core.runtime import cdiv
from ..core.scaling import SCALE_BLOCK
from ..grouped.loading import read_layer
from ..grouped.moe import moe_ffn
from ..grouped.moe_steps import check_expert_scales, check_expert_weights, check_layer_tensors, check_moe
from ..grouped.routing import route
from .comm import all_gather, all_to_all, alone, reduce_scatter, resolve_group

STRATEGIES = ("auto", "allgather", "alltoall")
# "auto" all-gathers up to this many tokens per rank (decode) and goes all-to-all above it
# (prefill), where sending each token only to the ranks it needs saves the bandwidth.
ALLGATHER_MAX_TOKENS = 128


def choose_strategy(strategy: str, tokens: int) -> str:
    """The strategy a call takes: ``strategy`` itself, or for "auto" "allgather" while a CUDA
    graph is being captured or for at most ALLGATHER_MAX_TOKENS tokens, else "alltoall"."""
    checks.check_choice("strategy", strategy, STRATEGIES)
    # (torch.compile traces no capture: the graph it makes may be captured later, by its own rules)
    capturing = (not torch.compiler.is_compiling() and torch.cuda.is_available()
                 and torch.cuda.is_current_stream_capturing())
    if strategy == "auto":
        return "allgather" if capturing or tokens <= ALLGATHER_MAX_TOKENS else "alltoall"
    if strategy == "alltoall" and capturing:
        raise checks.bad_value("strategy", "'allgather' or 'auto' during CUDA-graph capture ('alltoall' reads its "
                               "split sizes to the host)", repr(strategy))
    return strategy


def ep_moe_ffn(x, w_gate_up, w_down, topk_weights, topk_ids, *, group=None, strategy: str = "auto",
               w_gate_up_scale=None, w_down_scale=None):
    """moe_ffn with this rank's experts of a process group: y[t] = sum_j w[t,j] * FFN_e(x_t) over
    all E = W * E_local experts, e = topk_ids[t, j] (global ids; ids outside [0, E) contribute
    nothing).

    x [T, H], topk_weights / topk_ids [T, k]: this rank's tokens. w_gate_up [E_local, 2I, H],
    w_down [E_local, H, I]: this rank's experts, global ids [rank * E_local, (rank + 1) * E_local);
    every rank holds E_local experts. group: a torch.distributed ProcessGroup (None: the
    default group); every rank of it calls with the same strategy and weights of one shape.
    strategy: "allgather" (every rank must pass the same T), "alltoall" (any T per rank) or
    "auto" (choose_strategy: every rank must come to the same choice, i.e. agree on whether
    T <= ALLGATHER_MAX_TOKENS). Returns [T, H] in x's dtype. Deterministic: bitwise the same
    on a rerun. Differentiable like moe_ffn (x, the experts, topk_weights; the gradients of
    the experts are those of this rank's tokens and every other rank's routed to them).

    FP8 experts (w_gate_up_scale, w_down_scale; moe_ffn's format): x is quantised once in
    1x128 blocks before it is sent (fp8 on the wire), and the partial sums come back in
    bfloat16. Not differentiable.
    """
    group, world, rank = resolve_group(group)
    fp8 = w_gate_up_scale is not None or w_down_scale is not None or (
        isinstance(w_gate_up, torch.Tensor) and w_gate_up.dtype in checks.FP8_DTYPES)
    # Every check before the first collective: a rank that raised later would leave the others waiting.
    if fp8:
        checks.check_not_differentiable("ep_moe_ffn with fp8 experts", x=x, w_gate_up=w_gate_up, w_down=w_down,
                                        topk_weights=topk_weights)
        check_moe(x, w_gate_up, w_down, topk_weights, topk_ids, weight_dtypes=(torch.float8_e4m3fn,))
        check_expert_scales(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
    else:
        check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    strategy = choose_strategy(strategy, x.shape[0])
    out_dtype, x_scale = x.dtype, None
    if fp8:  # quantised once, before the send: fp8 bytes on the wire
        x, x_scale = quantize_fp8(x)
    experts = _Experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, rank, world)
    if alone(group):  # every expert is local and every collective the identity: moe_ffn itself
        return experts(x, x_scale, topk_weights, topk_ids).to(out_dtype)
    run = _allgather if strategy == "allgather" else _alltoall
    return run(x, x_scale, topk_weights, topk_ids, experts, group).to(out_dtype)


class _Experts:
    """This rank's experts and where they sit among the group's."""

    def __init__(self, w_gate_up, w_down, w_gate_up_scale, w_down_scale, rank, world):
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.scales = {} if w_gate_up_scale is None else dict(w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
        self.rank, self.world, self.local = rank, world, w_gate_up.shape[0]

    def __call__(self, x, x_scale, topk_weights, local_ids):
        """moe_ffn over the local experts; an fp8 x comes with its scales (bf16 out)."""
        if x_scale is not None:
            # Outer-dim-major, the layout quantize_fp8 writes and GEMM1's K loop reads coalesced.
            x_scale = x_scale.t().contiguous().t()
            return moe_ffn(x, self.w_gate_up, self.w_down, topk_weights, local_ids, x_scale=x_scale, **self.scales)
        return moe_ffn(x, self.w_gate_up, self.w_down, topk_weights, local_ids)


def _local_ids(ids, rank, local: int):
    """Global ids -> ``rank``'s local ids (int32), -1 where another rank (or none) holds the expert."""
    ids = ids.long() - rank * local
    return torch.where((ids >= 0) & (ids < local), ids, -1).to(torch.int32)


def _allgather(x, x_scale, topk_weights, topk_ids, experts, group):
    if _wants_grad(x, topk_weights):
        weights, ids = all_gather(topk_weights, group), all_gather(topk_ids, group)
        xs = None if x_scale is None else all_gather(x_scale, group)
    else:  # ids outside [0, E) become -1 before they are narrowed to int32 (2**32 + 1 is no expert 1)
        E = experts.local * experts.world
        ids = torch.where((topk_ids >= 0) & (topk_ids < E), topk_ids, -1)
        weights, ids, xs = _unpack(all_gather(_pack(topk_weights, ids, x_scale), group), topk_ids.shape[1])
    y = experts(all_gather(x, group), xs, weights, _local_ids(ids, experts.rank, experts.local))
    return reduce_scatter(y, group)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _pack(topk_weights, topk_ids, x_scale):
    """One int32 message for the rows' routing weights (their fp32 bits), ids and fp8 scales:
    one collective instead of three (at decode each costs its latency)."""
    parts = [topk_weights.float().view(torch.int32), topk_ids.to(torch.int32)]
    if x_scale is not None:
        parts.append(x_scale.view(torch.int32))
    return torch.cat(parts, 1)


def _unpack(meta, k: int):
    """_pack's (weights fp32, ids int32, scales fp32 or None), as views of ``meta``."""
    scales = meta[:, 2 * k:].view(torch.float32) if meta.shape[1] > 2 * k else None
    return meta[:, :k].view(torch.float32), meta[:, k:2 * k], scales


def _alltoall(x, x_scale, topk_weights, topk_ids, experts, group):
    d = dispatch(x, topk_weights, topk_ids, experts.local, group=group, x_scale=x_scale)
    return combine(experts(d.x, d.x_scale, d.topk_weights, d.topk_ids), d)


@dataclass
class Dispatched:
    """What ``dispatch`` received, and what ``combine`` needs to send results back.

    x [R, H] (fp8 x: with x_scale [R, ceil(H/128)]), topk_weights [R, k] (fp32 when no
    gradient is recorded: the weights, ids and scales then travel as one message and are views
    of it), topk_ids [R, k] int32: the rows from every rank, rank 0's first, each rank's in its
    token order, with this rank's local expert ids (-1 in the slots of experts held elsewhere).
    send_sizes / recv_sizes: the rows sent to and received from each rank.
    """

    x: torch.Tensor
    x_scale: Optional[torch.Tensor]
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    send_sizes: list
    recv_sizes: list
    group: object
    tokens: int
    copies: int
    rows: torch.Tensor  # where each sent row's result goes in combine's [tokens * copies] buffer


def dispatch(x, topk_weights, topk_ids, num_local_experts: int, *, group=None, x_scale=None) -> Dispatched:
    """The all-to-all half of expert parallelism: send each token once to every rank that
    holds one of its experts, with that rank's local ids. Rank r holds global experts
    [r * num_local_experts, (r + 1) * num_local_experts); ids outside [0, W * num_local_experts)
    go nowhere. One device-to-host read (the split sizes). Differentiable in x and
    topk_weights (the gradient comes back the way the rows went).

    x [T, H] (float, or fp8 with its 1x128 x_scale [T, ceil(H/128)] from quantize_fp8),
    topk_weights [T, k], topk_ids [T, k] int32/int64 (global ids). Returns a Dispatched.
    """
    group, world, _ = resolve_group(group)
    checks.check_tensor("x", x, ndim=2, dtypes=checks.FLOAT_DTYPES if x_scale is None else (torch.float8_e4m3fn,))
    checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=checks.FLOAT_DTYPES)
    T, k = topk_ids.shape
    if T != x.shape[0]:
        raise checks.bad_shape("topk_ids", f"[T, k] with T = {x.shape[0]} (x's rows)", topk_ids.shape)
    checks.check_shape("topk_weights", topk_weights, (T, k), f"[T, k] = {[T, k]} (topk_ids' shape)")
    checks.check_int("num_local_experts", num_local_experts, 1, what="(the experts on each rank)")
    if x_scale is not None:
        checks.check_tensor("x_scale", x_scale, ndim=2, dtypes=(torch.float32,))
        checks.check_shape("x_scale", x_scale, (T, cdiv(x.shape[1], SCALE_BLOCK)),
                           "[T, ceil(H/128)] (x's 1x128 scales)")
    checks.check_same_device(x=x, topk_weights=topk_weights, topk_ids=topk_ids, x_scale=x_scale)

    copies = min(k, world)  # at most this many ranks hold a token's experts
    ids = topk_ids.long()
    owner = torch.div(ids, num_local_experts, rounding_mode="floor")
    owner = torch.where((ids >= 0) & (owner < world), owner, world)  # world: no rank
    hit = torch.zeros(T, world + 1, dtype=torch.bool, device=x.device).scatter_(1, owner, True)[:, :world]
    send_counts = hit.sum(0)
    recv_counts = all_to_all(send_counts, [1] * world, [1] * world, group)
    sizes = torch.cat([send_counts, recv_counts]).tolist()  # the one device-to-host read
    send, recv = sizes[:world], sizes[world:]
    # The rows sent: pairs (rank d, token t) with hit[t, d], by rank, then token (a stable
    # sort of the hit mask, no read-back); the rows received arrive by source rank, then its
    # token order: a fixed order, so every run sums the same rows in the same order.
    picked = torch.argsort((~hit.t().reshape(-1)).to(torch.uint8), stable=True)[:sum(send)]
    d_idx, t_idx = picked // max(T, 1), picked % max(T, 1)
    # A token's copies keep their own rows c = 0..copies-1 (rank order) in the combine buffer.
    c_idx = (hit.cumsum(1) - 1)[t_idx, d_idx]
    ids_send = torch.where(owner[t_idx] == d_idx[:, None], ids[t_idx] - d_idx[:, None] * num_local_experts, -1)
    ids_send = ids_send.to(torch.int32)
    xs_send = None if x_scale is None else x_scale.index_select(0, t_idx)
    if _wants_grad(x, topk_weights):
        w_recv = all_to_all(_copy_rows(topk_weights, t_idx, c_idx, copies), recv, send, group)
        ids_recv = all_to_all(ids_send, recv, send, group)
        xs_recv = None if xs_send is None else all_to_all(xs_send, recv, send, group)
    else:  # the rows' weights, ids and scales in one message
        meta = _pack(topk_weights.index_select(0, t_idx), ids_send, xs_send)
        w_recv, ids_recv, xs_recv = _unpack(all_to_all(meta, recv, send, group), k)
    return Dispatched(
        x=all_to_all(_copy_rows(x, t_idx, c_idx, copies), recv, send, group), x_scale=xs_recv,
        topk_weights=w_recv, topk_ids=ids_recv,
        send_sizes=send, recv_sizes=recv, group=group, tokens=T, copies=copies, rows=t_idx * copies + c_idx,
    )


def combine(y, dispatched: Dispatched):
    """The other half: y [R, N] (a row per received row of ``dispatched``: its local experts'
    weighted sum) goes back to the ranks the rows came from, and each token's partial sums
    are added in rank order (fp32 accumulation, no atomics). Returns [T, N] in y's dtype.
    Differentiable in y."""
    if not isinstance(dispatched, Dispatched):
        raise checks.bad_type("dispatched", "what onegemm.ep.dispatch returned", dispatched)
    checks.check_tensor("y", y, ndim=2)
    R = sum(dispatched.recv_sizes)
    if y.shape[0] != R:
        raise checks.bad_shape("y", f"[R, N] with R = {R} (the rows dispatch received)", y.shape)
    back = all_to_all(y, dispatched.send_sizes, dispatched.recv_sizes, dispatched.group)
    T, copies, N = dispatched.tokens, dispatched.copies, y.shape[1]
    # Each (token, copy) row is written once, then the copies are summed in rank order.
    buf = back.new_zeros(T * copies, N).index_copy(0, dispatched.rows, back)
    return buf.view(T, copies, N).sum(1)


def _copy_rows(t, t_idx, c_idx, copies):
    """t[t_idx] whose gradient is summed per token in a fixed order: indexing t expanded to
    [T, copies, ...] at distinct (token, copy) places writes each gradient row once, and
    the expand's backward sums the copies (no accumulation into shared rows)."""
    if t.dtype in checks.FP8_DTYPES:
        return t.view(torch.uint8).index_select(0, t_idx).view(t.dtype)
    if not (torch.is_grad_enabled() and t.requires_grad):
        return t.index_select(0, t_idx)
    return t[:, None].expand(t.shape[0], copies, *t.shape[1:])[t_idx, c_idx]


class EPMoEFFN(nn.Module):
    """MoEFFN with its experts sharded over a process group: rank r holds experts
    [r * E / W, (r + 1) * E / W) of E (E a multiple of the group's size W); the router stays
    whole on every rank, and each rank routes its own tokens.

    gate_weight [E, H] (the whole router), w_gate_up [E / W, 2I, H] and w_down [E / W, H, I]
    (this rank's experts; ``from_full`` takes them from all E, ``from_safetensors`` reads only
    them), FP8 experts with their scales as for MoEFFN (a frozen inference layer). strategy:
    the default of ``forward`` ("auto", "allgather" or "alltoall"; ep_moe_ffn). Training: the
    router's gradient is this rank's tokens' only (all-reduce it over the group, as data
    parallelism does); each expert's gradient already holds every rank's tokens.
    """

    def __init__(self, gate_weight, w_gate_up, w_down, top_k: int = 2, renormalize: bool = True, *, group=None,
                 strategy: str = "auto", w_gate_up_scale=None, w_down_scale=None):
        super().__init__()
        self.group, world, rank = resolve_group(group)
        fp8 = check_layer_tensors(gate_weight, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
        E, H = gate_weight.shape
        local = _local_experts(E, world)
        if w_gate_up.shape[0] != local:
            raise checks.bad_shape("w_gate_up", f"[E / W, 2I, H] = [{local}, 2I, {H}] (this rank's experts: E = {E} "
                                   f"router rows over W = {world} ranks)", w_gate_up.shape)
        check_expert_weights(w_gate_up, w_down, H)
        checks.check_int("top_k", top_k, 1, E, "(at most the number of experts)")
        checks.check_bool("renormalize", renormalize)
        checks.check_choice("strategy", strategy, STRATEGIES)
        checks.check_same_device(gate_weight=gate_weight, w_gate_up=w_gate_up, w_down=w_down)
        if fp8:
            check_expert_scales(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
        self.gate_weight = nn.Parameter(gate_weight, requires_grad=not fp8)
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=not fp8)
        self.w_down = nn.Parameter(w_down, requires_grad=not fp8)
        self.register_buffer("w_gate_up_scale", w_gate_up_scale)
        self.register_buffer("w_down_scale", w_down_scale)
        self.top_k, self.renormalize, self.strategy = top_k, renormalize, strategy
        self.experts = range(rank * local, (rank + 1) * local)

    @classmethod
    def from_full(cls, gate_weight, w_gate_up, w_down, top_k: int = 2, renormalize: bool = True, *, group=None,
                  strategy: str = "auto", w_gate_up_scale=None, w_down_scale=None):
        """The layer from all E experts (MoEFFN's arguments): this rank keeps a copy of its
        own slice (the full tensors can then be freed)."""
        _, world, rank = resolve_group(group)
        checks.check_tensor("gate_weight", gate_weight, ndim=2, dtypes=checks.FLOAT_DTYPES)
        E = gate_weight.shape[0]
        local = _local_experts(E, world)
        mine = slice(rank * local, (rank + 1) * local)
        parts = dict(w_gate_up=w_gate_up, w_down=w_down, w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)
        for name, t in parts.items():
            if t is None:
                continue
            checks.check_tensor(name, t, ndim=3)
            if t.shape[0] != E:
                raise checks.bad_shape(name, f"[E, ...] with E = {E} (gate_weight's rows: all the experts)", t.shape)
        w13, w2, s13, s2 = (None if t is None else t[mine].clone() for t in parts.values())
        return cls(gate_weight, w13, w2, top_k, renormalize, group=group, strategy=strategy, w_gate_up_scale=s13,
                   w_down_scale=s2)

    @classmethod
    def from_safetensors(cls, path, prefix: str = "", top_k: int = 2, *, renormalize: bool = True, group=None,
                         strategy: str = "auto", device=None):
        """MoEFFN.from_safetensors (the same key names and formats, every key accounted for)
        reading only the router and this rank's experts (per-expert names: the other ranks'
        tensors are never read). A layer with more than a softmax router and routed SwiGLU
        experts (a correction bias, shared experts, expert biases) is refused: this layer
        has none of them."""
        _, world, rank = resolve_group(group)
        checks.check_int("top_k", top_k, 1, what="(the experts per token)")
        device = checks.resolve_device("device", device)

        def mine(E):
            local = _local_experts(E, world, f" ({path}: {E} experts in the router)")
            return range(rank * local, (rank + 1) * local)

        layer = read_layer(path, prefix, experts=mine)
        extra = sorted(set(layer) - {"gate_weight", "w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale"})
        if extra:
            raise checks.in_file(path, f"holds {extra} under prefix {prefix!r}: EPMoEFFN runs a softmax router and "
                                       "routed SwiGLU experts only")
        layer = {k: v.to(device) for k, v in layer.items()}
        return cls(layer.pop("gate_weight"), layer.pop("w_gate_up"), layer.pop("w_down"), top_k, renormalize,
                   group=group, strategy=strategy, **layer)

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def router_logits(self, x):
        return matmul(x, self.gate_weight.t(), out_dtype=torch.float32)

    def forward(self, x, strategy=None):
        """x [T, H] (this rank's tokens) -> [T, H] in x's dtype; ``strategy``: this call's,
        instead of the layer's."""
        checks.check_tensor("x", x, ndim=2, dtypes=(self.gate_weight.dtype,))
        if x.shape[1] != self.gate_weight.shape[1]:
            raise checks.bad_shape("x", f"[T, H] with H = {self.gate_weight.shape[1]} (the layer's hidden size)", x.shape)
        weights, ids = route(self.router_logits(x), self.top_k, self.renormalize)
        return ep_moe_ffn(x, self.w_gate_up, self.w_down, weights, ids, group=self.group,
                          strategy=self.strategy if strategy is None else strategy,
                          w_gate_up_scale=self.w_gate_up_scale, w_down_scale=self.w_down_scale)


def _local_experts(E: int, world: int, where: str = "") -> int:
    if E % world:
        raise checks.bad_value("gate_weight", f"[E, H] with E a multiple of the group's {world} ranks (each holds "
                               f"E / {world} experts){where}", f"E = {E}")
    return E // world
