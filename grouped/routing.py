"""MoE routing: router logits [T, E] -> (weights fp32 [T, k], expert ids int32 [T, k]).

One function, ``route``, whose parameters name each choice the model families make (the table in
docs/moe.md): how logits become scores (softmax or sigmoid, before or after the top-k), a
correction bias used for selection only, group-limited selection, renormalisation and a
scaling factor. Everything is torch ops on the logits' device: no value is read back to the
host, so it runs inside a CUDA graph, and torch.compile traces it.

Decode-sized calls on a GPU (up to ROUTE_MAX_TOKENS tokens, no gradient asked for) run
one fused Triton kernel (kernels.route_kernel) instead of the torch ops' dozen launches; it makes
the same choices by the same tie rule.

Ties are broken one way everywhere: experts (and groups) are taken by value descending, the
lower index first among equal values (a stable descending sort), so the ids are the same on
every run and every device.
"""

from __future__ import annotations

import math

import torch

from ..core import checks
from ..core.launch import Launcher, Request
from ..core.runtime import next_pow2
from ..core.tiles import Operand
from .configs import ROUTE_MAX_E_BLOCK, ROUTE_MAX_TOKENS, RouteKey
from .kernels import RouteSpec, route_kernel

# How router logits L become the routing weights, and on what the top-k is taken.
#   softmax:       p = softmax(L) over all experts; top-k of p (+ bias); w = p of the chosen
#                  (Mixtral, Qwen2-MoE, Qwen3-MoE).
#   sigmoid:       s = sigmoid(L); top-k of s (+ bias); w = s of the chosen (DeepSeek-V3/R1,
#                  Kimi-K2, GLM-4.5).
#   topk_softmax:  top-k of L, then w = softmax over the k chosen logits (gpt-oss).
#   topk_sigmoid:  top-k of L, then w = sigmoid of each chosen logit (Llama-4).
SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")

# The denominator's guard of the renormalisation (DeepSeek-V3's reference): sigmoid weights
# can all underflow to 0. Below an ulp of any softmax top-k sum (>= k / E), so softmax
# routing is unchanged by it.
RENORM_EPS = 1e-20


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest along the last dim, value descending, the lower index first on ties."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits, top_k: int, renormalize: bool = True, *, scoring: str = "softmax", correction_bias=None,
          n_group: int = 1, topk_group=None, routed_scaling_factor: float = 1.0):
    """Router logits -> (topk_weights fp32 [T, top_k], topk_ids int32 [T, top_k]), moe_ffn's inputs.

    logits [T, E] (any float dtype; routing runs in fp32). ``scoring`` (one of SCORINGS):
    "softmax" (Mixtral, Qwen), "sigmoid" (DeepSeek-V3, Kimi-K2, GLM-4.5), "topk_softmax"
    (gpt-oss: top-k of the logits, softmax over the k), "topk_sigmoid" (Llama-4: top-k of the
    logits, sigmoid of each).

    With "softmax" or "sigmoid" scores:
      * ``correction_bias`` [E] (DeepSeek-V3's e_score_correction_bias) is added to the scores
        for the choice only; the weights are the unbiased scores of the chosen experts.
      * ``n_group`` > 1: group-limited selection. The E experts form n_group groups of
        E / n_group contiguous experts; a group's score is the sum of its two best (score +
        bias) with a correction bias, its best score without one; only the ``topk_group``
        best groups are candidates.
    ``renormalize``: divide the k weights by their sum (+ 1e-20). ``routed_scaling_factor``
    multiplies the weights after that (DeepSeek-V3's 2.5), whether renormalised or not.

    Ties: value descending, the lower expert (group) index first. Deterministic, no host sync.
    Differentiable in logits (the ids are a choice, not differentiated).
    """
    _check_route(logits, top_k, renormalize, scoring, correction_bias, n_group, topk_group, routed_scaling_factor)
    if use_fused(logits, n_group):
        return _route_fused(logits, top_k, renormalize, scoring, correction_bias, n_group, topk_group,
                            routed_scaling_factor)
    return _route_torch(logits, top_k, renormalize, scoring, correction_bias, n_group, topk_group,
                        routed_scaling_factor)


