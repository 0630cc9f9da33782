"""The collectives expert parallelism needs, with gradients, over torch.distributed.

Eager calls use torch.distributed's own collectives (NCCL on GPUs, gloo on CPU) inside
autograd.Functions: they are stream-ordered on a GPU (so a CUDA graph can capture the
all-gather and the reduce-scatter), and their outputs are plain tensors, ready when the call
returns. Under torch.compile the functional collectives take their place, so Dynamo traces
them without a graph break. fp8 tensors travel as their bytes (gloo and NCCL have no fp8
type), and every input is made contiguous (both backends need it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..core import checks

# torch >= 2.13 names these collectives *_single (the functional ones with autograd built in)
# and warns on the older names, which earlier releases have alone.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_FUNC_ALL_GATHER = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_FUNC_REDUCE_SCATTER = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
_FUNC_ALL_TO_ALL = funcol.all_to_all_single_autograd


# With one rank every collective here is the identity, and is skipped: the layer then costs
# what moe_ffn costs. The GPU tests turn this off to run NCCL's one-rank collectives too.
SKIP_ONE_RANK = True


def alone(group) -> bool:
    return SKIP_ONE_RANK and dist.get_world_size(group) == 1


def resolve_group(group):
    """(group, world size, rank in it); ``group`` None means the default group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise checks.bad_value("group", "a process group of an initialised torch.distributed (call "
                               "torch.distributed.init_process_group first)", "no process group")
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise checks.bad_type("group", "a torch.distributed.ProcessGroup or None (the default group)", group)
    return group, dist.get_world_size(group), dist.get_rank(group)


def _wire(t):
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in checks.FP8_DTYPES else t


def _all_gather(x, group):
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(_wire(out), _wire(x), group=group)
    return out


def _reduce_scatter(x, group):
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    _REDUCE_SCATTER(out, x.contiguous(), group=group)
    return out


def _all_to_all(x, out_splits, in_splits, group):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(_wire(out), _wire(x), out_splits, in_splits, group=group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _traced(x) -> bool:
    # Under torch.compile the functional collectives (fp8 is not traced: it has no gradient to
    # keep and travels as a bytes view, which stays eager).
    return torch.compiler.is_compiling() and x.dtype not in checks.FP8_DTYPES


def all_gather(x, group):
    """[n, ...] on each of W ranks -> [W * n, ...], rank-major; the gradient reduce-scatters."""
    if alone(group):
        return x
    if _traced(x):
        return _FUNC_ALL_GATHER(x.contiguous(), 0, group)
    return _AllGather.apply(x, group) if x.requires_grad else _all_gather(x, group)


def reduce_scatter(x, group):
    """[W * n, ...] on each rank -> this rank's [n, ...] block of the sum over ranks; the
    gradient all-gathers."""
    if alone(group):
        return x
    if _traced(x):
        return _FUNC_REDUCE_SCATTER(x.contiguous(), "sum", 0, group)
    return _ReduceScatter.apply(x, group) if x.requires_grad else _reduce_scatter(x, group)


def all_to_all(x, out_splits: list, in_splits: list, group):
    """Rows in_splits[d] of x to rank d; the rows from rank s arrive in order of s. The
    gradient sends the rows back the way they came."""
    if alone(group):
        return x
    if _traced(x):
        return _FUNC_ALL_TO_ALL(x.contiguous(), out_splits, in_splits, group)
    if x.requires_grad:
        return _AllToAll.apply(x, out_splits, in_splits, group)
    return _all_to_all(x, out_splits, in_splits, group)
