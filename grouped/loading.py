"""Reading one MoE layer from checkpoints: a safetensors file (MoEFFN.from_safetensors) or a
Hugging Face model folder (MoEFFN.from_pretrained: config.json, sharded or not).

Every key under the layer's prefix is accounted for (a router, a correction bias, experts in
one layout and one naming, shared experts) or the load fails naming the file and the key:
a checkpoint the layer cannot represent never loads as a silently different layer.
docs/moe.md lists the layouts and the config fields.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..core import checks
from ..core.runtime import cdiv
from ..core.scaling import INT4, MXFP4, MXFP4_BLOCK, MXFP4_SCALE, SCALE_BLOCK
from .loading_int4 import (GptqReader, check_int4_with_config, gptq_config, gptq_format, gptq_int4, int4_experts,
                           int4_groups, packed_int4)

# An expert's (gate, up, down) weight names, and what the errors call them.
EXPERT_NAMES = {"w1/w3/w2 (Mixtral)": ("w1", "w3", "w2"),
                "gate_proj/up_proj/down_proj (Qwen, DeepSeek, GLM)": ("gate_proj", "up_proj", "down_proj")}
SHARED_NAMES = ("shared_experts", "shared_expert")  # DeepSeek-V3 / GLM-4.5; Qwen2-MoE / Llama-4
GPT_OSS_SWIGLU = ("gpt-oss experts: pass scoring='topk_softmax', renormalize=False and swiglu_limit (config.json's "
                  "swiglu_limit, 7.0), or load the model folder with MoEFFN.from_pretrained")


class Tensors:
    """Tensors by key over one or several safetensors files; each file is opened once, when a
    tensor of it is first read (files holding none of the layer's keys are never opened)."""

    def __init__(self, files: dict, stack: ExitStack):
        self.files = files  # key -> Path
        self.stack = stack
        self.handles = {}

    def path(self, key: str) -> Path:
        return self.files[key]

    def get(self, key: str) -> torch.Tensor:
        path = self.files[key]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(open_safetensors(path))
        try:
            return self.handles[path].get_tensor(key)
        except Exception as e:  # noqa: BLE001 - a truncated or corrupted tensor, a key the shard lacks
            raise checks.in_file(path, f"tensor {key!r} cannot be read ({type(e).__name__}: {e})") from e


class StateTensors:
    """Tensors by key from a dict (a state dict), ``Tensors``'s interface; ``where`` names it
    in errors."""

    def __init__(self, state: dict, where: str):
        self.state = state
        self.files = dict.fromkeys(state, where)

    def get(self, key: str) -> torch.Tensor:
        return self.state[key]


def open_safetensors(path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - missing, a folder, not safetensors, truncated: say which file
        raise checks.in_file(path, f"cannot be read as a safetensors file ({type(e).__name__}: {e})") from e


class LayerKeys:
    """The keys under one prefix: each read takes its key, and ``finish`` refuses the rest."""

    def __init__(self, tensors: Tensors, prefix: str, where):
        self.tensors, self.prefix, self.where = tensors, prefix, where
        self.left = {k[len(prefix):] for k in tensors.files if k.startswith(prefix)}

    def has(self, name: str) -> bool:
        return name in self.left

    def fail(self, name: str, what: str) -> ValueError:
        key = self.prefix + name
        return checks.in_file(self.tensors.files.get(key, self.where), f"tensor {key!r} {what}")

    def take(self, name: str, shape=None, dtypes=None, whose: str = "") -> torch.Tensor:
        key = self.prefix + name
        if name not in self.left:
            near = sorted(k for k in self.left if k.endswith(".".join(name.split(".")[-2:])))[:3]
            raise checks.in_file(self.where, f"missing tensor {key!r} (prefix={self.prefix!r}; keys like it: "
                                             f"{[self.prefix + k for k in near]})")
        self.left.discard(name)
        t = self.tensors.get(key)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise self.fail(name, f"has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if dtypes is not None and t.dtype not in dtypes:
            raise self.fail(name, f"has dtype {t.dtype}, expected {checks.dtype_names(dtypes)}{whose}")
        return t

    def finish(self) -> None:
        if self.left:
            keys = [self.prefix + k for k in sorted(self.left)]
            raise checks.in_file(self.where, f"{len(keys)} tensor(s) under prefix {self.prefix!r} that MoEFFN cannot "
                                             f"account for (it would silently ignore them): {keys[:6]}")


# MoEFFN's per-expert tensor arguments (expert index first), what ``experts=`` slices
EXPERT_TENSORS = ("w_gate_up", "w_down", "w_gate_up_scale", "w_down_scale", "w_gate_up_bias", "w_down_bias")


def parse_layer(keys: LayerKeys, experts=None, gptq_format=None) -> dict:
    """The tensors of one MoE block -> MoEFFN's tensor arguments (CPU). ``experts``: None
    (all) or a callable E -> range: only those experts are kept (expert parallelism; the
    per-expert layout reads only theirs, a fused tensor is read whole and sliced); the other
    experts' keys still count as accounted for. ``gptq_format``: how GPTQ experts are stored,
    the config's GptqStorage (checkpoint_format "gptq" or "gptq_v2", and sym), None without a
    config (read as symmetric "gptq", the default), "" when the config is not GPTQ (GPTQ
    experts refused)."""
    has_gate, has_router = keys.has("gate.weight"), keys.has("router.weight")
    if has_gate and has_router:
        raise keys.fail("router.weight", f"and {keys.prefix + 'gate.weight'!r} are both routers")
    router = "router.weight" if has_router else "gate.weight"
    gate = keys.take(router)
    if gate.dim() != 2:
        raise keys.fail(router, f"has shape {tuple(gate.shape)}, expected [E, H]")
    if gate.dtype not in checks.FLOAT_DTYPES:
        raise keys.fail(router, f"has dtype {gate.dtype}, expected one of ({checks.dtype_names(checks.FLOAT_DTYPES)})")
    E, H = gate.shape
    out = dict(gate_weight=gate)
    if keys.has("gate.e_score_correction_bias"):
        out["correction_bias"] = keys.take("gate.e_score_correction_bias", (E,), checks.FLOAT_DTYPES).float()
    if keys.has("router.bias") or keys.has("experts.gate_up_proj_bias"):
        out.update(_sliced(_gpt_oss_experts(keys, gate), experts, E))
    else:
        out.update(_experts(keys, gate, llama4_layout=has_router, experts=experts, gptq_format=gptq_format))
    out.update(_shared(keys, gate))
    keys.finish()
    return out


def _sliced(out: dict, experts, E: int) -> dict:
    """``out``'s per-expert tensors cut to ``experts(E)`` (read whole: one fused tensor)."""
    if experts is None:
        return out
    mine = experts(E)
    return {k: v[mine.start:mine.stop].contiguous() if k in EXPERT_TENSORS else v for k, v in out.items()}


def _experts(keys: LayerKeys, gate, llama4_layout: bool, experts=None, gptq_format=None) -> dict:
    E, H = gate.shape
    mine = range(E) if experts is None else experts(E)
    fused = sorted(n for n in keys.left if n in ("experts.gate_up_proj", "experts.down_proj")
                   or n.startswith(("experts.gate_up_proj_", "experts.down_proj_")))
    per_expert = sorted(n for n in keys.left if re.match(r"experts\.\d+\.", n))
    if fused and per_expert:
        raise keys.fail(fused[0], f"is a fused expert tensor, but the layer also has per-expert tensors such as "
                                  f"{keys.prefix + per_expert[0]!r}: two copies of the experts")
    if fused:
        return _sliced(_fused_experts(keys, gate, llama4_layout), experts, E)
    beyond = [n for n in per_expert if int(n.split(".")[1]) >= E]
    if beyond:
        raise keys.fail(beyond[0], f"belongs to expert {beyond[0].split('.')[1]}, but the router "
                                   f"{keys.prefix + ('router.weight' if llama4_layout else 'gate.weight')!r} has "
                                   f"E = {E} rows (experts 0..{E - 1})")
    found = {}
    for n in per_expert:
        for label, names in EXPERT_NAMES.items():
            if n.split(".")[2] in names:
                found.setdefault(label, n)
    if len(found) > 1:
        (l1, k1), (l2, k2) = found.items()
        raise keys.fail(k2, f"uses the expert names {l2}, but {keys.prefix + k1!r} uses {l1}: one naming per layer")
    g_name, u_name, d_name = EXPERT_NAMES[next(iter(found))] if found else EXPERT_NAMES["w1/w3/w2 (Mixtral)"]
    # Other ranks' experts are known names, accounted for without being read.
    keys.left -= {n for n in per_expert if int(n.split(".")[1]) not in mine}
    router = "router.weight" if llama4_layout else "gate.weight"
    if gptq_int4(keys, per_expert, gptq_format):
        return int4_experts(keys, gate, (g_name, u_name, d_name), mine, router, GptqReader(keys, gptq_format))
    if packed_int4(keys, per_expert):
        return int4_experts(keys, gate, (g_name, u_name, d_name), mine, router)
    first = f"experts.{mine.start}.{g_name}.weight"
    w1 = keys.take(first)
    fp8 = w1.dtype in checks.FP8_DTYPES
    dtypes, whose = ((torch.float8_e4m3fn,), " (FP8 experts are e4m3)") if fp8 else ((gate.dtype,), " (the router's)")
    if w1.dtype not in dtypes:
        raise keys.fail(first, f"has dtype {w1.dtype}, expected {checks.dtype_names(dtypes)}{whose}")
    if w1.dim() != 2 or w1.shape[1] != H:
        raise keys.fail(first, f"has shape {tuple(w1.shape)}, expected [I, {H}]")
    I = w1.shape[0]

    def weight(e, name, rows, cols):
        w = w1 if (e, name) == (mine.start, g_name) else keys.take(f"experts.{e}.{name}.weight", (rows, cols), dtypes, whose)
        return w, (_scale(keys, f"experts.{e}.{name}", rows, cols) if fp8 else None)

    gate_up, down, gate_up_s, down_s = [], [], [], []
    for e in mine:
        (wg, sg), (wu, su), (wd, sd) = weight(e, g_name, I, H), weight(e, u_name, I, H), weight(e, d_name, H, I)
        gate_up.append(torch.cat([wg, wu]))
        down.append(wd)
        if fp8:
            gate_up_s.append(torch.cat([sg, su]))
            down_s.append(sd)
    out = dict(w_gate_up=torch.stack(gate_up), w_down=torch.stack(down))
    if fp8:
        out.update(w_gate_up_scale=torch.stack(gate_up_s), w_down_scale=torch.stack(down_s))
    return out


def _scale(keys: LayerKeys, name: str, rows: int, cols: int) -> torch.Tensor:
    """The fp32 128x128 block scales of an FP8 weight [rows, cols] ("...weight_scale_inv")."""
    return keys.take(f"{name}.weight_scale_inv", (cdiv(rows, SCALE_BLOCK), cdiv(cols, SCALE_BLOCK)),
                     (torch.float32, torch.bfloat16), " (the 128x128 block scales)").float()


def _fused_experts(keys: LayerKeys, gate, llama4_layout: bool) -> dict:
    """transformers v5's experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] (FP8:
    with their gate_up_proj_scale_inv and down_proj_scale_inv), or Llama-4's [E, H, 2I] / [E, I, H] (a layer whose router is
    "router.weight")."""
    E, H = gate.shape
    w13 = keys.take("experts.gate_up_proj")
    fp8 = w13.dtype in checks.FP8_DTYPES and not llama4_layout
    dtypes, whose = ((torch.float8_e4m3fn,), " (FP8 experts are e4m3)") if fp8 else ((gate.dtype,), " (the router's)")
    for n in sorted(keys.left):
        if n.startswith(("experts.gate_up_proj_", "experts.down_proj_")) and not (
                fp8 and n in ("experts.gate_up_proj_scale_inv", "experts.down_proj_scale_inv")):
            raise keys.fail(n, "is a scale or bias of fused experts that MoEFFN does not read")
    layout = "[E, H, 2I] (Llama-4's layout)" if llama4_layout else "[E, 2I, H] (transformers' fused layout)"
    if w13.dtype not in dtypes:
        raise keys.fail("experts.gate_up_proj", f"has dtype {w13.dtype}, expected {checks.dtype_names(dtypes)}{whose}")
    ok = w13.dim() == 3 and w13.shape[0] == E and w13.shape[1 if llama4_layout else 2] == H and (
        w13.shape[2 if llama4_layout else 1] % 2 == 0)
    if not ok:
        raise keys.fail("experts.gate_up_proj", f"has shape {tuple(w13.shape)}, expected {layout} with E = {E}, H = {H}")
    I = w13.shape[2 if llama4_layout else 1] // 2
    w2 = keys.take("experts.down_proj", (E, I, H) if llama4_layout else (E, H, I), dtypes, whose)
    if llama4_layout:
        return dict(w_gate_up=w13.transpose(1, 2).contiguous(), w_down=w2.transpose(1, 2).contiguous())
    out = dict(w_gate_up=w13, w_down=w2)
    if fp8:
        if I % SCALE_BLOCK:
            # One block row of the fused [2I, H] matrix would hold gate and up rows: which of the
            # two quantisations made the file cannot be told from its shapes.
            raise keys.fail("experts.gate_up_proj_scale_inv", f"scales fused FP8 experts of I = {I}, not a multiple of "
                                                              f"{SCALE_BLOCK}: save the per-expert names instead")
        kh, ki = cdiv(H, SCALE_BLOCK), I // SCALE_BLOCK
        scale = ((torch.float32, torch.bfloat16), " (the 128x128 block scales)")
        out["w_gate_up_scale"] = keys.take("experts.gate_up_proj_scale_inv", (E, 2 * ki, kh), *scale).float()
        out["w_down_scale"] = keys.take("experts.down_proj_scale_inv", (E, kh, ki), *scale).float()
    return out


def _gpt_oss_experts(keys: LayerKeys, gate) -> dict:
    """gpt-oss: router.bias [E]; experts.gate_up_proj [E, H, 2I] with gate and up interleaved
    (columns 0, 2, ... gate; 1, 3, ... up) and its bias [E, 2I]; experts.down_proj [E, I, H] and
    its bias [E, H]. Stored as MoEFFN's [E, 2I, H] (gate rows, then up rows) and [E, H, I]."""
    E, H = gate.shape
    dt = ((gate.dtype,), " (the router's)")
    bias = keys.take("router.bias", (E,), *dt)
    if keys.has("experts.gate_up_proj_blocks") or keys.has("experts.gate_up_proj_scales"):
        return _gpt_oss_mxfp4(keys, gate, bias)
    w13 = keys.take("experts.gate_up_proj", None, *dt)
    if w13.dim() != 3 or w13.shape[:2] != (E, H) or w13.shape[2] % 2:
        raise keys.fail("experts.gate_up_proj", f"has shape {tuple(w13.shape)}, expected [E, H, 2I] (gpt-oss) with "
                                                f"E = {E}, H = {H}")
    I = w13.shape[2] // 2
    b13 = keys.take("experts.gate_up_proj_bias", (E, 2 * I), *dt)
    w2 = keys.take("experts.down_proj", (E, I, H), *dt)
    b2 = keys.take("experts.down_proj_bias", (E, H), *dt)
    return dict(gate_bias=bias, w_gate_up=torch.cat([w13[..., 0::2], w13[..., 1::2]], 2).transpose(1, 2).contiguous(),
                w_gate_up_bias=torch.cat([b13[:, 0::2], b13[:, 1::2]], 1), w_down=w2.transpose(1, 2).contiguous(),
                w_down_bias=b2)


def _gpt_oss_mxfp4(keys: LayerKeys, gate, bias) -> dict:
    """gpt-oss's MXFP4 experts, read as stored: experts.gate_up_proj_blocks [E, 2I, H/32, 16]
    and _scales [E, 2I, H/32] (uint8: two e2m1 values per byte, one e8m0 scale per 32), rows
    gate and up interleaved, with the bias [E, 2I]; experts.down_proj_blocks [E, H, I/32, 16],
    _scales [E, H, I/32] and bias [E, H]. Kept packed: moe_ffn's MXFP4 experts, the rows put in
    MoEFFN's order (gate rows, then up rows)."""
    E, H = gate.shape
    packed = ((torch.uint8,), " (MXFP4: e2m1 pairs and e8m0 scales as bytes)")
    w13 = keys.take("experts.gate_up_proj_blocks", None, *packed)
    if (w13.dim() != 4 or w13.shape[0] != E or w13.shape[1] % 2 or w13.shape[2] * MXFP4_BLOCK != H
            or w13.shape[3] != MXFP4_BLOCK // 2):
        raise keys.fail("experts.gate_up_proj_blocks", f"has shape {tuple(w13.shape)}, expected [E, 2I, H/32, 16] "
                                                       f"with E = {E}, H = {H}")
    I = w13.shape[1] // 2
    if I % MXFP4_BLOCK:
        raise keys.fail("experts.down_proj_blocks", f"holds I = {I} values per row, not a multiple of {MXFP4_BLOCK}")
    s13 = keys.take("experts.gate_up_proj_scales", (E, 2 * I, H // MXFP4_BLOCK), *packed)
    b13 = keys.take("experts.gate_up_proj_bias", (E, 2 * I), (gate.dtype,), " (the router's)")
    w2 = keys.take("experts.down_proj_blocks", (E, H, I // MXFP4_BLOCK, MXFP4_BLOCK // 2), *packed)
    s2 = keys.take("experts.down_proj_scales", (E, H, I // MXFP4_BLOCK), *packed)
    b2 = keys.take("experts.down_proj_bias", (E, H), (gate.dtype,), " (the router's)")

    def gate_then_up(t):  # rows 0, 2, ... are the gate's, 1, 3, ... the up's
        return torch.cat([t[:, 0::2], t[:, 1::2]], 1)

    return dict(gate_bias=bias, w_gate_up=gate_then_up(w13).flatten(2).view(MXFP4),
                w_gate_up_scale=gate_then_up(s13).view(MXFP4_SCALE), w_gate_up_bias=gate_then_up(b13),
                w_down=w2.flatten(2).view(MXFP4), w_down_scale=s2.view(MXFP4_SCALE), w_down_bias=b2)


def _shared(keys: LayerKeys, gate) -> dict:
    E, H = gate.shape
    present = [s for s in SHARED_NAMES if any(n.startswith(s + ".") for n in keys.left)]
    if len(present) > 1:
        raise keys.fail(f"{present[1]}.gate_proj.weight", f"and {keys.prefix + present[0]}.* are two shared experts")
    out = {}
    if present:
        s = present[0]
        packed = sorted(n for n in keys.left if n.startswith(s + ".") and n.endswith((".weight_packed", ".qweight")))
        if packed:
            gptq = packed[0].endswith(".qweight")
            raise keys.fail(packed[0], f"is a {'GPTQ' if gptq else 'packed INT4'} shared expert: MoEFFN's shared "
                                       "experts are dense (the router's dtype, or FP8 with weight_scale_inv); keep "
                                       "them unquantised (" + ("GPTQ's modules_in_block_to_quantize" if gptq else
                                                               "compressed-tensors' ignore list") + ")")
        wg = keys.take(f"{s}.gate_proj.weight")
        if wg.dim() != 2 or wg.shape[1] != H:
            raise keys.fail(f"{s}.gate_proj.weight", f"has shape {tuple(wg.shape)}, expected [S, {H}]")
        S = wg.shape[0]

        def weight(name, w, rows, cols):
            if w is None:
                w = keys.take(f"{s}.{name}.weight", (rows, cols))
            if w.dtype in checks.FP8_DTYPES:  # dequantised: the shared experts run in the router's dtype
                sc = _scale(keys, f"{s}.{name}", rows, cols)
                sc = sc.repeat_interleave(SCALE_BLOCK, 0)[:rows].repeat_interleave(SCALE_BLOCK, 1)[:, :cols]
                w = (w.float() * sc).to(gate.dtype)
            if w.dtype != gate.dtype:
                raise keys.fail(f"{s}.{name}.weight", f"has dtype {w.dtype}, expected {checks.dtype_names((gate.dtype,))} "
                                                      "(the router's), or float8_e4m3fn with weight_scale_inv")
            return w

        out["shared_w_gate_up"] = torch.cat([weight("gate_proj", wg, S, H), weight("up_proj", None, S, H)])
        out["shared_w_down"] = weight("down_proj", None, H, S)
    if keys.has("shared_expert_gate.weight"):
        if not present:
            raise keys.fail("shared_expert_gate.weight", "is a shared expert's gate, but the layer has no shared expert")
        out["shared_gate"] = keys.take("shared_expert_gate.weight", (1, H), (gate.dtype,), " (the router's)")
    return out


def _build(cls, tensors: dict, device, **options):
    return cls(**{k: v.to(device) for k, v in tensors.items()}, **options)


def read_layer(path, prefix: str = "", *, experts=None) -> dict:
    """One safetensors file's MoE block under ``prefix`` as MoEFFN's tensor arguments (CPU),
    every key accounted for (``parse_layer``; ``experts``: its expert range option)."""
    checks.check_path("path", path, "the safetensors file")
    if not isinstance(prefix, str):
        raise checks.bad_type("prefix", "a str", prefix)
    with ExitStack() as stack:
        f = stack.enter_context(open_safetensors(path))
        tensors = Tensors(dict.fromkeys(f.keys(), Path(path)), stack)
        tensors.handles[Path(path)] = f
        return parse_layer(LayerKeys(tensors, prefix, path), experts)


def read_file_layer(cls, path, prefix, top_k, renormalize, device, routing):
    """MoEFFN.from_safetensors."""
    checks.check_int("top_k", top_k, 1, what="(the experts per token)")
    device = checks.resolve_device("device", device)  # before the file is read
    layer = read_layer(path, prefix)
    if "correction_bias" in layer and routing.get("scoring") != "sigmoid":
        raise checks.in_file(path, f"tensor {prefix + 'gate.e_score_correction_bias'!r} is a correction bias "
                                   "(DeepSeek-V3-style routing): pass scoring='sigmoid' and the model's n_group, "
                                   "topk_group, routed_scaling_factor, or load the model folder with "
                                   "MoEFFN.from_pretrained")
    if "w_gate_up_bias" in layer and routing.get("swiglu_limit") is None:
        raise checks.in_file(path, f"tensor {prefix + 'experts.gate_up_proj_bias'!r}: {GPT_OSS_SWIGLU}")
    return _build(cls, layer, device, top_k=top_k, renormalize=renormalize, **routing)


# ---- Hugging Face model folders ----


def _get(cfg, where, *names, default=None):
    """The first of ``names`` that config.json has (transformers renamed some across versions)."""
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise checks.in_file(where, f"has no {' / '.join(repr(n) for n in names)}")
    return default


def _softmax_family(cfg, where, layer, renormalize):
    return dict(top_k=_get(cfg, where, "num_experts_per_tok"), renormalize=renormalize)


def _qwen_dense(cfg, layer):
    if layer in (cfg.get("mlp_only_layers") or []):
        return f"it is in mlp_only_layers = {cfg['mlp_only_layers']}"
    step = cfg.get("decoder_sparse_step") or 1
    if (layer + 1) % step:
        return f"only layers with (layer + 1) % decoder_sparse_step == 0 are MoE (decoder_sparse_step = {step})"
    return None


def _deepseek(defaults):
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 routing from config.json, the family's defaults where a
    field is absent (transformers' config classes)."""
    def routing(cfg, where, layer):
        for field, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if cfg.get(field) not in (None, want):
                raise checks.in_file(where, f"{field} = {cfg[field]!r}: only {want!r} routing is implemented")
        n_group = cfg.get("n_group") or 1
        return dict(top_k=_get(cfg, where, "num_experts_per_tok"), scoring="sigmoid",
                    renormalize=bool(_get(cfg, where, "norm_topk_prob", default=defaults["norm_topk_prob"])),
                    n_group=n_group, topk_group=_get(cfg, where, "topk_group", default=defaults["topk_group"])
                    if n_group > 1 else None,
                    routed_scaling_factor=float(_get(cfg, where, "routed_scaling_factor",
                                                     default=defaults["routed_scaling_factor"])))

    def dense(cfg, layer):
        first = _get(cfg, "", "first_k_dense_replace", default=defaults["first_k_dense_replace"])
        if layer < first:
            return f"the first first_k_dense_replace = {first} layers are dense"
        freq = cfg.get("moe_layer_freq") or 1
        if layer % freq:
            return f"only every moe_layer_freq = {freq}-th layer is MoE"
        return None

    def shared(cfg):
        n = _get(cfg, "", "n_shared_experts", default=defaults["n_shared_experts"])
        if not n:
            return 0
        return n * cfg["moe_intermediate_size"] if "moe_intermediate_size" in cfg else None

    return routing, dense, shared


def _llama4_dense(cfg, layer):
    moe_layers = cfg.get("moe_layers")
    if moe_layers is None:
        step = cfg.get("interleave_moe_layer_step") or 1
        moe_layers = list(range(step - 1, cfg["num_hidden_layers"], step))
        why = f"interleave_moe_layer_step = {step}: the MoE layers are {moe_layers}"
    else:
        why = f"it is not in moe_layers = {moe_layers}"
    return None if layer in moe_layers else why


_DS = _deepseek(dict(norm_topk_prob=True, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
                     n_shared_experts=1))
_GLM = _deepseek(dict(norm_topk_prob=True, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1,
                      n_shared_experts=1))

# model_type -> (routing options, why a layer is dense (None: MoE), the shared expert size
# (0: none, None: not checked), whether the shared expert is gated).
FAMILIES = {
    "mixtral": (lambda c, w, l: _softmax_family(c, w, l, True), lambda c, l: None, lambda c: 0, False),
    "qwen2_moe": (lambda c, w, l: _softmax_family(c, w, l, bool(c.get("norm_topk_prob", False))), _qwen_dense,
                  lambda c: c.get("shared_expert_intermediate_size") or 0, True),
    "qwen3_moe": (lambda c, w, l: _softmax_family(c, w, l, bool(c.get("norm_topk_prob", False))), _qwen_dense,
                  lambda c: 0, False),
    "deepseek_v3": (_DS[0], _DS[1], _DS[2], False),
    "kimi_k2": (_DS[0], _DS[1], _DS[2], False),
    "glm4_moe": (_GLM[0], _GLM[1], _GLM[2], False),
    "llama4_text": (lambda c, w, l: dict(top_k=_get(c, w, "num_experts_per_tok"), renormalize=False,
                                         scoring="topk_sigmoid", weights_on_input=True),
                    _llama4_dense, lambda c: c.get("intermediate_size"), False),
    "gpt_oss": (lambda c, w, l: dict(top_k=_get(c, w, "num_experts_per_tok"), renormalize=False,
                                     scoring="topk_softmax", swiglu_limit=float(_get(c, w, "swiglu_limit", default=7.0)),
                                     swiglu_alpha=float(_get(c, w, "swiglu_alpha", default=1.702))),
                lambda c, l: None, lambda c: 0, False),
}


def _index(folder: Path) -> dict:
    """key -> shard path, from model.safetensors.index.json, else the keys of model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except Exception as e:  # noqa: BLE001 - not JSON, no weight_map
            raise checks.in_file(index, f"is not a safetensors index with a weight_map ({type(e).__name__}: {e})") from e
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise checks.in_file(folder, "has neither model.safetensors.index.json nor model.safetensors")
    with open_safetensors(single) as f:
        return dict.fromkeys(f.keys(), single)


def _family(cfg: dict, config_path):
    """config.json's (text) config and model_type, checked: an MoE family MoEFFN reads, SwiGLU
    experts, FP8 with 128x128 blocks, compressed-tensors' pack-quantized INT4 or 4-bit GPTQ if
    quantised."""
    model_type = cfg.get("model_type")
    if model_type == "llama4":  # the multimodal checkpoint: the text model's config is nested
        cfg, model_type = cfg.get("text_config") or {}, "llama4_text"
    if model_type not in FAMILIES:
        raise checks.in_file(config_path, f"model_type {model_type!r} is not an MoE family MoEFFN reads "
                                          f"(one of {sorted(FAMILIES) + ['llama4']})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise checks.in_file(config_path, f"hidden_act = {cfg['hidden_act']!r}: MoEFFN's experts are SwiGLU (silu)")
    quant = cfg.get("quantization_config") or {}
    mxfp4 = model_type == "gpt_oss" and quant.get("quant_method") == "mxfp4"  # the experts' *_blocks, *_scales
    if quant.get("quant_method") == "compressed-tensors":
        int4_groups(quant, config_path)
    elif quant.get("quant_method") == "gptq":
        gptq_config(quant, config_path)
    elif quant and not mxfp4 and (quant.get("quant_method") != "fp8" or list(
            quant.get("weight_block_size") or [SCALE_BLOCK, SCALE_BLOCK]) != [SCALE_BLOCK, SCALE_BLOCK]):
        raise checks.in_file(config_path, f"quantization_config {quant}: only FP8 with 128x128 weight blocks "
                                          "(weight_scale_inv), compressed-tensors' pack-quantized INT4, "
                                          "4-bit GPTQ and gpt-oss's MXFP4 experts are read")
    return cfg, model_type


def _check_with_config(tensors_, cfg, model_type, options, *, prefix, where, config_path, config_name, block):
    """The layer's tensors against its config: the number of experts, the shared expert's
    presence, size and gate, a correction bias only where the routing has one. ``where``
    names the tensors' source in errors, ``config_name`` the config, ``block`` the layer."""
    E = tensors_["gate_weight"].shape[0]
    want_e = _get(cfg, config_path, "num_local_experts", "num_experts", "n_routed_experts")
    if E != want_e:
        raise checks.in_file(where, f"tensor {prefix + 'gate.weight'!r} has E = {E} rows, but {config_name} says "
                                    f"{want_e} experts")
    _, _, shared_size, gated = FAMILIES[model_type]
    S = shared_size(cfg)
    has_shared = "shared_w_down" in tensors_
    if S is not None and (S > 0) != has_shared:
        raise checks.in_file(where, f"{block} has {'' if has_shared else 'no '}shared expert tensors, but "
                                    f"{config_name} gives a shared expert size of {S}")
    if has_shared and S and tensors_["shared_w_down"].shape[1] != S:
        raise checks.in_file(where, f"the shared expert of {prefix!r} has size {tensors_['shared_w_down'].shape[1]}, "
                                    f"{config_name} gives {S}")
    if has_shared and gated != ("shared_gate" in tensors_):
        raise checks.in_file(where, f"{prefix!r}: a {model_type} shared expert is "
                                    f"{'gated (shared_expert_gate.weight)' if gated else 'ungated'}, the file's is not")
    if "correction_bias" in tensors_ and options.get("scoring") != "sigmoid":
        raise checks.in_file(where, f"tensor {prefix + 'gate.e_score_correction_bias'!r}: a correction bias in a "
                                    f"{model_type} layer, whose routing has none")
    if tensors_["w_gate_up"].dtype == INT4:
        check_int4_with_config(tensors_, cfg, prefix=prefix, where=where, config_name=config_name)


def read_pretrained_layer(cls, path, layer, device):
    """MoEFFN.from_pretrained."""
    checks.check_path("path", path, "the model folder")
    device = checks.resolve_device("device", device)
    folder = Path(path)
    config_path = folder / "config.json"
    try:
        cfg = json.loads(config_path.read_text())
    except Exception as e:  # noqa: BLE001 - not a folder, no config.json, not JSON
        raise checks.in_file(config_path, f"cannot be read as a model's config.json ({type(e).__name__}: {e})") from e
    cfg, model_type = _family(cfg, config_path)
    routing_of, dense_why, _, _ = FAMILIES[model_type]
    n_layers = _get(cfg, config_path, "num_hidden_layers")
    checks.check_int("layer", layer, 0, n_layers - 1, f"(the model has num_hidden_layers = {n_layers})")
    why = dense_why(cfg, layer)
    if why:
        raise checks.in_file(config_path, f"layer {layer} of this {model_type} model is a dense MLP, not an MoE "
                                          f"layer: {why}")
    options = routing_of(cfg, config_path, layer)

    files = _index(folder)
    pattern = re.compile(rf"^(.*?\blayers\.{layer}\.(?:mlp|block_sparse_moe|feed_forward)\.)(?:gate|router)\.weight$")
    prefixes = sorted({m.group(1) for k in files if (m := pattern.match(k))})
    if len(prefixes) != 1:
        under = sorted(k for k in files if f"layers.{layer}." in k)[:8]
        found = f"several MoE blocks {prefixes}" if prefixes else f"no router; keys of layer {layer}: {under}"
        raise checks.in_file(folder, f"layer {layer}: expected one MoE block (a '...layers.{layer}.mlp.gate.weight' "
                                     f"or '...feed_forward.router.weight'), found {found}")
    prefix = prefixes[0]
    with ExitStack() as stack:
        tensors = Tensors({k: v for k, v in files.items() if k.startswith(prefix)}, stack)
        tensors_ = parse_layer(LayerKeys(tensors, prefix, folder), gptq_format=gptq_format(cfg))
    _check_with_config(tensors_, cfg, model_type, options, prefix=prefix, where=folder, config_path=config_path,
                       config_name="config.json", block=f"layer {layer} ({prefix!r})")
    return _build(cls, tensors_, device, **options)


def read_state_dict_layer(cls, state_dict, config, prefix, device):
    """MoEFFN.from_state_dict."""
    if not isinstance(state_dict, dict):
        raise checks.bad_type("state_dict", "a dict of tensors (a module's state_dict())", state_dict)
    if device is not None:  # None: the tensors' own device
        device = checks.resolve_device("device", device)
    if not isinstance(prefix, str):
        raise checks.bad_type("prefix", "a str", prefix)
    if hasattr(config, "to_dict"):  # a transformers config
        config = config.to_dict()
    if not isinstance(config, dict):
        raise checks.bad_type("config", "a transformers config or a config.json dict", config)
    cfg, model_type = _family(config, "config")
    options = FAMILIES[model_type][0](cfg, "config", None)
    tensors_ = parse_layer(LayerKeys(StateTensors(state_dict, "state_dict"), prefix, "state_dict"),
                           gptq_format=gptq_format(cfg))
    _check_with_config(tensors_, cfg, model_type, options, prefix=prefix, where="state_dict", config_path="config",
                       config_name="config", block=f"the block ({prefix!r})")
    return _build(cls, tensors_, tensors_["gate_weight"].device if device is None else device, **options)
