"""MoEFFN: a whole sparse-MoE block (router, routing, routed experts via moe_ffn, shared experts).

The routed experts run on moe_ffn's kernels; the router is onegemm.matmul in fp32 and the
shared experts a dense SwiGLU MLP on onegemm.linear, so every GEMM of the block is onegemm's
and every parameter has a gradient (bf16/fp32 experts). Loading from checkpoints: loading.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from ..blockscaled.linear import register_fp8_training
from ..core import checks, configs
from ..core.dispatch import transforms_active, wants_grad
from ..core.matmul import linear, matmul
from ..core.scaling import MXFP4_PREPACKED, weight_4bit
from .moe import moe_ffn, moe_routed
from .moe_steps import (check_expert_scales, check_expert_weights, check_layer_tensors, check_w4_experts,
                        sort_by_expert)
from .moe_train import check_fp8_training
from .ops import grouped_matmul
from .prepack import PrepackedMxfp4, prepack_mxfp4
from .routing import route


class MoEFFN(nn.Module):
    """A sparse MoE block: router, routing (``route``'s options), SwiGLU experts via moe_ffn,
    and optional shared experts.

    gate_weight [E, H] (router), w_gate_up [E, 2I, H] (gate rows, then up rows), w_down
    [E, H, I]. The router logits x @ gate_weight.T are computed by onegemm.matmul with fp32
    outputs; with ``scoring="sigmoid"`` (DeepSeek-V3's router) from fp32 operands as well.
    Routing: ``top_k``, ``renormalize`` and the keywords ``scoring``, ``correction_bias``
    (a buffer, not trained), ``n_group``, ``topk_group``, ``routed_scaling_factor``, as in
    onegemm.route. ``weights_on_input`` (Llama-4): each routing weight scales its expert's
    input, y = sum_j FFN_e(w_j * x), instead of its output.
    Shared experts, run on every token and added: ``shared_w_gate_up`` [2S, H] (gate rows,
    then up rows) and ``shared_w_down`` [H, S], a SwiGLU MLP (DeepSeek-V3 / GLM-4.5's
    n_shared experts as one of S = n_shared * I, Llama-4's shared expert); with
    ``shared_gate`` [1, H] its output is scaled by sigmoid(x @ shared_gate.T) (Qwen2-MoE).
    FP8 experts: w_gate_up and w_down in float8_e4m3fn with w_gate_up_scale and w_down_scale
    (moe_ffn's format; ``quantize_experts`` makes it); x, the router and the shared experts
    keep gate_weight's dtype, and the whole layer is frozen (FP8 experts have no gradient).
    4-bit experts (moe_ffn's MXFP4 and INT4 formats, weight-only; gpt-oss's biases and SwiGLU
    too): the same, gate_weight bf16 / fp16.
    gpt-oss: ``gate_bias`` [E] (the router's bias), ``w_gate_up_bias`` [E, 2I] and
    ``w_down_bias`` [E, H] (the experts' biases) and ``swiglu_limit`` (its clamped SwiGLU:
    g = min(g, limit), u = clamp(u, -limit, limit), a = g * sigmoid(swiglu_alpha * g) * (u + 1));
    these experts run on grouped_matmul with its bias, and elementwise torch between the GEMMs.
    """

    def __init__(self, gate_weight, w_gate_up, w_down, top_k: int = 2, renormalize: bool = True, *,
                 w_gate_up_scale=None, w_down_scale=None, scoring: str = "softmax", correction_bias=None,
                 n_group: int = 1, topk_group=None, routed_scaling_factor: float = 1.0,
                 weights_on_input: bool = False, shared_w_gate_up=None, shared_w_down=None, shared_gate=None,
                 gate_bias=None, w_gate_up_bias=None, w_down_bias=None, swiglu_limit=None,
                 swiglu_alpha: float = 1.702):
        super().__init__()
        w4 = isinstance(w_gate_up, torch.Tensor) and bool(weight_4bit(w_gate_up))
        if w4 and MXFP4_PREPACKED in (w_gate_up.dtype, w_down.dtype):
            raise checks.bad_dtype("w_gate_up", "experts as stored (float4_e2m1fn_x2 MXFP4 or int32 INT4; "
                                   "prepack_experts() rewrites MXFP4 ones in fragment order)", MXFP4_PREPACKED)
        if w4:  # weight-only: x, the router and the biases in gate_weight's 16-bit dtype
            checks.check_tensor("gate_weight", gate_weight, ndim=2, dtypes=(torch.bfloat16, torch.float16))
            fp8 = False
        else:
            fp8 = check_layer_tensors(gate_weight, w_gate_up, w_down, w_gate_up_scale, w_down_scale)
        E, H = gate_weight.shape
        if w_gate_up.shape[0] != E:
            raise checks.bad_shape("w_gate_up", f"[{E}, 2I, {H}] (gate_weight is [E, H] = {[E, H]})", w_gate_up.shape)
        if w4:
            check_w4_experts(w_gate_up, w_down, w_gate_up_scale, w_down_scale, H)
        else:
            check_expert_weights(w_gate_up, w_down, H)
        checks.check_bool("weights_on_input", weights_on_input)
        checks.check_same_device(gate_weight=gate_weight, w_gate_up=w_gate_up, w_down=w_down)
        self.routing = dict(scoring=scoring, n_group=n_group, topk_group=topk_group,
                            routed_scaling_factor=routed_scaling_factor)
        # route() checks every routing option (with its own messages, the bias's type and device
        # included) on one dummy row of logits on gate_weight's device.
        route(torch.zeros(1, E, device=gate_weight.device), top_k, renormalize,
              correction_bias=correction_bias, **self.routing)
        _check_shared(shared_w_gate_up, shared_w_down, shared_gate, gate_weight)
        biased = _check_gpt_oss(gate_bias, w_gate_up_bias, w_down_bias, swiglu_limit, swiglu_alpha, gate_weight,
                                w_gate_up, fp8, weights_on_input)
        # Trainable, as nn.Module parameters are; inference runs under torch.inference_mode()
        # (or no_grad), which takes the direct kernel path. FP8 experts have no gradient.
        train = not (fp8 or w4)
        self.gate_weight = nn.Parameter(gate_weight, requires_grad=train)
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=train)
        self.w_down = nn.Parameter(w_down, requires_grad=train)
        if fp8:
            check_expert_scales(w_gate_up, w_down, w_gate_up_scale, w_down_scale)
        self.register_buffer("w_gate_up_scale", w_gate_up_scale)
        self.register_buffer("w_down_scale", w_down_scale)
        self.register_buffer("correction_bias", None if correction_bias is None else correction_bias.float())
        for name, t in (("shared_w_gate_up", shared_w_gate_up), ("shared_w_down", shared_w_down),
                        ("shared_gate", shared_gate)):
            setattr(self, name, None if t is None else nn.Parameter(t, requires_grad=train))
        for name, t in (("gate_bias", gate_bias), ("w_gate_up_bias", w_gate_up_bias), ("w_down_bias", w_down_bias)):
            setattr(self, name, None if t is None else nn.Parameter(t))
        self.biased_experts = biased
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.swiglu_alpha = float(swiglu_alpha)
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_on_input = weights_on_input
        self.fp8_training = False  # onegemm.fp8_training(layer) sets it (check_fp8_training)
        self.prepacked = None  # (H, I, gate_up) once prepack_experts has run

    def prepack_experts(self) -> "MoEFFN":
        """MXFP4 experts rewritten in place in fragment order (onegemm.prepack_mxfp4), the
        layout the fast 4-bit K loop reads; they take the stored bytes' memory plus the
        padding of H and I to the 128 block. ``state_dict`` still gives (and ``load_state_dict``
        takes) the experts as stored. Returns the layer."""
        if weight_4bit(self.w_gate_up) != "mxfp4" or self.prepacked is not None:
            raise checks.bad_value("module", "an MoEFFN with MXFP4 experts as stored for prepack_experts",
                                   "prepacked ones" if self.prepacked is not None else
                                   f"{weight_4bit(self.w_gate_up).upper() or self.w_gate_up.dtype} experts")
        H, I = self.gate_weight.shape[1], self.w_gate_up.shape[1] // 2
        gate_up = not self.biased_experts  # gpt-oss's GEMMs keep the rows in order (gpt_oss_experts)
        p13 = prepack_mxfp4(self.w_gate_up, self.w_gate_up_scale, gate_up=gate_up)
        p2 = prepack_mxfp4(self.w_down, self.w_down_scale)
        self.w_gate_up = nn.Parameter(p13.values, requires_grad=False)
        self.w_down = nn.Parameter(p2.values, requires_grad=False)
        self.w_gate_up_scale, self.w_down_scale = p13.scales, p2.scales
        self.prepacked = (H, I, gate_up)
        return self

    def experts(self) -> tuple:
        """(w_gate_up, w_down, their scales as moe_ffn's keywords): the routed experts as the
        kernels take them (PrepackedMxfp4s and no scales once prepacked)."""
        if self.prepacked is None:
            return self.w_gate_up, self.w_down, dict(w_gate_up_scale=self.w_gate_up_scale,
                                                     w_down_scale=self.w_down_scale)
        H, I, gate_up = self.prepacked
        return (PrepackedMxfp4(self.w_gate_up, self.w_gate_up_scale, H, gate_up),
                PrepackedMxfp4(self.w_down, self.w_down_scale, I), {})

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.prepacked is not None:  # the experts as stored
            w13, w2, _ = self.experts()
            (q13, s13), (q2, s2) = w13.unpack(), w2.unpack()
            destination.update({prefix + "w_gate_up": q13, prefix + "w_down": q2, prefix + "w_gate_up_scale": s13,
                                prefix + "w_down_scale": s2})

    def _load_from_state_dict(self, state_dict, prefix, *args):
        names = [prefix + n for n in ("w_gate_up", "w_gate_up_scale", "w_down", "w_down_scale")]
        if self.prepacked is not None and all(n in state_dict for n in names):
            q13, s13, q2, s2 = (state_dict[n] for n in names)  # as stored: prepacked here
            gate_up = self.prepacked[2]
            p13, p2 = prepack_mxfp4(q13, s13, gate_up=gate_up), prepack_mxfp4(q2, s2)
            state_dict = {**state_dict, **dict(zip(names, (p13.values, p13.scales, p2.values, p2.scales)))}
        super()._load_from_state_dict(state_dict, prefix, *args)

    def check_fp8_training(self) -> None:
        """Whether the routed experts can train in FP8 (moe_ffn's fp8_training): 16/32-bit
        experts without biases, 2I and H multiples of 128; a ValueError says what stands in
        the way."""
        if self.w_gate_up_scale is not None or self.biased_experts:
            raise checks.bad_value("module", "MoEFFN layers with 16/32-bit experts and no expert biases for "
                                   "fp8_training (pass a module_filter_fn that leaves this one out)",
                                   "biased (gpt-oss) experts" if self.biased_experts else
                                   f"{weight_4bit(self.w_gate_up).upper() or 'fp8'} experts")
        check_fp8_training(self.w_gate_up)

    @property
    def num_experts(self) -> int:
        return self.gate_weight.shape[0]

    def extra_repr(self) -> str:
        E, H = self.gate_weight.shape
        shared = "none" if self.shared_w_down is None else (
            f"{self.shared_w_down.shape[1]}" + (" gated" if self.shared_gate is not None else ""))
        intermediate = (self.prepacked[1] if self.prepacked is not None else
                        self.w_down.shape[2] * {"mxfp4": 2, "int4": 8}.get(weight_4bit(self.w_down), 1))
        return (f"experts={E}, hidden={H}, intermediate={intermediate}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}, scoring={self.routing['scoring']!r}, "
                f"n_group={self.routing['n_group']}, correction_bias={self.correction_bias is not None}, "
                f"weights_on_input={self.weights_on_input}, shared={shared}"
                + (", fp8_training=True" if self.fp8_training else ""))

    def router_logits(self, x):
        if self.routing["scoring"] == "sigmoid" and x.dtype != torch.float32:
            # DeepSeek-V3's router (transformers' too) multiplies in fp32: the near-ties of its
            # grouped sigmoid top-k flip under a 16-bit GEMM's products and accumulation.
            bias = None if self.gate_bias is None else self.gate_bias.float()
            return matmul(x.float(), self.gate_weight.float().t(), bias=bias)
        return matmul(x, self.gate_weight.t(), bias=self.gate_bias, out_dtype=torch.float32)

    def route(self, x):
        """x [T, H] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]): this layer's routing."""
        return route(self.router_logits(x), self.top_k, self.renormalize, correction_bias=self.correction_bias,
                     **self.routing)

    def forward(self, x):
        """x [T, H] -> [T, H] in x's dtype (gate_weight's)."""
        checks.check_tensor("x", x, ndim=2, dtypes=(self.gate_weight.dtype,))
        if x.shape[1] != self.gate_weight.shape[1]:
            raise checks.bad_shape("x", f"[T, H] with H = {self.gate_weight.shape[1]} (the layer's hidden size)", x.shape)
        w13, w2, scales = self.experts()
        if self._routes_in_moe(x):  # the routing in moe_ffn's prep launch
            y = moe_routed(x, self.router_logits(x), w13, w2, self.correction_bias, **scales,
                           top_k=self.top_k, renormalize=self.renormalize, **self.routing)
            return y if self.shared_w_down is None else y + self.shared_experts(x)
        weights, ids = self.route(x)
        fp8 = dict(fp8_training=True) if self.fp8_training else {}
        if self.biased_experts:
            y = self.gpt_oss_experts(x, weights, ids)
        elif self.weights_on_input:
            # Row t*k+j of the expanded input is w[t, j] * x[t], sent to expert ids[t, j] with
            # weight 1; the k rows of a token are summed after.
            T, k = ids.shape
            xw = (x[:, None, :] * weights[:, :, None].to(x.dtype)).reshape(T * k, -1)
            ones = torch.ones(T * k, 1, dtype=torch.float32, device=x.device)
            y = moe_ffn(xw, w13, w2, ones, ids.reshape(T * k, 1), **scales, **fp8)
            y = y.view(T, k, -1).sum(dim=1) if k > 1 else y
        else:
            y = moe_ffn(x, w13, w2, weights, ids, **scales, **fp8)
        if self.shared_w_down is not None:
            y = y + self.shared_experts(x)
        return y

    def _routes_in_moe(self, x) -> bool:
        """Whether the forward routes inside moe_routed: inference (nothing records a
        gradient), eager, the plain SwiGLU experts. (Grad mode first: under inference_mode
        the parameters are not walked on every call.)"""
        return x.__class__ is torch.Tensor and not (
            self.biased_experts or self.weights_on_input or self.fp8_training or torch.compiler.is_compiling()
            or transforms_active() or torch.is_grad_enabled() and wants_grad(x, *self.parameters()))

    def warmup(self, max_tokens: int, *, threads: int = 4) -> list[int]:
        """Compile every kernel the inference forward of 1 to ``max_tokens`` tokens can take,
        so that no later call (a server's CUDA-graph capture at each batch size, a new token
        count) waits for Triton: one forward under torch.inference_mode on zeros at each of
        ``core.configs.token_counts(max_tokens, (1, top_k))`` (every token-count bucket of the
        layer's tuned keys, and in each every kind of count Triton compiles apart), ``threads``
        of them at a time (each compile's ptxas runs as a process of its own). Triton's on-disk
        cache keeps the kernels for the next process. Returns the token counts run. Training
        forwards (gradients recorded) compile at their first call."""
        checks.check_int("max_tokens", max_tokens, 1)
        checks.check_int("threads", threads, 1)
        counts = configs.token_counts(max_tokens, (1, self.top_k))
        H, dtype, device = self.gate_weight.shape[1], self.gate_weight.dtype, self.gate_weight.device

        def forward(t):
            with torch.inference_mode():
                self(torch.zeros(t, H, dtype=dtype, device=device))

        # the largest first: they compile the most, and the pool's last calls are short
        with ThreadPoolExecutor(threads) as pool:
            for done in [pool.submit(forward, t) for t in reversed(counts)]:
                done.result()  # a call's error, raised here
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return counts

    def gpt_oss_experts(self, x, weights, ids):
        """gpt-oss's experts: y[t] = sum_j w[t, j] (W2_e a + b2_e), a = the clamped SwiGLU of
        W13_e x_t + b13_e; the pairs sorted by expert (as moe_ffn does) and the two GEMMs
        grouped_matmul's, with their bias."""
        T, k = ids.shape
        pair, token, offs = sort_by_expert(ids, self.num_experts)
        w13, w2, s13, s2 = _grouped_experts(*self.experts())
        h = grouped_matmul(x[token.long()], w13, offs, bias=self.w_gate_up_bias, scale_b=s13)
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
        a = gate * torch.sigmoid(self.swiglu_alpha * gate) * (up + 1)
        out = grouped_matmul(a, w2, offs, bias=self.w_down_bias, scale_b=s2)
        out = out * weights.reshape(-1)[pair.long()].to(out.dtype)[:, None]
        y = torch.zeros(T * k, x.shape[1], dtype=out.dtype, device=x.device).index_copy(0, pair.long(), out)
        return y.view(T, k, -1).sum(dim=1)

    def shared_experts(self, x):
        """The shared experts' output [T, H] (gated for Qwen2-MoE), on onegemm.linear."""
        gate, up = linear(x, self.shared_w_gate_up).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, self.shared_w_down)
        if self.shared_gate is not None:
            y = torch.sigmoid(linear(x, self.shared_gate)) * y
        return y

    @classmethod
    def from_safetensors(cls, path, prefix: str = "", top_k: int = 2, *, renormalize: bool = True, device=None,
                         **routing):
        """Load a layer from one safetensors file with Hugging Face key names under ``prefix``.

        Routing is given here (``top_k``, ``renormalize`` and ``route``'s keywords
        ``scoring``, ``n_group``, ``topk_group``, ``routed_scaling_factor``, plus
        ``weights_on_input``); what is in the file is read from it: the router
        ("gate.weight" or Llama-4's "router.weight"), a correction bias
        ("gate.e_score_correction_bias", needs scoring="sigmoid"), the experts (per expert:
        Mixtral's w1/w3/w2 or gate_proj/up_proj/down_proj; or fused: transformers v5's
        experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I], Llama-4's
        [E, H, 2I] / [E, I, H]), bf16/fp16/fp32 or FP8 with weight_scale_inv, and shared
        experts ("shared_experts.*", "shared_expert.*" with "shared_expert_gate.weight").
        Every key under the prefix must be accounted for: an error names the file, the key
        and what was found. docs/moe.md lists the layouts. ``device``: where the weights go
        (default: CUDA when kernels run on a GPU, else CPU).
        """
        from .loading import read_file_layer

        return read_file_layer(cls, path, prefix, top_k, renormalize, device, routing)

    @classmethod
    def from_pretrained(cls, path, layer: int, *, device=None):
        """Load MoE layer ``layer`` of a Hugging Face checkpoint folder (config.json and
        model.safetensors or a sharded model.safetensors.index.json; only the shards that hold
        the layer are opened). config.json's model_type decides the family and its routing:
        mixtral, qwen2_moe, qwen3_moe, deepseek_v3, kimi_k2, glm4_moe, llama4 / llama4_text,
        gpt_oss.
        A dense layer, or a family or option onegemm does not implement, is a ValueError
        that names the file and why. docs/moe.md gives the config fields read.
        """
        from .loading import read_pretrained_layer

        return read_pretrained_layer(cls, path, layer, device)

    @classmethod
    def from_state_dict(cls, state_dict, config, prefix: str = "", *, device=None):
        """The layer from a model's tensors in memory: e.g. a transformers MoE block's
        ``state_dict()`` and its model's config (a transformers config or a config.json dict:
        model_type decides the family and routing, as in from_pretrained). The keys under
        ``prefix`` are read as from_safetensors reads a file's (transformers' in-memory layout
        is its fused one) and every one must be accounted for. ``device``: where the layer
        goes (default: the tensors' own; they are used in place, not copied, where MoEFFN's
        layout is theirs).
        """
        from .loading import read_state_dict_layer

        return read_state_dict_layer(cls, state_dict, config, prefix, device)


def _grouped_experts(w13, w2, scales) -> tuple:
    """``MoEFFN.experts()`` as grouped_matmul's b operands: (w13, w2, scale_b13, scale_b2),
    the weights [E, K, N] (transposed views) and 4-bit scales likewise (prepacked: as they are)."""
    if isinstance(w13, PrepackedMxfp4):
        return w13, w2, None, None
    s13, s2 = scales["w_gate_up_scale"], scales["w_down_scale"]
    return (w13.transpose(1, 2), w2.transpose(1, 2), None if s13 is None else s13.transpose(1, 2),
            None if s2 is None else s2.transpose(1, 2))


def _check_gpt_oss(gate_bias, b13, b2, limit, alpha, gate_weight, w_gate_up, fp8, weights_on_input) -> bool:
    """gpt-oss's biases and clamped SwiGLU: all three biases and the limit, or none."""
    given = [n for n, v in (("gate_bias", gate_bias), ("w_gate_up_bias", b13), ("w_down_bias", b2),
                            ("swiglu_limit", limit)) if v is not None]
    if not given:
        return False
    for name in ("gate_bias", "w_gate_up_bias", "w_down_bias", "swiglu_limit"):
        if name not in given:
            raise checks.bad_value(name, f"given with {', '.join(given)} (gpt-oss experts need gate_bias, "
                                   "w_gate_up_bias, w_down_bias and swiglu_limit)", None)
    if fp8 or weights_on_input:
        raise checks.bad_value("w_gate_up_bias", "None with FP8 experts or weights_on_input (gpt-oss experts are "
                               "bf16/fp16/fp32, weighted at the output)", "a tensor")
    E, H = gate_weight.shape
    two_i = w_gate_up.shape[1]
    for name, t, shape in (("gate_bias", gate_bias, (E,)), ("w_gate_up_bias", b13, (E, two_i)),
                           ("w_down_bias", b2, (E, H))):
        checks.check_tensor(name, t, ndim=len(shape), dtypes=(gate_weight.dtype,))
        checks.check_shape(name, t, shape, str(list(shape)))
    for name, v in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise checks.bad_value(name, "a number > 0", repr(v))
    checks.check_same_device(gate_weight=gate_weight, gate_bias=gate_bias, w_gate_up_bias=b13, w_down_bias=b2)
    return True


def _check_shared(w_gate_up, w_down, gate, gate_weight) -> None:
    if w_gate_up is None and w_down is None:
        if gate is not None:
            raise checks.bad_value("shared_gate", "None without shared experts (shared_w_gate_up, shared_w_down)",
                                   "a tensor")
        return
    E, H = gate_weight.shape
    for name, t in (("shared_w_gate_up", w_gate_up), ("shared_w_down", w_down)):
        if t is None:
            raise checks.bad_value(name, "a tensor: shared experts need both shared_w_gate_up and shared_w_down",
                                   None)
        checks.check_tensor(name, t, ndim=2, dtypes=(gate_weight.dtype,))
    two_s = w_gate_up.shape[0]
    if w_gate_up.shape[1] != H or two_s % 2 or two_s == 0:
        raise checks.bad_shape("shared_w_gate_up", f"[2S, H] = [2S >= 2, {H}] (gate rows, then up rows)",
                               w_gate_up.shape)
    checks.check_shape("shared_w_down", w_down, (H, two_s // 2), f"[H, S] = {[H, two_s // 2]}")
    if gate is not None:
        checks.check_tensor("shared_gate", gate, ndim=2, dtypes=(gate_weight.dtype,))
        checks.check_shape("shared_gate", gate, (1, H), f"[1, H] = [1, {H}]")
    checks.check_same_device(gate_weight=gate_weight, shared_w_gate_up=w_gate_up, shared_w_down=w_down,
                             shared_gate=gate)


def _train_in_fp8(layer: MoEFFN) -> None:
    """onegemm.fp8_training's conversion of a MoEFFN: its routed experts train in FP8 (moe_ffn's
    fp8_training), once check_fp8_training lets them."""
    layer.check_fp8_training()
    layer.fp8_training = True


register_fp8_training(MoEFFN, _train_in_fp8)
