"""MoEFFN against Hugging Face transformers itself: for each MoE family the installed transformers
has, a tiny random model is built by transformers, saved with save_pretrained (sharded; both
layouts where transformers offers them), loaded with MoEFFN.from_pretrained, and compared with
the transformers block's forward (fp32, CPU), its routing, and its float64 gradients; and the
block's own state_dict loads as the same layer (MoEFFN.from_state_dict). The blocks' random
weights and their forward on [T, H]: onegemm.testing's randomize_moe_block and hf_forward.
"""

import copy
import json

import pytest
import torch

import onegemm
from onegemm.grouped import loading
from onegemm.testing import HF_MOE_BLOCKS, assert_close, hf_forward, moe_layer_ref, randomize_moe_block, rel_err

transformers = pytest.importorskip("transformers")

H = 32
COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
              head_dim=8)

# family -> (model class, config fields); the config class: testing.HF_MOE_BLOCKS
FAMILIES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=40, intermediate_size=48, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
                  intermediate_size=48, norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                    intermediate_size=48, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
                    routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=8)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                 intermediate_size=48, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                 norm_topk_prob=False, routed_scaling_factor=1.5)),
    "llama4_text": ("Llama4ForCausalLM", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=24,
                    intermediate_size_mlp=48)),
    "gpt_oss": ("GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
                swiglu_limit=1.5)),
}
# transformers saves Llama-4's and gpt-oss's experts fused in both formats (as on the Hub). gpt-oss
# runs with swiglu_limit 1.5 (7.0 in the real models) so that the clamps bite at these sizes.
CASES = [pytest.param(f, id=f) for f in FAMILIES]


def build(family, **overrides):
    """A tiny random transformers model of ``family`` with a well-spread router (and correction
    bias): its MoE block is layer 1's."""
    model_name, fields = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    cfg = getattr(transformers, HF_MOE_BLOCKS[family][0])(**COMMON, **{**fields, **overrides})
    for name, value in {**fields, **overrides}.items():  # some versions map renamed fields
        if value is not None:
            setattr(cfg, name, value)
    # transformers' eager expert loop (its grouped_mm path has no float64, which the gradient
    # test runs the block in)
    cfg._experts_implementation = "eager"
    model = getattr(transformers, model_name)(cfg).eval()
    randomize_moe_block(block_of(model, family), cfg)  # (a dense MLP in the refused configurations)
    return model


def block_of(model, family):
    return getattr(model.model.layers[1], HF_MOE_BLOCKS[family][3])


@pytest.mark.parametrize("family", CASES)
def test_layer_matches_transformers(family, tmp_path, device):
    """Both save formats (the Hub's per-expert names and transformers' fused layout), sharded,
    and the block's state_dict in memory load the same layer; it computes the transformers
    block's output and routing (and moe_layer_ref's), and (GRADS) its router's and shared
    experts' gradients."""
    model = build(family)
    layers = []
    for original_format in (True, False):
        folder = tmp_path / str(original_format)
        model.save_pretrained(folder, max_shard_size="20KB", save_original_format=original_format)
        assert len(list(folder.glob("*.safetensors"))) > 2  # sharded
        layers.append(onegemm.MoEFFN.from_pretrained(folder, layer=1, device=device))
    block = block_of(model, family)
    layers.append(onegemm.MoEFFN.from_state_dict(block.state_dict(), model.config, device=device))
    layer = layers[0]
    for other in layers[1:]:
        assert (other.top_k, other.renormalize, other.routing) == (layer.top_k, layer.renormalize, layer.routing)
        for (name, p), (_, q) in zip(layer.state_dict().items(), other.state_dict().items()):
            assert (p is None and q is None) or torch.equal(p, q), name
    T = 9
    x = torch.randn(T, H)
    got = layer(x.to(device))
    with torch.no_grad():
        assert_close(got, hf_forward(block, x), 1e-5)
        assert_close(got, moe_layer_ref(layer, x.to(device))[0], 1e-5, "moe_layer_ref")
        # the routing alone: the same experts (transformers' order within a token may differ)
        w, ids = layer.route(x.to(device))
        dense_w = torch.zeros(T, layer.num_experts).scatter_(1, ids.long().cpu(), w.cpu())
        router = getattr(block, "gate", None) or block.router
        hf = router(x)
        if family == "llama4_text":  # (scores [T, E], 0 off the chosen experts; logits)
            top = hf[1].topk(layer.top_k, dim=1)
            hf_dense = torch.sigmoid(torch.full_like(hf[1], float("-inf")).scatter(1, top.indices, top.values))
        else:  # (logits, weights [T, k], ids [T, k])
            hf_dense = torch.zeros(T, layer.num_experts).scatter_(1, hf[2], hf[1].float())
        assert torch.equal(dense_w != 0, hf_dense != 0)
        assert_close(dense_w, hf_dense, 1e-6)
    if family in GRADS:
        grad = torch.randn(T, H)
        got.backward(grad.to(device))
        block64 = copy.deepcopy(block).double()
        hf_forward(block64, x.double()).backward(grad.double())
        check_gradients(family, layer, block64)