def _check_route(logits, top_k, renormalize, scoring, correction_bias, n_group, topk_group, routed_scaling_factor):
    """route's argument checks: a ValueError or TypeError naming the argument."""
    checks.check_tensor("logits", logits, ndim=2, dtypes=checks.FLOAT_DTYPES)
    T, E = logits.shape
    checks.check_int("top_k", top_k, 1, E, "(at most the number of experts, logits.shape[1])")
    checks.check_bool("renormalize", renormalize)
    if not isinstance(scoring, str):
        raise checks.bad_type("scoring", f"one of {SCORINGS}", scoring)
    checks.check_choice("scoring", scoring, SCORINGS)
    selects_on_scores = scoring in ("softmax", "sigmoid")
    if correction_bias is not None:
        if not selects_on_scores:
            raise checks.bad_value("correction_bias", "None with scoring='topk_*' (the top-k is taken on the "
                                   "logits; a router bias belongs in the logits)", "a tensor")
        checks.check_tensor("correction_bias", correction_bias, ndim=1, dtypes=checks.FLOAT_DTYPES)
        checks.check_shape("correction_bias", correction_bias, (E,), f"[E] = [{E}] (one value per expert)")
        checks.check_same_device(logits=logits, correction_bias=correction_bias)
    checks.check_int("n_group", n_group, 1, E, "(the expert groups of group-limited routing; 1: none)")
    if n_group > 1:
        if not selects_on_scores:
            raise checks.bad_value("n_group", "1 with scoring='topk_*'", n_group)
        if E % n_group:
            raise checks.bad_value("n_group", f"a divisor of the number of experts E = {E}", n_group)
        if correction_bias is not None and E // n_group < 2:
            raise checks.bad_value("n_group", f"at most E / 2 = {E // 2} with a correction_bias (a group's score "
                                   "is the sum of its two best experts)", n_group)
        checks.check_int("topk_group", topk_group, 1, n_group, f"(the groups kept, at most n_group = {n_group})")
        if top_k > topk_group * (E // n_group):
            raise checks.bad_value("top_k", f"at most topk_group * E / n_group = {topk_group * (E // n_group)} "
                                   "(the experts of the kept groups)", top_k)
    elif topk_group is not None:
        checks.check_int("topk_group", topk_group, 1, 1, "(1 or None when n_group is 1)")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise checks.bad_type("routed_scaling_factor", "a float", routed_scaling_factor)
    if not (math.isfinite(routed_scaling_factor) and routed_scaling_factor > 0):
        raise checks.bad_value("routed_scaling_factor", "a finite number > 0", routed_scaling_factor)


def _route_torch(logits, top_k, renormalize, scoring, correction_bias, n_group, topk_group, routed_scaling_factor):
    """route in torch ops: on the CPU, with a gradient, under torch.compile and past the fused
    kernel's sizes (use_fused)."""
    T, E = logits.shape
    L = logits.float()
    if scoring in ("softmax", "sigmoid"):
        scores = torch.softmax(L, dim=-1) if scoring == "softmax" else torch.sigmoid(L)
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if n_group > 1:
            grouped = choice.view(T, n_group, E // n_group)
            if correction_bias is None:
                group_scores = grouped.amax(dim=-1)
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = torch.zeros(T, n_group, dtype=torch.bool, device=L.device)
            kept.scatter_(1, top_indices(group_scores, topk_group), True)
            choice = choice.masked_fill(~kept.repeat_interleave(E // n_group, dim=1), float("-inf"))
        ids = top_indices(choice, top_k)
        weights = scores.gather(1, ids)
    else:
        ids = top_indices(L, top_k)
        chosen = L.gather(1, ids)
        weights = torch.softmax(chosen, dim=-1) if scoring == "topk_softmax" else torch.sigmoid(chosen)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    if routed_scaling_factor != 1:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


ROUTE = Launcher(route_kernel, "route")


def route_spec(E: int, top_k: int, renormalize: bool, scoring: str, has_bias: bool, n_group: int, topk_group) -> RouteSpec:
    """The fused kernels' constexpr of route's choices (kernels.route_tokens), the experts
    held as [G_BLOCK, GROUP_BLOCK] (powers of two >= 2)."""
    return RouteSpec(GROUP=E // n_group, N_GROUP=n_group, G_BLOCK=max(2, next_pow2(n_group)),
                     GROUP_BLOCK=max(2, next_pow2(E // n_group)), TOPK_GROUP=topk_group or 1, TOP_K=top_k,
                     K_BLOCK=max(2, next_pow2(top_k)), SCORING=SCORINGS.index(scoring), HAS_BIAS=has_bias,
                     RENORMALIZE=renormalize)


def e_block(spec: RouteSpec) -> int:
    """The experts' block (G_BLOCK * GROUP_BLOCK): what a token's routing holds."""
    return spec.G_BLOCK * spec.GROUP_BLOCK


def use_fused(logits, n_group: int) -> bool:
    """Whether route() runs the fused kernel: decode-sized, on a GPU, no gradient, not traced."""
    return (logits.is_cuda and logits.shape[0] <= ROUTE_MAX_TOKENS
            and e_block(route_spec(logits.shape[1], 1, False, "softmax", False, n_group, 1)) <= ROUTE_MAX_E_BLOCK
            and not (logits.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling())


def _route_fused(logits, top_k, renormalize, scoring, correction_bias, n_group, topk_group, scale):
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return w, ids
    spec = route_spec(E, top_k, renormalize, scoring, correction_bias is not None, n_group, topk_group)
    bias = w if correction_bias is None else correction_bias.float().contiguous()
    key = (logits.dtype, logits.get_device(), spec)
    plan = ROUTE.plan_for(lambda: Request(RouteKey(e_block(spec)), dict(R=spec, TOKENS=1), logits.device), key)
    ROUTE.launch(plan, (T,), (Operand(logits, *logits.stride()), bias, w, ids, T, float(scale)))
    return w, ids
