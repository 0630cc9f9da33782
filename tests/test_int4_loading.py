"""Loading INT4 experts stored in compressed-tensors' pack-quantized format (Kimi-K2-Thinking,
llm-compressor's W4A16 exports of Qwen3-MoE and DeepSeek-V3-style models): tiny checkpoints
written here load through MoEFFN.from_pretrained, from_safetensors and from_state_dict with
the experts kept packed, bit for bit, and the layer computes what its dequantised twin does;
each scheme or key the layer cannot account for is refused, naming the file and the field or
key."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import onegemm
from onegemm.blockscaled.quantize import quantize_int4
from onegemm.testing import TOL, assert_layer_close_to_twin, int4_dequantize_ref

P = "model.layers.1.mlp."


def _scheme(group=32, **weights):
    """A W4A16 scheme of config_groups; a weights argument given as None is left out (its default)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": None, "observer": "minmax", **weights}
    return {"targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {k: v for k, v in weights.items() if v is not None}}


def _quant(group=32, **weights):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": _scheme(group, **weights)}, "kv_cache_scheme": None,
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$", "re:.*shared_experts.*"]}


def _config(model_type, E, I, group, symmetric=True):
    """A 2-layer config.json of the family whose layer 1 is MoE, INT4 experts of ``group``."""
    common = dict(model_type=model_type, num_hidden_layers=2, num_experts_per_tok=2, hidden_act="silu",
                  moe_intermediate_size=I, norm_topk_prob=True, quantization_config=_quant(group, symmetric=symmetric))
    if model_type == "qwen3_moe":
        return dict(common, num_experts=E, decoder_sparse_step=1, mlp_only_layers=[])
    return dict(common, n_routed_experts=E, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc")


def _pack_zero_points(zero):
    """compressed-tensors' weight_zero_point: zero points 0..15 [rows, groups] as int32
    [ceil(rows / 8), groups], row 8r + j in bits 4j..4j+3 of word r (packed along dim 0)."""
    rows, groups = zero.shape
    z = torch.zeros(-(-rows // 8) * 8, groups, dtype=torch.int64)
    z[:rows] = zero.long()
    words = (z.view(-1, 8, groups) << (4 * torch.arange(8))[None, :, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _int4_layer(model_type="kimi_k2", E=4, H=64, I=64, group=32, symmetric=True):
    """The MoE block's tensors as such a checkpoint stores them (bf16 router and shared
    experts, INT4 experts: weight_packed, weight_scale, weight_shape per projection, and
    weight_zero_point where not ``symmetric``), and the experts decoded (float64 [E, 2I, H],
    [E, H, I])."""
    t = {P + "gate.weight": (torch.randn(E, H) * H**-0.5).to(torch.bfloat16)}
    if model_type != "qwen3_moe":
        t[P + "gate.e_score_correction_bias"] = torch.randn(E) * 0.1
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            t[f"{P}shared_experts.{name}.weight"] = (torch.randn(*shape) * shape[1]**-0.5).to(torch.bfloat16)
    w13, w2 = [], []
    for e in range(E):
        for name, shape, out in (("gate_proj", (I, H), w13), ("up_proj", (I, H), w13), ("down_proj", (H, I), w2)):
            w = (torch.randn(*shape) * shape[1]**-0.5).to(torch.bfloat16)
            q, s = quantize_int4(w if symmetric else w + w.std(), group, zero_point=not symmetric)
            key = f"{P}experts.{e}.{name}."
            out.append(int4_dequantize_ref(q, s))
            if not symmetric:  # as stored: a bf16 scale and the zero points packed along the rows
                s, zero = onegemm.unpack_int4_zeros(s)
                s = s.to(torch.bfloat16)
                t[key + "weight_zero_point"] = _pack_zero_points(zero)
            t[key + "weight_packed"], t[key + "weight_scale"] = q, s
            t[key + "weight_shape"] = torch.tensor(shape)
    return t, (torch.stack([torch.cat(w13[i:i + 2]) for i in range(0, 2 * E, 2)]), torch.stack(w2))


def _folder(tmp_path, config, t):
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(t, str(tmp_path / "model.safetensors"))
    return tmp_path


def _stacked(t, E, attr):
    """The stored (gate rows, up rows) and down tensors ``attr`` of every expert, stacked."""
    def of(e, name):
        return t[f"{P}experts.{e}.{name}.{attr}"]
    return (torch.stack([torch.cat([of(e, "gate_proj"), of(e, "up_proj")]) for e in range(E)]),
            torch.stack([of(e, "down_proj") for e in range(E)]))


@pytest.mark.parametrize("model_type,group,symmetric", [("kimi_k2", 32, True), ("deepseek_v3", 64, True),
                                                        ("qwen3_moe", 128, True), ("qwen3_moe", 32, False),
                                                        ("deepseek_v3", 64, False)])
def test_int4_experts_load_as_stored(model_type, group, symmetric, tmp_path, device):
    """A Kimi-K2-Thinking / DeepSeek-V3-style (router, correction bias, bf16 shared expert) or
    Qwen3-MoE W4A16 folder: the experts stay packed (the file's int32 words and scales, bit
    for bit; asymmetric: the scales with their zero points, which unpack_int4_zeros gives
    back) through from_pretrained, from_safetensors and from_state_dict, and the layer's
    output is its twin's on the dequantised experts (float64 reference; rows whose routing
    differs by a near tie are left out)."""
    E, H, I = 4, 2 * group, group
    t, (w13, w2) = _int4_layer(model_type, E, H, I, group, symmetric)
    config = _config(model_type, E, I, group, symmetric)
    layer = onegemm.MoEFFN.from_pretrained(_folder(tmp_path, config, t), layer=1, device=device)
    q13, q2 = _stacked(t, E, "weight_packed")
    s13, s2 = _stacked(t, E, "weight_scale")
    assert layer.w_gate_up.dtype == torch.int32 and torch.equal(layer.w_gate_up.cpu(), q13)
    assert torch.equal(layer.w_down.cpu(), q2) and layer.w_down.dtype == torch.int32
    got13, got2 = layer.w_gate_up_scale.cpu(), layer.w_down_scale.cpu()
    if not symmetric:
        (got13, zero13), (got2, zero2) = onegemm.unpack_int4_zeros(got13), onegemm.unpack_int4_zeros(got2)
        z13, z2 = _stacked(t, E, "weight_zero_point")
        for zero, stored in ((zero13, z13), (zero2, z2)):  # the zero points pack back to the file's words
            assert torch.equal(torch.cat([_pack_zero_points(z) for z in zero]), stored.flatten(0, 1))
        got13, got2 = got13.to(torch.bfloat16), got2.to(torch.bfloat16)
    assert torch.equal(got13, s13) and torch.equal(got2, s2)
    assert f"intermediate={I}" in repr(layer)
    routing = {k: v for k, v in layer.routing.items()}
    others = [onegemm.MoEFFN.from_safetensors(tmp_path / "model.safetensors", prefix=P, top_k=2, device=device,
                                              **routing),
              onegemm.MoEFFN.from_state_dict(t, config, prefix=P, device=device)]
    for other in others:
        for (name, a), (_, b) in zip(layer.state_dict().items(), other.state_dict().items()):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    shared = {} if layer.shared_w_down is None else dict(shared_w_gate_up=layer.shared_w_gate_up,
                                                         shared_w_down=layer.shared_w_down)
    twin = onegemm.MoEFFN(layer.gate_weight.detach(), w13.to(torch.bfloat16).to(device),
                          w2.to(torch.bfloat16).to(device), top_k=layer.top_k, renormalize=layer.renormalize,
                          correction_bias=layer.correction_bias, **routing, **shared)
    x = torch.randn(9, H, device=device).to(torch.bfloat16)
    assert_layer_close_to_twin(layer, twin, x, 2 * TOL[torch.bfloat16])


def test_int4_experts_of_one_rank(tmp_path):
    """Expert parallelism's expert range: only those experts are read (still packed), the
    others' keys accounted for."""
    from onegemm.grouped.loading import read_layer

    t, _ = _int4_layer("qwen3_moe", E=4)
    save_file(t, str(tmp_path / "layer.safetensors"))
    got = read_layer(tmp_path / "layer.safetensors", P, experts=lambda E: range(2, 4))
    q13, q2 = _stacked(t, 4, "weight_packed")
    assert torch.equal(got["w_gate_up"], q13[2:]) and torch.equal(got["w_down"], q2[2:])
    assert got["w_gate_up_scale"].shape == (2, 128, 2)


def _replace(old, new, value):
    """A change to the layer's tensors: the key ending ``old`` (under P) becomes ``new`` with ``value``."""
    def change(t):
        t.pop(P + old)
        t[P + new] = value
    return change


I_, H_ = 64, 64  # the refused layers' sizes (group 32)
BAD_TENSORS = [
    ("a zero point of one matrix only", lambda t: t.update({P + "experts.2.up_proj.weight_zero_point":
                                                            torch.zeros(I_ // 8, H_ // 32, dtype=torch.int32)}),
     "'model.layers.1.mlp.experts.2.up_proj.weight_zero_point' is a zero point \\(asymmetric INT4\\), but the "
     "layer's first matrix has none"),
    ("a group index (actorder)", lambda t: t.update({P + "experts.0.down_proj.weight_g_idx":
                                                     torch.zeros(I_, dtype=torch.int32)}),
     "'model.layers.1.mlp.experts.0.down_proj.weight_g_idx' is a group index"),
    ("a stray key", lambda t: t.update({P + "experts.1.gate_proj.bias": torch.zeros(I_, dtype=torch.bfloat16)}),
     "1 tensor\\(s\\) under prefix 'model.layers.1.mlp.' that MoEFFN cannot account for .*"
     "\\['model.layers.1.mlp.experts.1.gate_proj.bias'\\]"),
    ("an unknown attribute of a packed weight",
     lambda t: t.update({P + "experts.3.down_proj.weight_global_scale": torch.ones(1)}),
     "cannot account for .*experts.3.down_proj.weight_global_scale"),
    ("a weight_shape that is not the weight's", lambda t: t.update({P + "experts.1.down_proj.weight_shape":
                                                                    torch.tensor([H_, 2 * I_])}),
     "'model.layers.1.mlp.experts.1.down_proj.weight_shape' is \\[64, 128\\], but "
     "'model.layers.1.mlp.experts.1.down_proj.weight_packed' holds a \\[64, 64\\] weight"),
    ("a missing weight_shape", lambda t: t.pop(P + "experts.2.gate_proj.weight_shape"),
     "missing tensor 'model.layers.1.mlp.experts.2.gate_proj.weight_shape'"),
    ("groups of 16 values", lambda t: t.update({P + "experts.0.gate_proj.weight_scale":
                                                torch.ones(I_, H_ // 16, dtype=torch.bfloat16)}),
     "'model.layers.1.mlp.experts.0.gate_proj.weight_scale' has shape \\(64, 4\\), expected \\[64, 64/group\\] "
     "with the group a power of two >= 32"),
    ("another expert's group", lambda t: t.update({P + "experts.2.down_proj.weight_scale":
                                                   torch.ones(H_, 1, dtype=torch.bfloat16)}),
     "'model.layers.1.mlp.experts.2.down_proj.weight_scale' has shape \\(64, 1\\), expected \\(64, 2\\)"),
    ("fp32 scales beside bf16 ones", lambda t: t.update({P + "experts.3.up_proj.weight_scale": torch.ones(I_, 2)}),
     "'model.layers.1.mlp.experts.3.up_proj.weight_scale' has dtype torch.float32, expected bfloat16"),
    ("a packed weight of another dtype", lambda t: t.update({P + "experts.1.up_proj.weight_packed":
                                                             torch.zeros(I_, H_ // 8, dtype=torch.int64)}),
     "'model.layers.1.mlp.experts.1.up_proj.weight_packed' has dtype torch.int64, expected int32"),
    ("a plain expert beside packed ones",
     lambda t: [t.pop(k) for k in list(t) if k.startswith(P + "experts.3.down_proj.")] and t.update(
         {P + "experts.3.down_proj.weight": torch.zeros(H_, I_, dtype=torch.bfloat16)}),
     "'model.layers.1.mlp.experts.3.down_proj.weight' is a plain expert weight, but "
     "'model.layers.1.mlp.experts.0.down_proj.weight_packed' is packed INT4"),
    ("a packed shared expert",
     _replace("shared_experts.up_proj.weight", "shared_experts.up_proj.weight_packed",
              torch.zeros(I_, H_ // 8, dtype=torch.int32)),
     "'model.layers.1.mlp.shared_experts.up_proj.weight_packed' is a packed INT4 shared expert: MoEFFN's shared "
     "experts are dense"),
    ("an fp32 router", lambda t: t.update({P + "gate.weight": t[P + "gate.weight"].float()}),
     "'model.layers.1.mlp.gate.weight' has dtype torch.float32, expected bfloat16 or float16 \\(INT4 experts"),
]


@pytest.mark.parametrize("name,corrupt,match", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_int4_layer_refuses_what_it_cannot_account_for(name, corrupt, match, tmp_path):
    """Each through from_safetensors (the tensors alone) and from_pretrained (with a valid
    compressed-tensors config): a ValueError naming the file and the key."""
    t, _ = _int4_layer("kimi_k2", 4, H_, I_, 32)
    corrupt(t)
    folder = _folder(tmp_path, _config("kimi_k2", 4, I_, 32), t)
    path = folder / "model.safetensors"
    with pytest.raises(ValueError) as e:
        onegemm.MoEFFN.from_safetensors(path, prefix=P, scoring="sigmoid")
    assert str(e.value).startswith(f"{path}: ") and re.search(match, str(e.value)), str(e.value)
    with pytest.raises(ValueError, match=match):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)


G0 = "config.json: quantization_config.config_groups.group_0"
BAD_CONFIGS = [
    ("8 bits", dict(num_bits=8), f"{G0}.weights.num_bits = 8: only 4 is read"),
    ("8 bits by default", dict(num_bits=None), f"{G0}.weights.num_bits = 8: only 4 is read"),
    ("float weights", dict(type="float"), f"{G0}.weights.type = 'float': only 'int' is read"),
    ("channel scales", dict(strategy="channel", group_size=None), f"{G0}.weights.strategy = 'channel'"),
    ("channel scales by default", dict(strategy=None, group_size=-1), f"{G0}.weights.strategy = 'channel'"),
    ("activation-ordered groups", dict(actorder="group"),
     f"{G0}.weights.actorder = 'group': only None / False / 'weight' / 'static' is read"),
    ("activation-ordered groups (alias)", dict(actorder="dynamic"), f"{G0}.weights.actorder = 'dynamic'"),
    ("dynamic weights", dict(dynamic=True), f"{G0}.weights.dynamic = True: only False is read"),
    ("a group of 48", dict(group_size=48), f"{G0}.weights.group_size = 48: expected a power of two >= 32"),
    ("a group of 16", dict(group_size=16), f"{G0}.weights.group_size = 16: expected a power of two >= 32"),
]


def _bad_quant(change):
    """config.json's quantization_config with ``change`` applied (a dict: to the weights' arguments)."""
    if isinstance(change, dict):
        return _quant(**change)
    quant = _quant()
    change(quant)
    return quant


BAD_CONFIGS += [
    ("activation quantisation", lambda q: q["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
     f"{G0}.input_activations = .*activation quantisation; only weight-only INT4 \\(W4A16\\)"),
    ("another format", lambda q: q.update(format="int-quantized"),
     f"{G0}: format 'int-quantized', only 'pack-quantized'"),
    ("another format for one scheme", lambda q: q["config_groups"]["group_0"].update(format="float-quantized"),
     f"{G0}: format 'float-quantized', only 'pack-quantized'"),
    ("sparsity", lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}),
     "config.json: quantization_config.sparsity_config = .*only quantised \\(not sparse or transformed\\)"),
    ("no schemes", lambda q: q.pop("config_groups"), "quantization_config.config_groups = None"),
]


@pytest.mark.parametrize("name,change,match", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_int4_config_refuses(name, change, match, tmp_path):
    """A compressed-tensors scheme other than symmetric weight-only INT4 with group scales,
    stored pack-quantized: refused naming config.json and the field (the tensors are valid)."""
    t, _ = _int4_layer("kimi_k2", 4, H_, I_, 32)
    config = dict(_config("kimi_k2", 4, I_, 32), quantization_config=_bad_quant(change))
    folder = _folder(tmp_path, config, t)
    with pytest.raises(ValueError) as e:
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    assert re.search(match, str(e.value)) and str(e.value).startswith(str(folder / "config.json")), str(e.value)
    with pytest.raises(ValueError, match=match.replace("config.json", "config")):
        onegemm.MoEFFN.from_state_dict(t, config, prefix=P)


@pytest.mark.parametrize("weights", [dict(actorder="static"), dict(actorder="weight"), dict(actorder=False),
                                     dict(symmetric=None, type=None, strategy=None, dynamic=None),
                                     dict(type="INT", strategy="GROUP")],
                         ids=["actorder-static", "actorder-weight", "actorder-false", "defaults", "upper-case"])
def test_int4_config_that_stores_plain_groups_loads(weights, tmp_path):
    """Schemes whose stored tensors are plain groups: activation ordering of the calibration
    only ("weight", alias "static"), and arguments left to compressed-tensors' defaults
    (symmetric int, the strategy inferred from group_size)."""
    t, _ = _int4_layer("kimi_k2", 4, H_, I_, 32)
    config = dict(_config("kimi_k2", 4, I_, 32), quantization_config=_quant(**weights))
    layer = onegemm.MoEFFN.from_pretrained(_folder(tmp_path, config, t), layer=1)
    assert layer.w_gate_up.dtype == torch.int32 and layer.w_down_scale.shape == (4, H_, I_ // 32)


def test_int4_experts_need_the_config_that_describes_them(tmp_path):
    """Packed experts under a config without compressed-tensors quantisation, or whose group
    size is not the scales': refused; a compressed-tensors config whose ignore list leaves the
    experts of this layer plain (bf16 weights) loads them as plain tensors."""
    t, _ = _int4_layer("kimi_k2", 4, H_, I_, 32)
    config = _config("kimi_k2", 4, I_, 32)
    folder = _folder(tmp_path, {k: v for k, v in config.items() if k != "quantization_config"}, t)
    with pytest.raises(ValueError, match=f"^{re.escape(str(folder))}: the experts of 'model.layers.1.mlp.' are packed "
                                         "INT4 \\(weight_packed\\), but config.json has no compressed-tensors"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_config=_quant(64))))
    with pytest.raises(ValueError, match="the gate_proj / up_proj scales of 'model.layers.1.mlp.' give groups of 32 "
                                         "values, symmetric, but config.json's quantization_config has group_size 64 "
                                         "symmetric"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    # an asymmetric scheme over symmetric tensors, and the other way round
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_config=_quant(32, symmetric=False))))
    with pytest.raises(ValueError, match="give groups of 32 values, symmetric, but config.json's quantization_config "
                                         "has group_size 32 asymmetric"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    asym, _ = _int4_layer("kimi_k2", 4, H_, I_, 32, symmetric=False)
    with pytest.raises(ValueError, match="give groups of 32 values, with zero points, but config's "
                                         "quantization_config has group_size 32 symmetric"):
        onegemm.MoEFFN.from_state_dict(asym, config, prefix=P)
    plain = {k: v for k, v in t.items() if ".experts." not in k}
    for e in range(4):
        for name, shape in (("gate_proj", (I_, H_)), ("up_proj", (I_, H_)), ("down_proj", (H_, I_))):
            plain[f"{P}experts.{e}.{name}.weight"] = torch.randn(*shape).to(torch.bfloat16)
    save_file(plain, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    layer = onegemm.MoEFFN.from_pretrained(folder, layer=1)
    assert layer.w_gate_up.dtype == torch.bfloat16 and layer.w_gate_up_scale is None
    assert torch.equal(layer.w_down[2].cpu(), plain[P + "experts.2.down_proj.weight"])