# What each family's gradient test compares (besides the experts, which test_autograd.py covers).
GRADS = ("qwen2_moe", "deepseek_v3", "llama4_text", "gpt_oss")


def check_gradients(family, layer, block):
    """Gradients of the router and the shared experts (gpt-oss: its biases) against the
    transformers block run in float64."""
    router = getattr(block, "gate", None) or block.router
    want = [("router", layer.gate_weight, router.weight.grad)]
    if family == "gpt_oss":  # no shared expert: the router's bias and the experts' biases
        b13 = block.experts.gate_up_proj_bias.grad
        want += [("router bias", layer.gate_bias, router.bias.grad),
                 ("gate_up bias", layer.w_gate_up_bias, torch.cat([b13[:, 0::2], b13[:, 1::2]], 1)),
                 ("down bias", layer.w_down_bias, block.experts.down_proj_bias.grad),
                 ("down_proj", layer.w_down, block.experts.down_proj.grad.transpose(1, 2))]
    else:
        shared = block.shared_experts if family == "deepseek_v3" else block.shared_expert
        want += [("shared gate/up", layer.shared_w_gate_up,
                  torch.cat([shared.gate_proj.weight.grad, shared.up_proj.weight.grad])),
                 ("shared down_proj", layer.shared_w_down, shared.down_proj.weight.grad)]
    if family == "qwen2_moe":
        want.append(("shared gate", layer.shared_gate, block.shared_expert_gate.weight.grad))
    for name, ours, theirs in want:
        assert ours.grad is not None, f"{name}: no gradient"
        assert_close(ours.grad.cpu(), theirs, 1e-5, f"grad of {name}")


DENSE = [
    pytest.param("deepseek_v3", {}, 0, "first_k_dense_replace = 1", id="deepseek-first-k-dense"),
    pytest.param("qwen3_moe", dict(mlp_only_layers=[1]), 1, "mlp_only_layers", id="qwen3-mlp-only"),
    pytest.param("qwen2_moe", dict(decoder_sparse_step=2), 0, "decoder_sparse_step = 2", id="qwen2-sparse-step"),
    pytest.param("llama4_text", dict(interleave_moe_layer_step=2, moe_layers=None), 0, "moe_layers = \\[1\\]",
                 id="llama4-interleave"),
]


@pytest.mark.parametrize("family,overrides,layer,match", DENSE)
def test_dense_layer_is_refused(family, overrides, layer, match, tmp_path):
    model = build(family, **overrides)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"config.json: layer {layer} of this .* is a dense MLP.*{match}"):
        onegemm.MoEFFN.from_pretrained(tmp_path, layer=layer)


