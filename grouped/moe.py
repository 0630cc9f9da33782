"""MoE expert FFN on grouped_matmul's kernel: route, sort by expert, two fused GEMMs, combine.

    y[t] = sum_j w[t, j] * W2_e (silu(W1_e x_t) * (W3_e x_t)),   e = ids[t, j]

The (token, slot) pairs are sorted by expert on the device; GEMM1 gathers the token rows of x
inside the kernel and applies SwiGLU in its epilogue, GEMM2 multiplies by the routing weight in
its epilogue and writes each pair's row to its own place, and the top-k rows of a token are then
summed in a fixed order. No step reads a value back to the host, so a forward pass can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn

from ..core import checks, configs
from ..core.dispatch import Op
from ..core.launch import Launcher, Request
from ..core.matmul import matmul
from ..core.runtime import INTERPRET, empty, next_pow2
from .kernels import sort_by_expert_kernel
from .ops import grouped_matmul, launch_ragged


def route(logits, top_k: int, renormalize: bool = True):
    """Mixtral / Qwen3 routing: softmax in fp32, top-k, optional renormalisation.

    logits [T, E] (any float dtype) -> (weights fp32 [T, top_k], ids int32 [T, top_k]).
    """
    checks.check_tensor("logits", logits, ndim=2, dtypes=checks.FLOAT_DTYPES)
    E = logits.shape[1]
    checks.check_int("top_k", top_k, 1, E, "(at most the number of experts, logits.shape[1])")
    checks.check_bool("renormalize", renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def sort_by_expert(topk_ids, num_experts: int):
    """Sort the (token, slot) pairs by expert, on the device.

    topk_ids [T, k] -> (pair int32 [T*k], token int32 [T*k], offs int32 [E]): row r of the
    sorted order is pair ``pair[r]`` (= t*k + j) of token ``token[r]`` (= pair // k); expert
    e owns rows [offs[e-1], offs[e]). The sort is stable, so the order (and the result) is the
    same on every run. Ids outside [0, E) (e.g. experts on another rank under expert
    parallelism) sort past offs[-1], where the grouped GEMM writes zeros: they contribute 0.
    Up to SORT_MAX_PAIRS pairs one Triton program sorts them (one launch); more go through
    torch.sort. Both are stable, so both give the same order.
    """
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    P = flat.shape[0]
    if P <= configs.SORT_MAX_PAIRS:
        return _sort_small(flat.contiguous(), num_experts, k)
    # Range-check in the ids' own width before narrowing: an int64 id of 2**32 + 1 is not expert 1.
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int32)
    sorted_ids, pair = torch.sort(flat, stable=True)
    # searchsorted, not bincount: CUDA bincount reads the max id back to the host (a sync).
    experts = torch.arange(num_experts, device=flat.device, dtype=torch.int32)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    return pair.to(torch.int32), (pair // k).to(torch.int32), offs


SORT = Launcher(sort_by_expert_kernel, configs.SORT)


def _sort_small(flat, E: int, k: int):
    P = flat.shape[0]
    pair = torch.empty(P, dtype=torch.int32, device=flat.device)
    token = torch.empty(P, dtype=torch.int32, device=flat.device)
    offs = torch.empty(E, dtype=torch.int32, device=flat.device)
    e_block = next_pow2(E + 1)
    key = (flat.dtype, e_block, flat.get_device())
    plan = SORT.plan(key, lambda: Request(configs.SortKey(e_block), dict(E_BLOCK=e_block, BLOCK=max(16, min(256, 8192 // e_block))),
                                          flat.device))
    SORT.launch(plan, (1,), (flat, pair, token, offs, P, E, k))
    return pair, token, offs


def check_expert_weights(w_gate_up, w_down, H: int) -> None:
    """w_gate_up [E, 2I, H] (E >= 1, gate rows then up rows) and w_down [E, H, I]."""
    E, two_i, H1 = w_gate_up.shape
    if H1 != H or two_i % 2 or E == 0:
        raise checks.bad_shape("w_gate_up", f"[E, 2I, H] = [E >= 1, 2I, {H}] (gate rows then up rows)", w_gate_up.shape)
    checks.check_shape("w_down", w_down, (E, H, two_i // 2), f"[E, H, I] = {[E, H, two_i // 2]}")


def _check_moe(x, w_gate_up, w_down, topk_weights, topk_ids, x_dtypes=checks.FLOAT_DTYPES):
    checks.check_tensor("x", x, ndim=2, dtypes=x_dtypes)
    checks.check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=(x.dtype,))
    checks.check_tensor("w_down", w_down, ndim=3, dtypes=(x.dtype,))
    checks.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=checks.FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    T, H = x.shape
    check_expert_weights(w_gate_up, w_down, H)
    if topk_ids.shape[0] != T:
        raise checks.bad_shape("topk_ids", f"[T, k] with T = {T} (x's rows)", topk_ids.shape)
    checks.check_shape("topk_weights", topk_weights, topk_ids.shape, f"[T, k] = {list(topk_ids.shape)} (topk_ids' shape)")
    checks.check_same_device(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids)


def moe_ffn(x, w_gate_up, w_down, topk_weights, topk_ids):
    """SwiGLU expert FFN: y[t] = sum_j w[t,j] * W2_e(silu(W1_e x_t) * W3_e x_t), e = ids[t,j].

    x [T, H] (fp16, bf16, fp32); w_gate_up [E, 2I, H] (gate rows W1 then up rows W3);
    w_down [E, H, I]; topk_weights [T, k]; topk_ids [T, k] int32/int64 (ids outside [0, E)
    contribute nothing). Returns [T, H] in x's dtype. Deterministic: bitwise the same on a rerun.
    Differentiable in x, w_gate_up, w_down and topk_weights (docs/autograd.md); traceable by
    torch.compile.
    """
    return MOE(x, w_gate_up, w_down, topk_weights, topk_ids, grad_inputs=(x, w_gate_up, w_down, topk_weights))


def _moe_impl(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    _check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    T, H, E, I, k, P = _moe_sizes(x, w_gate_up, topk_ids)
    if P == 0:
        return torch.zeros_like(x)
    pair, token, offs = sort_by_expert(topk_ids, E)

    # GEMM1: h[r] = silu(x[token[r]] @ W1_e^T) * (x[token[r]] @ W3_e^T), rows sorted by expert.
    # B = w_gate_up[e].T, read in place (stride 1 along K: the K-major layout Hopper wants).
    h = empty((P, I), dtype=x.dtype, device=x.device)
    _expert_gemm(x, w_gate_up, h, offs, a_rows=token, swiglu=True)
    # GEMM2: y_pairs[pair[r]] = w[pair[r]] * (h[r] @ W2_e^T), fp32 so the combine rounds once.
    y_pairs = empty((P, H), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _expert_gemm(h, w_down, y_pairs, offs, c_rows=pair, weight=weights)
    # Combine: a plain sum over the k slots of each token, in slot order (no atomics), hence
    # the same bits on every run.
    return y_pairs.view(T, k, H).sum(dim=1).to(x.dtype)


def _moe_sizes(x, w_gate_up, topk_ids):
    """(T, H, E, I, k, P): tokens, hidden size, experts, intermediate size, top-k, pairs."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    k = topk_ids.shape[1]
    return T, H, E, two_i // 2, k, T * k


def _expert_gemm(a, w, c, offs, **kwargs):
    """c[r] = a[r] @ w[e].T for the rows r of expert e (2D x 3D, offs over rows; ``kwargs``:
    launch_ragged's MoE options). w [E, N or 2N, K] is read in place through its transpose."""
    wt = w.transpose(1, 2)
    N = c.shape[1]
    launch_ragged(a, wt, c, offs, ragged="M", G=w.shape[0], M=c.shape[0], N=N, K=a.shape[1],
                  strides_a=(0, a.stride(0), a.stride(1)), strides_b=tuple(wt.stride()),
                  strides_c=(0, c.stride(0), c.stride(1)), rows_per_group=c.shape[0] // w.shape[0], **kwargs)


def _moe_fake(x, w_gate_up, w_down, topk_weights, topk_ids):
    _check_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return torch.empty_like(x)


def _moe_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _moe_backward(ctx, dy):
    dx, dw13, dw2, dweights = MOE_BACKWARD(dy, *ctx.saved_tensors)
    return dx, dw13, dw2, dweights, None


def _moe_backward_impl(dy: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_ffn's gradients (dx, dw_gate_up, dw_down, dtopk_weights) in the same sorted order
    as the forward, with onegemm's grouped GEMMs; every sum runs in a fixed order, so two
    backward passes give the same bits. A registered op of its own: under torch.compile the
    backward is traced as one call, like the forward.

    The forward keeps nothing but its inputs: the routing sort and GEMM1's pre-activation
    [P, 2I] are recomputed (one extra grouped GEMM) rather than stored by every forward call.
    Rows r are (token, slot) pairs sorted by expert e, g/u the gate/up halves of GEMM1:
      dh_u = dy[token] @ W2_e;  dw[pair] = <dh_u, h>;  dh = w * dh_u
      dg = dh * u * silu'(g);  du = dh * silu(g);  dx[token] += [dg, du] @ W13_e
      dW13_e = [dg, du]_e^T @ x[token]_e;  dW2_e = (w * dy[token])_e^T @ h_e
    """
    T, H, E, I, k, P = _moe_sizes(x, w_gate_up, topk_ids)
    if P == 0:
        return torch.zeros_like(x), torch.zeros_like(w_gate_up), torch.zeros_like(w_down), torch.zeros_like(topk_weights)
    pair, token, offs = sort_by_expert(topk_ids, E)
    pair = pair.long()
    h_pre = empty((P, 2 * I), dtype=x.dtype, device=x.device)
    _expert_gemm(x, w_gate_up, h_pre, offs, a_rows=token)
    g, u = h_pre[:, :I].float(), h_pre[:, I:].float()
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dy_s = dy.to(x.dtype)[token]
    w_s = topk_weights.reshape(-1)[pair].float()
    dh_u = grouped_matmul(dy_s, w_down, offs, out_dtype=torch.float32)  # [P, I]: b = W2_e [H, I]
    dweights = torch.empty(P, device=x.device, dtype=torch.float32)
    dweights[pair] = (dh_u * h).sum(1)
    dh = dh_u * w_s[:, None]
    dh_pre = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * silu], dim=1).to(x.dtype)
    dx_s = grouped_matmul(dh_pre, w_gate_up, offs, out_dtype=torch.float32)  # [P, H]: b = W13_e [2I, H]
    dx_pairs = torch.empty_like(dx_s)
    dx_pairs[pair] = dx_s
    dx = dx_pairs.view(T, k, H).sum(1).to(x.dtype)
    dw13 = grouped_matmul(dh_pre.t(), x[token], offs, out_dtype=w_gate_up.dtype)  # 2D x 2D over the rows
    dw2 = grouped_matmul((dy_s.float() * w_s[:, None]).to(x.dtype).t(), h.to(x.dtype), offs, out_dtype=w_down.dtype)
    return dx, dw13, dw2, dweights.view(T, k).to(topk_weights.dtype)


def _moe_backward_fake(dy, x, w_gate_up, w_down, topk_weights, topk_ids):
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down), torch.empty_like(topk_weights)


MOE_BACKWARD = Op("moe_ffn_backward", _moe_backward_impl, _moe_backward_fake)
MOE = Op("moe_ffn", _moe_impl, _moe_fake, _moe_setup, _moe_backward)


# An expert's (gate, up, down) weight names: Mixtral's, then Qwen3-MoE's and DeepSeek-V3's.
_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


class MoEFFN(nn.Module):
    """A Mixtral-style sparse MoE block: router, top-k routing, SwiGLU experts via moe_ffn.

    gate_weight [E, H] (router), w_gate_up [E, 2I, H], w_down [E, H, I]. The router logits
    are computed by onegemm.matmul in fp32 (near-ties then break as in an fp32 reference).
    """

    def __init__(self, gate_weight, w_gate_up, w_down, top_k: int = 2, renormalize: bool = True):
        super().__init__()
        checks.check_tensor("gate_weight", gate_weight, ndim=2, dtypes=checks.FLOAT_DTYPES)
        checks.check_tensor("w_gate_up", w_gate_up, ndim=3, dtypes=(gate_weight.dtype,))
        checks.check_tensor("w_down", w_down, ndim=3, dtypes=(gate_weight.dtype,))
        E, H = gate_weight.shape
        if w_gate_up.shape[0] != E:
            raise checks.bad_shape("w_gate_up", f"[{E}, 2I, {H}] (gate_weight is [E, H] = {[E, H]})", w_gate_up.shape)
        check_expert_weights(w_gate_up, w_down, H)
        checks.check_int("top_k", top_k, 1, E, "(at most the number of experts)")
        checks.check_bool("renormalize", renormalize)
        checks.check_same_device(gate_weight=gate_weight, w_gate_up=w_gate_up, w_down=w_down)
        # Trainable, as nn.Module parameters are; inference runs under torch.inference_mode()
        # (or no_grad), which takes the direct kernel path.
        self.gate_weight = nn.Parameter(gate_weight)
        self.w_gate_up = nn.Parameter(w_gate_up)
        self.w_down = nn.Parameter(w_down)
        self.top_k = top_k
        self.renormalize = renormalize

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def router_logits(self, x):
        return matmul(x, self.gate_weight.t(), out_dtype=torch.float32)

    def forward(self, x):
        """x [T, H] -> [T, H] in x's dtype."""
        checks.check_tensor("x", x, ndim=2, dtypes=(self.w_gate_up.dtype,))
        if x.shape[1] != self.gate_weight.shape[1]:
            raise checks.bad_shape("x", f"[T, H] with H = {self.gate_weight.shape[1]} (the layer's hidden size)", x.shape)
        weights, ids = route(self.router_logits(x), self.top_k, self.renormalize)
        return moe_ffn(x, self.w_gate_up, self.w_down, weights, ids)

    @classmethod
    def from_safetensors(cls, path, prefix: str = "", top_k: int = 2, *, renormalize: bool = True, device=None):
        """Load a layer saved with Hugging Face key names: the router "{prefix}gate.weight"
        [E, H] and for each expert e either Mixtral's "{prefix}experts.{e}.w1.weight" (gate) and
        ".w3." (up) [I, H], ".w2." (down) [H, I], or Qwen3-MoE's / DeepSeek-V3's
        ".gate_proj.", ".up_proj." [I, H] and ".down_proj." [H, I] (whichever expert 0 has).
        E comes from the router's rows. Every tensor is checked for presence, shape and dtype
        (all the router's; FP8 expert weights are refused with their own message).
        ``device``: where the weights go (default: CUDA when kernels run on a GPU, else CPU).
        """
        if device is None:
            device = "cpu" if INTERPRET else "cuda"
        checks.check_int("top_k", top_k, 1, what="(the experts per token)")
        if not isinstance(prefix, str):
            raise checks.bad_type("prefix", "a str", prefix)
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # noqa: BLE001 - missing, a folder, not safetensors, truncated: say which file
            raise checks.in_file(path, f"cannot be read as a safetensors file ({type(e).__name__}: {e})") from e
        with f:
            keys = set(f.keys())

            def load(name, shape=None, dtype=None):
                key = prefix + name
                if key not in keys:
                    near = sorted(k for k in keys if k.endswith(name.split(".")[-2] + ".weight"))[:3]
                    raise checks.in_file(path, f"missing tensor {key!r} (prefix={prefix!r}; keys like it: {near})")
                try:
                    t = f.get_tensor(key)
                except Exception as e:  # noqa: BLE001 - a truncated or corrupted tensor
                    raise checks.in_file(path, f"tensor {key!r} cannot be read ({type(e).__name__}: {e})") from e
                if shape is not None and tuple(t.shape) != tuple(shape):
                    raise checks.in_file(path, f"tensor {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
                if dtype is not None and t.dtype != dtype:
                    raise checks.in_file(path, f"tensor {key!r} has dtype {t.dtype}, expected {dtype} (the router's)")
                return t

            gate = load("gate.weight")
            if gate.dim() != 2:
                raise checks.in_file(path, f"tensor {prefix + 'gate.weight'!r} has shape {tuple(gate.shape)}, expected [E, H]")
            if gate.dtype not in checks.FLOAT_DTYPES:
                raise checks.in_file(path, f"tensor {prefix + 'gate.weight'!r} has dtype {gate.dtype}, expected one of "
                                           f"({checks.dtype_names(checks.FLOAT_DTYPES)})")
            E, H = gate.shape
            g_name, u_name, d_name = next((n for n in _EXPERT_NAMES if f"{prefix}experts.0.{n[0]}.weight" in keys),
                                          _EXPERT_NAMES[0])
            first = f"experts.0.{g_name}.weight"
            w1 = load(first)
            if w1.dtype in checks.FP8_DTYPES:
                raise checks.in_file(path, f"tensor {prefix + first!r} is {w1.dtype}: FP8 expert weights (with "
                                           "weight_scale_inv) are not read by MoEFFN yet; dequantise them first")
            if w1.dtype != gate.dtype:
                raise checks.in_file(path, f"tensor {prefix + first!r} has dtype {w1.dtype}, expected {gate.dtype} (the router's)")
            if w1.dim() != 2 or w1.shape[1] != H:
                raise checks.in_file(path, f"tensor {prefix + first!r} has shape {tuple(w1.shape)}, expected [I, {H}]")
            I = w1.shape[0]
            gate_up, down = [], []
            for e in range(E):
                w1 = load(f"experts.{e}.{g_name}.weight", (I, H), gate.dtype)
                w3 = load(f"experts.{e}.{u_name}.weight", (I, H), gate.dtype)
                gate_up.append(torch.cat([w1, w3], dim=0))
                down.append(load(f"experts.{e}.{d_name}.weight", (H, I), gate.dtype))
        return cls(
            gate.to(device), torch.stack(gate_up).to(device), torch.stack(down).to(device),
            top_k=top_k, renormalize=renormalize,
        )
