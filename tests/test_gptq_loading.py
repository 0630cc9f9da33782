"""Loading GPTQ INT4 experts (AutoGPTQ, GPTQModel, transformers' "gptq" quant_method: Qwen's
Qwen3-30B-A3B-GPTQ-Int4, TheBloke's Mixtral GPTQ): symmetric, not activation-ordered
checkpoints load through MoEFFN.from_pretrained, from_safetensors and from_state_dict as
moe_ffn's INT4 experts (qweight and scales transposed, the words and scales bit for bit), and
the layer computes what its dequantised twin does; every other configuration or tensor is
refused, naming config.json and the field or the file and the key."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import onegemm
from onegemm.blockscaled.quantize import quantize_int4
from onegemm.testing import TOL, assert_layer_close_to_twin, int4_dequantize_ref

PREFIX = {"qwen3_moe": "model.layers.1.mlp.", "mixtral": "model.layers.1.block_sparse_moe."}
NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
STORED_ZERO = {"gptq": 7, "gptq_v2": 8}  # a symmetric 4-bit zero point (8) as each format stores it
DROP = object()  # a quantization_config field left out


def _pack_along_out(z):
    """int32 [rows, out/8] of the 4-bit values z [rows, out], eight per word along out (value j
    in bits 4j..4j+3): GPTQ's qzeros."""
    words = (z.long().unflatten(-1, (-1, 8)) << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq(w, group, fmt, sym=True):
    """One Linear's weight [out, in] as GPTQ stores it (from quantize_int4's packed words and
    scales), and those (packed [out, in/8], scale [out, in/group] in fp16; not ``sym``: the
    asymmetric rule's, int32 scale words with their zero points, stored as zero - 1 by v1)."""
    out, cols = w.shape
    if sym:
        q, s = quantize_int4(w, group)
        s, scale = s.half(), s.half()
        zeros = torch.full((cols // group, out), STORED_ZERO[fmt])
    else:
        q, s = quantize_int4(w + w.std(), group, torch.float16, zero_point=True)
        scale, zero = onegemm.unpack_int4_zeros(s)
        scale = scale.half()
        zeros = ((zero.long() - int(fmt == "gptq")) & 0xF).t()
    return dict(qweight=q.t().contiguous(), qzeros=_pack_along_out(zeros), scales=scale.t().contiguous(),
                g_idx=torch.arange(cols, dtype=torch.int32) // group), (q, s)


def _quant(group=128, fmt="gptq", **fields):
    """A GPTQ quantization_config as GPTQModel writes it; a field given as DROP is left out."""
    quant = {"bits": 4, "group_size": group, "desc_act": False, "sym": True, "damp_percent": 0.01,
             "true_sequential": True, "static_groups": False, "lm_head": False, "dynamic": None,
             "checkpoint_format": fmt, "pack_dtype": "int32", "quant_method": "gptq",
             "meta": {"quantizer": ["gptqmodel:2.2.0"], "damp_auto_increment": 0.0025, "mse": 0.0}, **fields}
    return {k: v for k, v in quant.items() if v is not DROP}


def _thebloke_quant(group=128):
    """TheBloke's (AutoGPTQ's) quantization_config: no checkpoint_format (v1)."""
    return {"bits": 4, "group_size": group, "damp_percent": 0.1, "desc_act": False, "sym": True,
            "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
            "quant_method": "gptq"}


def _config(model_type, E, quant):
    common = dict(model_type=model_type, num_hidden_layers=2, num_experts_per_tok=2, hidden_act="silu",
                  quantization_config=quant)
    if model_type == "qwen3_moe":
        return dict(common, num_experts=E, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return dict(common, num_local_experts=E)


def _gptq_layer(model_type="qwen3_moe", E=4, H=64, I=64, group=32, fmt="gptq", dtype=torch.bfloat16, sym=True):
    """The MoE block's tensors as a GPTQ checkpoint stores them (a ``dtype`` router, per expert
    and projection qweight, qzeros, scales, g_idx); the experts as quantize_int4 made them
    (packed [E, 2I, H/8], [E, H, I/8]; scales) and decoded (float64 [E, 2I, H], [E, H, I])."""
    P = PREFIX[model_type]
    t = {P + "gate.weight": (torch.randn(E, H) * H**-0.5).to(dtype)}
    q13, q2, s13, s2 = [], [], [], []
    for e in range(E):
        for name, shape, q, s in zip(NAMES[model_type], ((I, H), (I, H), (H, I)), (q13, q13, q2), (s13, s13, s2)):
            tensors, (packed, scale) = _gptq((torch.randn(*shape) * shape[1]**-0.5).to(dtype), group, fmt, sym)
            t.update({f"{P}experts.{e}.{name}.{k}": v for k, v in tensors.items()})
            q.append(packed)
            s.append(scale)

    def stack(parts, gate_up):
        return torch.stack([torch.cat(parts[i:i + 2]) for i in range(0, 2 * E, 2)] if gate_up else parts)

    packed = stack(q13, True), stack(q2, False), stack(s13, True), stack(s2, False)
    return t, packed, (int4_dequantize_ref(packed[0], packed[2]), int4_dequantize_ref(packed[1], packed[3]))


def _folder(tmp_path, config, t):
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(t, str(tmp_path / "model.safetensors"))
    return tmp_path


CASES = [("qwen3_moe", 32, "gptq", torch.bfloat16, True), ("qwen3_moe", 128, "gptq_v2", torch.bfloat16, True),
         ("mixtral", 128, None, torch.float16, True), ("mixtral", 32, "gptq_v2", torch.float16, True),
         ("qwen3_moe", 64, "gptq", torch.bfloat16, False), ("mixtral", 32, "gptq_v2", torch.float16, False)]


@pytest.mark.parametrize("model_type,group,fmt,dtype,sym", CASES,
                         ids=[f"{c[0]}-g{c[1]}-{c[2] or 'thebloke'}{'' if c[4] else '-asymmetric'}" for c in CASES])
def test_gptq_experts_load_as_int4(model_type, group, fmt, dtype, sym, tmp_path, device):
    """A Qwen3-MoE (GPTQModel's config) or Mixtral (TheBloke's AutoGPTQ config, v1 without a
    checkpoint_format, or gptq_v2) folder: the experts are quantize_int4's words and scales bit
    for bit (the conversion is a transpose; sym = false: the fp16 scales with the zero points,
    v1's stored zero - 1, as pack_int4_zeros packs them), the same through from_state_dict
    (and, for symmetric v1, from_safetensors), and the layer's output is its twin's on the
    decoded experts (float64 reference; rows whose routing differs by a near tie are left out)."""
    E, H, I = 4, 2 * group, group
    P = PREFIX[model_type]
    t, (q13, q2, s13, s2), (w13, w2) = _gptq_layer(model_type, E, H, I, group, fmt or "gptq", dtype, sym)
    config = _config(model_type, E, _thebloke_quant(group) if fmt is None else _quant(group, fmt, sym=sym))
    layer = onegemm.MoEFFN.from_pretrained(_folder(tmp_path, config, t), layer=1, device=device)
    assert layer.w_gate_up.dtype == torch.int32 and torch.equal(layer.w_gate_up.cpu(), q13)
    assert layer.w_down.dtype == torch.int32 and torch.equal(layer.w_down.cpu(), q2)
    assert layer.w_gate_up_scale.dtype == s13.dtype and torch.equal(layer.w_gate_up_scale.cpu(), s13)
    assert torch.equal(layer.w_down_scale.cpu(), s2) and layer.w_gate_up.is_contiguous()
    others = [onegemm.MoEFFN.from_state_dict(t, config, prefix=P, device=device)]
    if fmt != "gptq_v2" and sym:  # a file alone is read as checkpoint_format "gptq", symmetric
        others.append(onegemm.MoEFFN.from_safetensors(tmp_path / "model.safetensors", prefix=P, top_k=2,
                                                      device=device, **layer.routing))
    for other in others:
        for (name, a), (_, b) in zip(layer.state_dict().items(), other.state_dict().items()):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    twin = onegemm.MoEFFN(layer.gate_weight.detach(), w13.to(dtype).to(device), w2.to(dtype).to(device),
                          top_k=layer.top_k, renormalize=layer.renormalize, **layer.routing)
    x = torch.randn(9, H, device=device).to(dtype)
    assert_layer_close_to_twin(layer, twin, x, 2 * TOL[dtype])


def test_gptq_v2_file_alone_is_read_as_v1(tmp_path):
    """Without a config a file's zero points are read as checkpoint_format "gptq" stores them
    (7): a gptq_v2 file (8s) is refused, naming the key and the format assumed."""
    t, _, _ = _gptq_layer(fmt="gptq_v2")
    save_file(t, str(tmp_path / "layer.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.0.gate_proj.qzeros' is not symmetric: word "
                                         "\\[0, 0\\] is 0x88888888, expected 0x77777777 everywhere \\(every zero "
                                         "point 8, stored as 7 by checkpoint_format 'gptq', the default without a "
                                         "config\\)"):
        onegemm.MoEFFN.from_safetensors(tmp_path / "layer.safetensors", prefix=PREFIX["qwen3_moe"])


def test_gptq_experts_of_one_rank(tmp_path):
    """Expert parallelism's expert range: only those experts are read and converted."""
    from onegemm.grouped.loading import read_layer

    t, (q13, q2, s13, _), _ = _gptq_layer(E=4)
    save_file(t, str(tmp_path / "layer.safetensors"))
    got = read_layer(tmp_path / "layer.safetensors", PREFIX["qwen3_moe"], experts=lambda E: range(2, 4))
    assert torch.equal(got["w_gate_up"], q13[2:]) and torch.equal(got["w_down"], q2[2:])
    assert torch.equal(got["w_gate_up_scale"], s13[2:])


def test_transformers_gptq_config_loads(tmp_path):
    """The quantization_config transformers' GPTQConfig writes (its calibration and kernel
    options, act_group_aware, format and checkpoint_format) is read."""
    transformers = pytest.importorskip("transformers")
    quant = json.loads(json.dumps(transformers.GPTQConfig(bits=4, group_size=32, format="gptq_v2").to_dict()))
    t, (q13, _, _, _), _ = _gptq_layer(fmt="gptq_v2")
    layer = onegemm.MoEFFN.from_pretrained(_folder(tmp_path, _config("qwen3_moe", 4, quant), t), layer=1)
    assert torch.equal(layer.w_gate_up.cpu(), q13)


P = PREFIX["qwen3_moe"]
H_, I_ = 64, 64  # the refused layers' sizes (group 32)


def _zero_differs(t):
    """One zero point of expert 1's down_proj is 9, the others 8 (v1: stored 8 and 7)."""
    zeros = torch.full((I_ // 32, H_), 7)
    zeros[1, 13] = 8
    t[P + "experts.1.down_proj.qzeros"] = _pack_along_out(zeros)


def _g_idx_swapped(t):
    g = torch.arange(H_, dtype=torch.int32) // 32
    g[[3, 40]] = g[[40, 3]]
    t[P + "experts.2.up_proj.g_idx"] = g


BAD_TENSORS = [
    ("asymmetric zero points", _zero_differs,
     "'model.layers.1.mlp.experts.1.down_proj.qzeros' is not symmetric: word \\[1, 1\\] is 0x77877777, expected "
     "0x77777777 everywhere \\(every zero point 8, stored as 7 by checkpoint_format 'gptq'.*\\), as the config's "
     "sym = true says"),
    ("activation-ordered groups", _g_idx_swapped,
     "'model.layers.1.mlp.experts.2.up_proj.g_idx' puts input 3 in group 1, not 3 // 32 = 0: activation-ordered "
     "groups \\(desc_act\\)"),
    ("an expert bias", lambda t: t.update({P + "experts.3.gate_proj.bias": torch.zeros(I_, dtype=torch.float16)}),
     "'model.layers.1.mlp.experts.3.gate_proj.bias' is the bias of a GPTQ expert"),
    ("a stray key", lambda t: t.update({P + "experts.0.up_proj.qweight_ref": torch.zeros(1, dtype=torch.int32)}),
     "1 tensor\\(s\\) under prefix 'model.layers.1.mlp.' that MoEFFN cannot account for .*"
     "\\['model.layers.1.mlp.experts.0.up_proj.qweight_ref'\\]"),
    ("a missing qzeros", lambda t: t.pop(P + "experts.2.gate_proj.qzeros"),
     "missing tensor 'model.layers.1.mlp.experts.2.gate_proj.qzeros'"),
    ("qweight of another shape", lambda t: t.update({P + "experts.1.up_proj.qweight":
                                                     torch.zeros(H_ // 8, I_ + 8, dtype=torch.int32)}),
     "'model.layers.1.mlp.experts.1.up_proj.qweight' has shape \\(8, 72\\), expected \\(8, 64\\)"),
    ("scales of another group", lambda t: t.update({P + "experts.2.down_proj.scales":
                                                    torch.ones(1, H_, dtype=torch.float16)}),
     "'model.layers.1.mlp.experts.2.down_proj.scales' has shape \\(1, 64\\), expected \\(2, 64\\)"),
    ("scales of the first expert in groups of 16", lambda t: t.update({P + "experts.0.gate_proj.scales":
                                                                       torch.ones(H_ // 16, I_, dtype=torch.float16)}),
     "'model.layers.1.mlp.experts.0.gate_proj.scales' has shape \\(4, 64\\), expected \\[64/group, 64\\] with the "
     "group a power of two >= 32"),
    ("qzeros of another shape", lambda t: t.update({P + "experts.3.down_proj.qzeros":
                                                    torch.full((I_ // 32, H_ // 4), 0x77777777, dtype=torch.int32)}),
     "'model.layers.1.mlp.experts.3.down_proj.qzeros' has shape \\(2, 16\\), expected \\(2, 8\\)"),
    ("bf16 scales beside fp16 ones", lambda t: t.update({P + "experts.3.up_proj.scales":
                                                         torch.ones(H_ // 32, I_, dtype=torch.bfloat16)}),
     "'model.layers.1.mlp.experts.3.up_proj.scales' has dtype torch.bfloat16, expected float16"),
    ("a g_idx of another length", lambda t: t.update({P + "experts.1.gate_proj.g_idx":
                                                      torch.zeros(H_ // 2, dtype=torch.int32)}),
     "'model.layers.1.mlp.experts.1.gate_proj.g_idx' has shape \\(32,\\), expected \\(64,\\)"),
    ("a plain expert beside GPTQ ones",
     lambda t: [t.pop(k) for k in list(t) if k.startswith(P + "experts.3.down_proj.")] and t.update(
         {P + "experts.3.down_proj.weight": torch.zeros(H_, I_, dtype=torch.bfloat16)}),
     "'model.layers.1.mlp.experts.3.down_proj.weight' is a plain expert weight, but "
     "'model.layers.1.mlp.experts.0.down_proj.qweight' is GPTQ"),
    ("a GPTQ shared expert", lambda t: t.update({P + f"shared_expert.{n}.qweight": torch.zeros(1, dtype=torch.int32)
                                                 for n in ("gate_proj", "up_proj", "down_proj")}),
     "'model.layers.1.mlp.shared_expert.down_proj.qweight' is a GPTQ shared expert: MoEFFN's shared experts are "
     "dense"),
    ("an fp32 router", lambda t: t.update({P + "gate.weight": t[P + "gate.weight"].float()}),
     "'model.layers.1.mlp.gate.weight' has dtype torch.float32, expected bfloat16 or float16 \\(INT4 experts"),
]


@pytest.mark.parametrize("name,corrupt,match", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_gptq_layer_refuses_what_it_cannot_account_for(name, corrupt, match, tmp_path):
    """Each through from_safetensors (the tensors alone) and from_pretrained (with a valid GPTQ
    config): a ValueError naming the file and the key."""
    t, _, _ = _gptq_layer("qwen3_moe", 4, H_, I_, 32)
    corrupt(t)
    folder = _folder(tmp_path, _config("qwen3_moe", 4, _quant(32)), t)
    path = folder / "model.safetensors"
    with pytest.raises(ValueError) as e:
        onegemm.MoEFFN.from_safetensors(path, prefix=P)
    assert str(e.value).startswith(f"{path}: ") and re.search(match, str(e.value)), str(e.value)
    with pytest.raises(ValueError, match=match):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)


CONFIG = "config.json: quantization_config"
BAD_CONFIGS = [
    ("8 bits", dict(bits=8), f"{CONFIG}.bits = 8: only 4 is read"),
    ("no bits", dict(bits=DROP), f"{CONFIG}.bits = None: only 4 is read"),
    ("activation order", dict(desc_act=True), f"{CONFIG}.desc_act = True: only False is read"),
    ("channel scales", dict(group_size=-1),
     f"{CONFIG}.group_size = -1 \\(one scale per output channel\\): expected a power of two >= 32"),
    ("a group of 48", dict(group_size=48), f"{CONFIG}.group_size = 48: expected a power of two >= 32"),
    ("a group of 16", dict(group_size=16), f"{CONFIG}.group_size = 16: expected a power of two >= 32"),
    ("per-module overrides", dict(dynamic={r"-:.*experts\.0\..*": {}, r"+:.*down_proj.*": {"bits": 8}}),
     f"{CONFIG}.dynamic = .*: only None / \\{{\\}} is read"),
    ("marlin checkpoint_format", dict(checkpoint_format="marlin"),
     f"{CONFIG}.checkpoint_format = 'marlin': only 'gptq' / 'gptq_v2' is read"),
    ("unknown format", dict(format="bitblas"), f"{CONFIG}.format = 'bitblas': only 'gptq' / 'gptq_v2' is read"),
    ("two formats", dict(format="gptq_v2"),
     f"{CONFIG}.format = 'gptq_v2' and checkpoint_format = 'gptq': two storage formats"),
    ("int16 words", dict(pack_dtype="int16"), f"{CONFIG}.pack_dtype = 'int16': only 'int32' is read"),
    ("an adapter", dict(adapter={"name": "lora", "rank": 128}), f"{CONFIG}.adapter = .*: only None is read"),
    ("marlin layout", dict(is_marlin_format=True), f"{CONFIG}.is_marlin_format = True: only False is read"),
    ("an unknown field", dict(zero_point_dtype="int8"),
     f"{CONFIG}.zero_point_dtype = 'int8': not a GPTQ field known to leave the stored tensors"),
]


@pytest.mark.parametrize("name,fields,match", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_gptq_config_refuses(name, fields, match, tmp_path):
    """A GPTQ quantization_config other than symmetric 4-bit with contiguous power-of-two groups
    in int32 words (v1 or v2), or with a field not known to be harmless: refused naming
    config.json and the field (the tensors are valid)."""
    t, _, _ = _gptq_layer()
    config = _config("qwen3_moe", 4, _quant(32, **fields))
    folder = _folder(tmp_path, config, t)
    with pytest.raises(ValueError) as e:
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    assert re.search(match, str(e.value)) and str(e.value).startswith(str(folder / "config.json")), str(e.value)
    with pytest.raises(ValueError, match=match.replace("config.json", "config")):
        onegemm.MoEFFN.from_state_dict(t, config, prefix=P)


def test_gptq_experts_need_a_gptq_config(tmp_path):
    """GPTQ experts under a config that is not GPTQ, a GPTQ config whose group size or
    checkpoint_format is not the tensors', and compressed-tensors' packed experts under a GPTQ
    config: refused, naming the file and the key or config.json."""
    t, _, _ = _gptq_layer()
    folder = _folder(tmp_path, _config("qwen3_moe", 4, None), t)
    with pytest.raises(ValueError, match=f"^{re.escape(str(folder / 'model.safetensors'))}: tensor "
                                         "'model.layers.1.mlp.experts.0.down_proj.qweight' is a GPTQ weight, but the "
                                         "config has no GPTQ quantization_config"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    (folder / "config.json").write_text(json.dumps(_config("qwen3_moe", 4, _quant(64))))
    with pytest.raises(ValueError, match="the gate_proj / up_proj scales of 'model.layers.1.mlp.' give groups of 32 "
                                         "values, symmetric, but config.json's quantization_config has "
                                         "group_size 64 symmetric"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    (folder / "config.json").write_text(json.dumps(_config("qwen3_moe", 4, _quant(32, "gptq_v2"))))
    with pytest.raises(ValueError, match="qzeros' is not symmetric: word \\[0, 0\\] is 0x77777777, expected "
                                         "0x88888888 everywhere \\(every zero point 8, stored as 8 by "
                                         "checkpoint_format 'gptq_v2'\\)"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
    packed = {k: v for k, v in t.items() if ".experts." not in k}
    for e in range(4):
        for name in NAMES["qwen3_moe"]:
            q, s = quantize_int4(torch.randn(I_, H_).to(torch.bfloat16), 32)
            packed.update({f"{P}experts.{e}.{name}.weight_packed": q, f"{P}experts.{e}.{name}.weight_scale": s,
                           f"{P}experts.{e}.{name}.weight_shape": torch.tensor([I_, H_])})
    save_file(packed, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.experts.0.down_proj.weight_packed' is "
                                         "compressed-tensors' packed INT4, but the config's quantization_config is "
                                         "GPTQ"):
        onegemm.MoEFFN.from_pretrained(folder, layer=1)