def test_only_the_layers_shards_are_opened(tmp_path, monkeypatch):
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path, max_shard_size="10KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    opened = []
    real = loading.safe_open
    monkeypatch.setattr(loading, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    onegemm.MoEFFN.from_pretrained(tmp_path, layer=1)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    holding = {v for k, v in weight_map.items() if k.startswith("model.layers.1.mlp.")}
    assert {p.rsplit("/", 1)[-1] for p in opened} == holding and len(holding) < len(shards)


def test_gpt_oss_file_needs_its_swiglu(tmp_path, device):
    """A gpt-oss layer from one file: its clamped SwiGLU is an argument (the file has no config)."""
    model = build("gpt_oss")
    model.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    with pytest.raises(ValueError, match="experts.gate_up_proj_bias'.*pass scoring='topk_softmax'.*swiglu_limit"):
        onegemm.MoEFFN.from_safetensors(f, prefix="model.layers.1.mlp.", device=device)
    layer = onegemm.MoEFFN.from_safetensors(f, prefix="model.layers.1.mlp.", top_k=2, renormalize=False,
                                            scoring="topk_softmax", swiglu_limit=1.5, device=device)
    want = onegemm.MoEFFN.from_pretrained(tmp_path, layer=1, device=device)
    assert all(torch.equal(p, q) for p, q in zip(layer.state_dict().values(), want.state_dict().values()))
    assert layer.swiglu_limit == want.swiglu_limit == 1.5 and want.swiglu_alpha == 1.702


@pytest.mark.gpu
@pytest.mark.parametrize("family", CASES)
def test_gpu_bf16_layer_against_transformers(family, tmp_path, device):
    """bf16 on the GPU: onegemm's error against float64 is within 1.5x of the transformers
    block's own bf16 error (both on the same bf16 weights)."""
    model = build(family).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    layer = onegemm.MoEFFN.from_pretrained(tmp_path, layer=1, device=device)
    block = block_of(model, family)
    x = torch.randn(256, H).to(torch.bfloat16)
    with torch.no_grad():
        ref = hf_forward(block.double(), x.double())
        theirs = hf_forward(block.to(device=device, dtype=torch.bfloat16), x.to(device))
        ours = layer(x.to(device))
    assert rel_err(ours, ref) <= 1.5 * rel_err(theirs, ref)


def test_gpt_oss_mxfp4_layer_matches_transformers(tmp_path, device):
    """gpt-oss's MXFP4 experts read as stored (``*_blocks``, ``*_scales``: uint8, gate and up rows
    interleaved) from a file saved with the Hub's key names; the layer (bf16, weight-only)
    computes the transformers block's output with transformers' own dequantisation of those
    bytes (convert_moe_packed_tensors) as its experts, in fp32."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    from safetensors.torch import save_file

    from onegemm.testing import mxfp4_quantize_ref

    model = build("gpt_oss", intermediate_size=32)  # MXFP4 rows: H and I multiples of 32
    block = block_of(model, "gpt_oss")
    experts, prefix = block.experts, "model.layers.1.mlp."
    # the experts' rows as the file stores them: [E, 2I, H] (gate and up interleaved) and [E, H, I]
    (b13, s13), (b2, s2) = (mxfp4_quantize_ref(w.transpose(1, 2)) for w in (experts.gate_up_proj, experts.down_proj))
    tensors = {"router.weight": block.router.weight, "router.bias": block.router.bias,
               "experts.gate_up_proj_blocks": b13, "experts.gate_up_proj_scales": s13,
               "experts.gate_up_proj_bias": experts.gate_up_proj_bias,
               "experts.down_proj_blocks": b2, "experts.down_proj_scales": s2,
               "experts.down_proj_bias": experts.down_proj_bias}
    bf16 = {k: (v if v.dtype == torch.uint8 else v.detach().to(torch.bfloat16)).contiguous() for k, v in tensors.items()}
    save_file({prefix + k: v for k, v in bf16.items()}, tmp_path / "layer.safetensors")
    layer = onegemm.MoEFFN.from_safetensors(tmp_path / "layer.safetensors", prefix=prefix, top_k=2, renormalize=False,
                                            scoring="topk_softmax", swiglu_limit=1.5, device=device)
    assert layer.w_gate_up.dtype == torch.float4_e2m1fn_x2 and layer.w_down.dtype == torch.float4_e2m1fn_x2
    # a model folder as the Hub has it: config.json names the quantisation
    config = {**model.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "layer.safetensors").rename(tmp_path / "model.safetensors")
    folder = onegemm.MoEFFN.from_pretrained(tmp_path, layer=1, device=device)
    assert all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) if p.element_size() == 1 else torch.equal(p, q)
               for p, q in zip(layer.state_dict().values(), folder.state_dict().values()))
    # the transformers block in fp32 on the same values: its router and biases rounded to bf16,
    # its experts transformers' decoding of the file's bytes
    with torch.no_grad():
        block.router.weight.copy_(bf16["router.weight"])
        block.router.bias.copy_(bf16["router.bias"])
        experts.gate_up_proj_bias.copy_(bf16["experts.gate_up_proj_bias"])
        experts.down_proj_bias.copy_(bf16["experts.down_proj_bias"])
        experts.gate_up_proj.copy_(mxfp4.convert_moe_packed_tensors(b13, s13, dtype=torch.float32))
        experts.down_proj.copy_(mxfp4.convert_moe_packed_tensors(b2, s2, dtype=torch.float32))
        x = torch.randn(9, H).to(torch.bfloat16)
        assert_close(layer(x.to(device)), hf_forward(block, x.float()), 2e-2)
