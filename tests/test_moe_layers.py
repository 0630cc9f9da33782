"""Routing for every family (route), MoEFFN's shared experts and input-side weights, and the
checkpoint loader's refusals. The same layers against transformers: test_transformers.py."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import onegemm
from helpers import capture
from onegemm.testing import assert_close, assert_moe_fp8_close, assert_route_close, launched, moe_ref, route_ref

# ---- routing ----

# (route's options, with bias=True for a random correction bias; E; top_k)
ROUTES = [
    pytest.param(dict(), 8, 2, id="softmax-renormalised-mixtral"),
    pytest.param(dict(renormalize=False), 8, 2, id="softmax-qwen"),
    pytest.param(dict(scoring="sigmoid", bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5), 16, 4,
                 id="sigmoid-groups-bias-deepseek-v3"),
    pytest.param(dict(scoring="sigmoid", bias=True, renormalize=False, routed_scaling_factor=1.5), 8, 2,
                 id="sigmoid-bias-unnormalised-scaled"),
    pytest.param(dict(scoring="sigmoid", n_group=4, topk_group=1), 8, 2, id="sigmoid-groups-no-bias"),
    pytest.param(dict(scoring="softmax", bias=True, n_group=2, topk_group=1), 8, 3, id="softmax-bias-groups"),
    pytest.param(dict(scoring="topk_softmax", renormalize=False), 8, 2, id="topk-softmax-gpt-oss"),
    pytest.param(dict(scoring="topk_sigmoid", renormalize=False), 4, 1, id="topk-sigmoid-llama4"),
]


@pytest.mark.parametrize("options,E,k", ROUTES)
@pytest.mark.parametrize("T", [1, 17, 300])
def test_route_matches_reference(options, E, k, T, device):
    options = dict(options)
    renormalize = options.pop("renormalize", True)
    if options.pop("bias", False):
        options["correction_bias"] = torch.randn(E, device=device) * 0.1
    logits = torch.randn(T, E, device=device) * 2
    w, ids = onegemm.route(logits, k, renormalize, **options)
    w_ref, ids_ref = route_ref(logits, k, renormalize, **options)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and w.device == logits.device
    assert torch.equal(ids.long(), ids_ref)
    assert_close(w, w_ref, 1e-6)
    if options.get("n_group", 1) > 1:  # every chosen expert lies in one of the topk_group kept groups
        groups = ids.long() // (E // options["n_group"])
        assert all(len(set(row.tolist())) <= options["topk_group"] for row in groups)
    w2, ids2 = onegemm.route(logits, k, renormalize, **options)
    assert torch.equal(w, w2) and torch.equal(ids, ids2)


# (case, logits, route's options, top_k, the ids guaranteed)
TIES = [
    pytest.param([[0.0] * 6], dict(), 3, [[0, 1, 2]], id="all-equal-first-experts"),
    pytest.param([[1.0, 3.0, 3.0, 2.0, 3.0]], dict(), 2, [[1, 2]], id="equal-values-lower-index"),
    pytest.param([[30.0, 31.0, 0.0, 0.0]], dict(scoring="sigmoid"), 1, [[0]], id="sigmoid-saturated-tie"),
    pytest.param([[30.0, 31.0, 0.0, 0.0]], dict(scoring="topk_sigmoid", renormalize=False), 1, [[1]],
                 id="topk-on-logits-no-tie"),
    pytest.param([[2.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0]], dict(scoring="sigmoid", n_group=4, topk_group=1), 2,
                 [[0, 1]], id="tied-groups-lower-group"),
    pytest.param([[2.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0]], dict(scoring="sigmoid", n_group=4, topk_group=2), 1,
                 [[0]], id="tied-experts-in-two-kept-groups"),
    # with a bias a group scores the sum of its two best: group 1 (0.88 + 0.88) beats group 0 (0.95 + 0)
    pytest.param([[3.0, -9.0, -9.0, -9.0, 2.0, 2.0, -9.0, -9.0]],
                 dict(scoring="sigmoid", n_group=2, topk_group=1, correction_bias=torch.zeros(8)), 1, [[4]],
                 id="group-score-is-the-top-2-sum"),
]


@pytest.mark.parametrize("logits,options,k,want", TIES)
def test_route_ties_lower_index_first(logits, options, k, want, device):
    options = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in options.items()}
    _, ids = onegemm.route(torch.tensor(logits, device=device), k, **options)
    assert ids.tolist() == want


def test_route_correction_bias_selects_only(device):
    """The bias decides the choice; the weights are the unbiased scores."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=device)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0], device=device)
    w, ids = onegemm.route(logits, 2, False, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[3, 0]]
    assert_close(w, torch.sigmoid(torch.tensor([[-1.0, 2.0]], dtype=torch.float64)), 1e-7)


def _logits(d):
    return torch.randn(4, 8, device=d)


BAD_ROUTES = [
    ("scoring name", dict(scoring="softmax_topk"), ValueError, "scoring must be one of"),
    ("scoring type", dict(scoring=1), TypeError, "scoring must be one of"),
    ("n_group not a divisor", dict(scoring="sigmoid", n_group=3, topk_group=1), ValueError, "n_group must be a divisor"),
    ("topk_group missing", dict(scoring="sigmoid", n_group=4), TypeError, "topk_group must be an int"),
    ("topk_group too large", dict(scoring="sigmoid", n_group=4, topk_group=5), ValueError, "topk_group must be an int in"),
    ("too few experts kept", dict(scoring="sigmoid", n_group=4, topk_group=1, top_k=3), ValueError, "top_k must be at most"),
    ("groups of one expert with a bias", dict(scoring="sigmoid", n_group=8, topk_group=2, bias=torch.zeros(8)),
     ValueError, "n_group must be at most E / 2"),
    ("bias with topk scoring", dict(scoring="topk_softmax", bias=torch.zeros(8)), ValueError, "correction_bias must be None"),
    ("bias shape", dict(scoring="sigmoid", bias=torch.zeros(7)), ValueError, "correction_bias must be \\[E\\]"),
    ("bias type", dict(scoring="sigmoid", bias=[0.0] * 8), TypeError, "correction_bias must be a torch.Tensor"),
    ("groups with topk scoring", dict(scoring="topk_sigmoid", n_group=2, topk_group=1), ValueError, "n_group must be 1"),
    ("scaling type", dict(routed_scaling_factor="2.5"), TypeError, "routed_scaling_factor must be a float"),
    ("scaling value", dict(routed_scaling_factor=-1.0), ValueError, "routed_scaling_factor must be a finite number"),
]


@pytest.mark.parametrize("name,options,exc,match", BAD_ROUTES, ids=[c[0] for c in BAD_ROUTES])
def test_route_bad_options(name, options, exc, match, device):
    options = dict(options)
    k = options.pop("top_k", 2)
    if "bias" in options:
        b = options.pop("bias")
        options["correction_bias"] = b.to(device) if isinstance(b, torch.Tensor) else b
    with pytest.raises(exc, match=match):
        onegemm.route(_logits(device), k, **options)


@pytest.mark.gpu
def test_gpu_route_in_a_cuda_graph(device):
    """DeepSeek-V3's routing at decode size is captured and replayed (no host sync)."""
    logits = torch.randn(64, 256, device=device)
    bias = torch.randn(256, device=device) * 0.01
    options = dict(scoring="sigmoid", correction_bias=bias, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    onegemm.route(logits, 8, **options)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = onegemm.route(logits, 8, **options)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    w_ref, ids_ref = route_ref(logits, 8, **options)
    assert torch.equal(ids.long(), ids_ref) and (w - w_ref).abs().max() < 1e-6


def test_assert_route_close_takes_near_ties_only(device):
    """The GPU route check's tie rule: another expert of a nearly tied score passes (with its
    own weight), one of a clearly lower score fails, and so does a wrong weight."""
    logits = torch.tensor([[3.0, 1.0, 1.0 + 1e-9, -2.0]], device=device, dtype=torch.float64)
    w, ids = route_ref(logits, 2, scoring="topk_softmax")
    assert ids.tolist() == [[0, 2]]
    swapped = torch.tensor([[0, 1]], device=device)
    w_swapped, _ = route_ref(logits, 2, scoring="topk_softmax", ids=swapped)
    assert_route_close(w_swapped, swapped, logits, 2, scoring="topk_softmax")
    with pytest.raises(AssertionError, match="chose other experts"):
        assert_route_close(w, torch.tensor([[0, 3]], device=device), logits, 2, scoring="topk_softmax")
    with pytest.raises(AssertionError, match="route weights"):
        assert_route_close(w_swapped * 1.01, swapped, logits, 2, scoring="topk_softmax")


@pytest.mark.gpu
@pytest.mark.parametrize("options,E,k", [
    pytest.param(dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5), 256, 8, id="deepseek-v3"),
    pytest.param(dict(scoring="sigmoid", routed_scaling_factor=2.827), 384, 8, id="kimi-k2"),
    pytest.param(dict(renormalize=False), 128, 8, id="qwen3"),
    pytest.param(dict(scoring="topk_softmax", renormalize=False), 128, 4, id="gpt-oss"),
])
@pytest.mark.parametrize("T", [1, 64, 256, 300])
def test_gpu_route_fused_and_torch_paths(options, E, k, T, device):
    """Real sizes on the GPU: T <= 256 takes the fused kernel, 300 the torch ops; both match
    the float64 reference."""
    options = dict(options)
    renormalize = options.pop("renormalize", True)
    if options.get("scoring") == "sigmoid":
        options["correction_bias"] = torch.randn(E, device=device) * 0.01
    logits = torch.randn(T, E, device=device).to(torch.bfloat16)
    w, ids = onegemm.route(logits, k, renormalize, **options)
    # 300 x 384 random scores nearly tie at the k-th expert now and then (a CI run chose the
    # other of two): exact ids elsewhere, equal float64 scores there.
    assert_route_close(w, ids, logits, k, renormalize, **options)


# ---- MoEFFN: input-side weights, shared experts ----


def test_moeffn_weights_on_input_top2_matches_reference(device):
    """Llama-4's weighting with k = 2: y = sum_j FFN_e(w_j * x) (+ the shared expert)."""
    T, H, I, E, S = 11, 16, 8, 4, 12
    gate = torch.randn(E, H, device=device) * H**-0.5
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    s13 = torch.randn(2 * S, H, device=device) * H**-0.5
    s2 = torch.randn(H, S, device=device) * S**-0.5
    layer = onegemm.MoEFFN(gate, w13, w2, top_k=2, renormalize=False, scoring="topk_sigmoid", weights_on_input=True,
                           shared_w_gate_up=s13, shared_w_down=s2)
    x = torch.randn(T, H, device=device)
    with torch.no_grad():
        y = layer(x)
    w, ids = route_ref(x.double() @ gate.double().t(), 2, False, scoring="topk_sigmoid")
    ones = torch.ones(T, 1, dtype=torch.float64, device=device)
    want = sum(moe_ref(x.double() * w[:, j:j + 1], w13, w2, ones, ids[:, j:j + 1]) for j in range(2))
    g, u = (x.double() @ s13.double().t()).chunk(2, dim=-1)
    want = want + (torch.nn.functional.silu(g) * u) @ s2.double().t()
    assert_close(y, want, 1e-5)


def _layer_args(d, E=4, H=16, I=8):
    return dict(gate_weight=torch.randn(E, H, device=d), w_gate_up=torch.randn(E, 2 * I, H, device=d),
                w_down=torch.randn(E, H, I, device=d))


GPT_OSS = dict(gate_bias=torch.zeros(4), w_gate_up_bias=torch.zeros(4, 16), w_down_bias=torch.zeros(4, 16),
               swiglu_limit=7.0)
BAD_LAYERS = [
    ("shared down missing", dict(shared_w_gate_up=torch.randn(24, 16)), ValueError,
     "shared_w_down must be a tensor: shared experts need both"),
    ("shared gate alone", dict(shared_gate=torch.randn(1, 16)), ValueError, "shared_gate must be None without"),
    ("shared shape", dict(shared_w_gate_up=torch.randn(24, 15), shared_w_down=torch.randn(16, 12)), ValueError,
     "shared_w_gate_up must be \\[2S, H\\]"),
    ("shared down shape", dict(shared_w_gate_up=torch.randn(24, 16), shared_w_down=torch.randn(16, 11)), ValueError,
     "shared_w_down must be \\[H, S\\] = \\[16, 12\\]"),
    ("shared dtype", dict(shared_w_gate_up=torch.randn(24, 16).half(), shared_w_down=torch.randn(16, 12)), TypeError,
     "shared_w_gate_up must be of dtype"),
    ("shared gate shape", dict(shared_w_gate_up=torch.randn(24, 16), shared_w_down=torch.randn(16, 12),
                               shared_gate=torch.randn(2, 16)), ValueError, "shared_gate must be \\[1, H\\]"),
    ("weights_on_input type", dict(weights_on_input=1), TypeError, "weights_on_input must be a bool"),
    ("routing option", dict(scoring="sigmoid", n_group=2), TypeError, "topk_group must be an int"),
    ("bias shape", dict(scoring="sigmoid", correction_bias=torch.zeros(5)), ValueError, "correction_bias must be \\[E\\]"),
    ("bias type", dict(scoring="sigmoid", correction_bias=[0.0] * 4), TypeError, "correction_bias must be a torch.Tensor"),
    ("gpt-oss biases in part", dict(gate_bias=torch.zeros(4)), ValueError, "w_gate_up_bias must be given with gate_bias"),
    ("gpt-oss bias shape", dict(GPT_OSS, w_gate_up_bias=torch.zeros(4, 15)), ValueError,
     "w_gate_up_bias must be \\[4, 16\\]"),
    ("gpt-oss limit", dict(GPT_OSS, swiglu_limit=0.0), ValueError, "swiglu_limit must be a number > 0"),
    ("gpt-oss with input weights", dict(GPT_OSS, weights_on_input=True), ValueError,
     "w_gate_up_bias must be None with FP8 experts or weights_on_input"),
]


@pytest.mark.parametrize("name,options,exc,match", BAD_LAYERS, ids=[c[0] for c in BAD_LAYERS])
def test_moeffn_bad_options(name, options, exc, match, device):
    options = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    with pytest.raises(exc, match=match):
        onegemm.MoEFFN(**_layer_args(device), **options)


# ---- loading: every key accounted for ----


def _deepseek_file(E=4, H=16, I=8, S=16, prefix="model.layers.3.mlp."):
    t = {prefix + "gate.weight": torch.randn(E, H), prefix + "gate.e_score_correction_bias": torch.randn(E)}
    for e in range(E):
        t[f"{prefix}experts.{e}.gate_proj.weight"] = torch.randn(I, H)
        t[f"{prefix}experts.{e}.up_proj.weight"] = torch.randn(I, H)
        t[f"{prefix}experts.{e}.down_proj.weight"] = torch.randn(H, I)
    t[prefix + "shared_experts.gate_proj.weight"] = torch.randn(S, H)
    t[prefix + "shared_experts.up_proj.weight"] = torch.randn(S, H)
    t[prefix + "shared_experts.down_proj.weight"] = torch.randn(H, S)
    return t


def test_from_safetensors_reads_bias_and_shared_experts(tmp_path, device):
    t = _deepseek_file()
    path = tmp_path / "layer.safetensors"
    save_file(t, str(path))
    p = "model.layers.3.mlp."
    layer = onegemm.MoEFFN.from_safetensors(path, prefix=p, top_k=2, scoring="sigmoid", n_group=2, topk_group=1,
                                            routed_scaling_factor=2.5, device=device)
    assert torch.equal(layer.correction_bias.cpu(), t[p + "gate.e_score_correction_bias"])
    assert torch.equal(layer.shared_w_gate_up.cpu(), torch.cat([t[p + "shared_experts.gate_proj.weight"],
                                                                t[p + "shared_experts.up_proj.weight"]]))
    assert torch.equal(layer.shared_w_down.cpu(), t[p + "shared_experts.down_proj.weight"])
    assert torch.equal(layer.w_gate_up[3, 8:].cpu(), t[p + "experts.3.up_proj.weight"])
    assert layer.routing == dict(scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5)
    assert layer.shared_gate is None


def test_from_safetensors_fp8_shared_experts_are_dequantised(tmp_path, device):
    t = _deepseek_file(H=16, S=136)  # S > 128: two scale blocks
    p = "model.layers.3.mlp."
    want = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        key = f"{p}shared_experts.{name}.weight"
        q, s = onegemm.quantize_fp8(t[key].to(device), (128, 128))
        t[key], t[key + "_scale_inv"] = q.cpu(), s.cpu()
        blocks = s.cpu().repeat_interleave(128, 0)[:q.shape[0]].repeat_interleave(128, 1)[:, :q.shape[1]]
        want[name] = q.cpu().float() * blocks
    path = tmp_path / "fp8_shared.safetensors"
    save_file(t, str(path))
    layer = onegemm.MoEFFN.from_safetensors(path, prefix=p, scoring="sigmoid", device=device)
    assert torch.equal(layer.shared_w_gate_up.cpu(), torch.cat([want["gate_proj"], want["up_proj"]]))
    assert torch.equal(layer.shared_w_down.cpu(), want["down_proj"])


P = "model.layers.3.mlp."
BAD_LAYER_FILES = [
    ("an expert beyond the router's E", lambda t: t.update({P + "experts.4.gate_proj.weight": torch.randn(8, 16)}),
     "'model.layers.3.mlp.experts.4.gate_proj.weight' belongs to expert 4, but the router "
     "'model.layers.3.mlp.gate.weight' has E = 4 rows"),
    ("Mixtral and Qwen names for one expert", lambda t: t.update({P + "experts.1.w1.weight": torch.randn(8, 16)}),
     "'model.layers.3.mlp.experts.1.w1.weight' uses the expert names w1/w3/w2 \\(Mixtral\\), but "
     "'model.layers.3.mlp.experts.0.down_proj.weight' uses gate_proj/up_proj/down_proj"),
    ("a correction bias without sigmoid routing", None, "gate.e_score_correction_bias' is a correction bias .*"
     "pass scoring='sigmoid'"),
    ("a key nothing reads", lambda t: t.update({P + "experts.0.gate_proj.bias": torch.randn(8)}),
     "1 tensor\\(s\\) under prefix 'model.layers.3.mlp.' that MoEFFN cannot account for .*"
     "\\['model.layers.3.mlp.experts.0.gate_proj.bias'\\]"),
    ("fused and per-expert experts", lambda t: t.update({P + "experts.gate_up_proj": torch.randn(4, 16, 16)}),
     "'model.layers.3.mlp.experts.gate_up_proj' is a fused expert tensor, but the layer also has per-expert"),
    ("two routers", lambda t: t.update({P + "router.weight": torch.randn(4, 16)}), "are both routers"),
    ("a shared gate without a shared expert",
     lambda t: [t.pop(k) for k in list(t) if "shared_experts" in k] and t.update(
         {P + "shared_expert_gate.weight": torch.randn(1, 16)}), "is a shared expert's gate, but the layer has no shared expert"),
    ("two shared experts", lambda t: t.update({P + "shared_expert.gate_proj.weight": torch.randn(16, 16)}),
     "are two shared experts"),
    ("a missing shared tensor", lambda t: t.pop(P + "shared_experts.up_proj.weight"),
     "missing tensor 'model.layers.3.mlp.shared_experts.up_proj.weight'"),
    ("fused FP8 experts of I = 8", lambda t: [t.pop(k) for k in list(t) if ".experts." in k] and t.update({
        P + "experts.gate_up_proj": torch.randn(4, 16, 16).to(torch.float8_e4m3fn),
        P + "experts.gate_up_proj_scale_inv": torch.ones(4, 2, 1),
        P + "experts.down_proj": torch.randn(4, 16, 8).to(torch.float8_e4m3fn),
        P + "experts.down_proj_scale_inv": torch.ones(4, 1, 1)}),
     "'model.layers.3.mlp.experts.gate_up_proj_scale_inv' scales fused FP8 experts of I = 8, not a multiple of 128"),
    ("a fused expert bias", lambda t: [t.pop(k) for k in list(t) if ".experts." in k] and t.update({
        P + "experts.gate_up_proj": torch.randn(4, 16, 16), P + "experts.down_proj": torch.randn(4, 16, 8),
        P + "experts.down_proj_bias": torch.randn(4, 16)}),
     "'model.layers.3.mlp.experts.down_proj_bias' is a scale or bias of fused experts that MoEFFN does not read"),
]


@pytest.mark.parametrize("name,corrupt,match", BAD_LAYER_FILES, ids=[c[0] for c in BAD_LAYER_FILES])
def test_from_safetensors_refuses_what_it_cannot_account_for(name, corrupt, match, tmp_path, device):
    t = _deepseek_file()
    routing = dict(scoring="sigmoid")
    if corrupt is None:
        routing = {}
    else:
        corrupt(t)
    path = tmp_path / "bad.safetensors"
    save_file(t, str(path))
    with pytest.raises(ValueError) as e:
        onegemm.MoEFFN.from_safetensors(path, prefix=P, device=device, **routing)
    assert str(e.value).startswith(f"{path}: ") and re.search(match, str(e.value)), str(e.value)


def _folder(tmp_path, config, tensors):
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


DS_CONFIG = dict(model_type="deepseek_v3", num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2,
                 n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=2, moe_intermediate_size=8,
                 routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu")
BAD_FOLDERS = [
    ("an unknown model type", dict(model_type="llama"), 3, "config.json: model_type 'llama' is not an MoE family"),
    ("a layer past the model", {}, 4, "layer must be an int in \\[0, 3\\]"),
    ("experts the config does not have", dict(n_routed_experts=8), 3, "has E = 4 rows, but config.json says 8"),
    ("shared expert size", dict(n_shared_experts=1), 3, "has size 16, config.json gives 8"),
    ("no shared expert in the config", dict(n_shared_experts=0), 3, "has shared expert tensors, but config.json"),
    ("another routing method", dict(topk_method="group_limited_greedy"), 3,
     "topk_method = 'group_limited_greedy': only 'noaux_tc'"),
    ("another activation", dict(hidden_act="gelu"), 3, "hidden_act = 'gelu'"),
    ("a layer without an MoE block", {}, 2, "layer 2: expected one MoE block"),
]


@pytest.mark.parametrize("name,config,layer,match", BAD_FOLDERS, ids=[c[0] for c in BAD_FOLDERS])
def test_from_pretrained_refuses(name, config, layer, match, tmp_path):
    folder = _folder(tmp_path, {**DS_CONFIG, **config}, _deepseek_file())
    with pytest.raises(ValueError, match=match):
        onegemm.MoEFFN.from_pretrained(folder, layer=layer)


def test_from_pretrained_reads_the_family_routing(tmp_path, device):
    folder = _folder(tmp_path, DS_CONFIG, _deepseek_file())
    layer = onegemm.MoEFFN.from_pretrained(folder, layer=3, device=device)
    assert layer.routing == dict(scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5)
    assert layer.top_k == 2 and layer.renormalize and layer.shared_w_down.shape == (16, 16)


BAD_STATE_DICTS = [
    ("not a dict", lambda t: list(t.values()), DS_CONFIG, TypeError, "state_dict must be a dict of tensors"),
    ("not a config", lambda t: t, "config.json", TypeError, "config must be a transformers config or a config.json"),
    ("a key it cannot account for", lambda t: {**t, "model.layers.3.mlp.gate.extra": torch.zeros(1)}, DS_CONFIG,
     ValueError, "state_dict: 1 tensor\\(s\\) under prefix .* cannot account for.*gate.extra"),
    ("experts the config does not have", lambda t: t, {**DS_CONFIG, "n_routed_experts": 8}, ValueError,
     "state_dict: tensor .*gate.weight' has E = 4 rows, but config says 8"),
    ("an unknown model type", lambda t: t, {**DS_CONFIG, "model_type": "llama"}, ValueError,
     "config: model_type 'llama' is not an MoE family"),
]


@pytest.mark.parametrize("name,edit,config,exc,match", BAD_STATE_DICTS, ids=[c[0] for c in BAD_STATE_DICTS])
def test_from_state_dict_refuses(name, edit, config, exc, match):
    with pytest.raises(exc, match=match):
        onegemm.MoEFFN.from_state_dict(edit(_deepseek_file()), config, prefix="model.layers.3.mlp.")


def test_from_state_dict_keeps_the_tensors_in_place(device):
    """A config.json dict gives the family's routing; fused experts in MoEFFN's layout are not copied."""
    t = {k.removeprefix("model.layers.3.mlp."): v.to(device) for k, v in _deepseek_file().items()}
    t = {k: v for k, v in t.items() if not k.startswith("experts.")}
    t["experts.gate_up_proj"], t["experts.down_proj"] = torch.randn(4, 16, 16, device=device), torch.randn(
        4, 16, 8, device=device)
    layer = onegemm.MoEFFN.from_state_dict(t, DS_CONFIG)
    assert layer.routing == dict(scoring="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5)
    assert layer.w_gate_up.data_ptr() == t["experts.gate_up_proj"].data_ptr() and layer.w_gate_up.device == t[
        "gate.weight"].device


def test_from_pretrained_fp8_experts(tmp_path, device):
    """A DeepSeek-V3 FP8 folder: e4m3 experts with weight_scale_inv stay FP8 (moe_ffn's format)."""
    t = _deepseek_file()
    for k in [k for k in t if ".experts." in k]:
        q, s = onegemm.quantize_fp8(t[k].to(device), (128, 128))
        t[k], t[k.replace(".weight", ".weight_scale_inv")] = q.cpu(), s.cpu()
    config = {**DS_CONFIG, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                   "weight_block_size": [128, 128]}}
    layer = onegemm.MoEFFN.from_pretrained(_folder(tmp_path, config, t), layer=3, device=device)
    assert layer.w_gate_up.dtype == torch.float8_e4m3fn and not layer.w_gate_up.requires_grad
    assert torch.equal(layer.w_gate_up[2, 8:].cpu().view(torch.uint8), t[P + "experts.2.up_proj.weight"].view(torch.uint8))
    assert torch.equal(layer.w_down_scale[1].cpu(), t[P + "experts.1.down_proj.weight_scale_inv"])
    assert layer.w_gate_up_scale.shape == (4, 2, 1)
    bad = {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="only FP8 with 128x128 weight blocks"):
        onegemm.MoEFFN.from_pretrained(tmp_path, layer=3)
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="and gpt-oss's MXFP4 experts are read"):  # MXFP4 is gpt-oss's alone
        onegemm.MoEFFN.from_pretrained(tmp_path, layer=3)


# Each of the kernel's branches once (scoring, bias, groups with and without it, renormalisation).
FUSED_ROUTES = [r for r in ROUTES if r.id in ("softmax-renormalised-mixtral", "sigmoid-groups-bias-deepseek-v3",
                                              "sigmoid-groups-no-bias", "topk-softmax-gpt-oss", "topk-sigmoid-llama4")]


@pytest.mark.parametrize("options,E,k", FUSED_ROUTES)
def test_route_fused_kernel_matches_reference(options, E, k, device, monkeypatch):
    """The fused decode kernel (what route() runs on a GPU for small T): the same ids, weights."""
    from onegemm.grouped import routing

    monkeypatch.setattr(routing, "use_fused", lambda logits, n_group: True)
    options = dict(options)
    renormalize = options.pop("renormalize", True)
    if options.pop("bias", False):
        options["correction_bias"] = torch.randn(E, device=device) * 0.1
    logits = torch.randn(3, E + 3, device=device)[:, 1:E + 1] * 2  # three programs, a strided view
    w, ids = onegemm.route(logits, k, renormalize, **options)
    w_ref, ids_ref = route_ref(logits, k, renormalize, **options)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    assert_close(w, w_ref, 1e-6)


@pytest.mark.parametrize("logits,options,k,want", TIES)
def test_route_fused_kernel_ties(logits, options, k, want, device, monkeypatch):
    from onegemm.grouped import routing

    monkeypatch.setattr(routing, "use_fused", lambda logits, n_group: True)
    options = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in options.items()}
    _, ids = onegemm.route(torch.tensor(logits, device=device), k, **options)
    assert ids.tolist() == want


# Every routing branch at 9 tokens in fp32; one token; FP8 experts with DeepSeek-V3's routing.
ROUTED_LAYERS = ([pytest.param(*r.values, 9, "fp32", id=f"{r.id}-T9") for r in FUSED_ROUTES]
                 + [pytest.param(*r.values, T, experts, id=f"{r.id}-T{T}-{experts}") for r in FUSED_ROUTES
                    for T, experts, name in ((1, "fp32", "softmax-renormalised-mixtral"),
                                             (5, "fp8", "sigmoid-groups-bias-deepseek-v3")) if r.id == name])


@pytest.mark.parametrize("options,E,k,T,experts", ROUTED_LAYERS)
def test_moeffn_routes_in_the_prep(options, E, k, T, experts, device, monkeypatch):
    """MoEFFN's inference forward at decode sizes routes inside moe_ffn's prep launch (the
    router GEMM, then prep, GEMM1, GEMM2: no launch of its own), choosing the experts
    route_ref chooses on the layer's logits; the same layer with the routing first agrees."""
    from onegemm.core.launch import clear_plans
    from onegemm.grouped import moe

    options = dict(options)
    renormalize = options.pop("renormalize", True)
    if options.pop("bias", False):
        options["correction_bias"] = torch.randn(E, device=device) * 0.1
    H, I = (256, 128) if experts == "fp8" else (48, 40)
    gate = torch.randn(E, H, device=device) * H**-0.5
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    if experts == "fp8":
        q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
        layer = onegemm.MoEFFN(gate, q13, q2, w_gate_up_scale=s13, w_down_scale=s2, top_k=k, renormalize=renormalize,
                               **options)
    else:
        layer = onegemm.MoEFFN(gate, w13, w2, top_k=k, renormalize=renormalize, **options)
    x = torch.randn(T, H, device=device)
    with torch.inference_mode():
        layer(x)  # the records
        out = []
        families = [kernel["family"] for kernel in launched(lambda: out.append(layer(x)))]
        logits = layer.router_logits(x)
        monkeypatch.setattr(moe, "routes_in_prep", lambda *args: False)
        clear_plans()  # and the records made under the rule
        routed_first = []
        assert "route" in [kernel["family"] for kernel in launched(lambda: routed_first.append(layer(x)))] or not x.is_cuda
    clear_plans()
    options.pop("correction_bias", None)
    weights, ids = route_ref(logits, k, renormalize, correction_bias=layer.correction_bias, **options)
    assert "route" not in families and families.count("sort") == 1 and len(families) == 4, families
    if experts == "fp8":
        assert_moe_fp8_close(out[0], x, q13, q2, weights.float(), ids, s13, s2)
    else:
        assert_close(out[0], moe_ref(x, w13, w2, weights, ids), 1e-5)
    assert_close(out[0], routed_first[0], 1e-5)


def test_fused_fp8_experts_load_as_the_per_expert_file(tmp_path, device):
    """transformers' fused FP8 layout (experts.gate_up_proj with its scale_inv twin, I a multiple of 128)
    loads the same layer as the per-expert names with weight_scale_inv."""
    E, H, I = 2, 16, 128
    w13, s13, w2, s2 = onegemm.quantize_experts(torch.randn(E, 2 * I, H, device=device) * 0.1,
                                                torch.randn(E, H, I, device=device) * 0.1)
    w13, s13, w2, s2 = (t.cpu() for t in (w13, s13, w2, s2))
    gate = torch.randn(E, H)
    fused = {"gate.weight": gate, "experts.gate_up_proj": w13, "experts.gate_up_proj_scale_inv": s13,
             "experts.down_proj": w2, "experts.down_proj_scale_inv": s2}
    per = {"gate.weight": gate}
    for e in range(E):
        for name, w, s in (("gate_proj", w13[e, :I], s13[e, :1]), ("up_proj", w13[e, I:], s13[e, 1:]),
                           ("down_proj", w2[e], s2[e])):
            per[f"experts.{e}.{name}.weight"], per[f"experts.{e}.{name}.weight_scale_inv"] = w.clone(), s.clone()
    layers = []
    for name, t in (("fused", fused), ("per_expert", per)):
        save_file(t, str(tmp_path / f"{name}.safetensors"))
        layers.append(onegemm.MoEFFN.from_safetensors(tmp_path / f"{name}.safetensors", device=device))
    for (n, p), (_, q) in zip(layers[0].state_dict().items(), layers[1].state_dict().items()):
        assert p.dtype == q.dtype and torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                                                  q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q), n
    assert layers[0].w_gate_up.dtype == torch.float8_e4m3fn and layers[0].w_gate_up_scale.shape == (E, 2, 1)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2"])
def test_from_pretrained_deepseek_family(model_type, tmp_path, device):
    folder = _folder(tmp_path, {**DS_CONFIG, "model_type": model_type}, _deepseek_file())
    layer = onegemm.MoEFFN.from_pretrained(folder, layer=3, device=device)
    assert layer.routing["scoring"] == "sigmoid" and layer.correction_bias is not None


def test_from_pretrained_multimodal_llama4(tmp_path, device):
    """Llama-4's released checkpoints: model_type llama4, the text model's config nested, its
    layers under language_model.model."""
    E, H, I = 4, 16, 8
    p = "language_model.model.layers.1.feed_forward."
    t = {p + "router.weight": torch.randn(E, H), p + "experts.gate_up_proj": torch.randn(E, H, 2 * I),
         p + "experts.down_proj": torch.randn(E, I, H), "vision_model.model.layers.1.mlp.fc1.weight": torch.randn(4, 4)}
    for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        t[f"{p}shared_expert.{name}.weight"] = torch.randn(*shape)
    config = dict(model_type="llama4", text_config=dict(model_type="llama4_text", num_hidden_layers=2,
                  num_local_experts=E, num_experts_per_tok=1, intermediate_size=I, interleave_moe_layer_step=2))
    folder = _folder(tmp_path, config, t)
    layer = onegemm.MoEFFN.from_pretrained(folder, layer=1, device=device)
    assert layer.weights_on_input and layer.routing["scoring"] == "topk_sigmoid" and layer.top_k == 1
    assert torch.equal(layer.w_gate_up.cpu(), t[p + "experts.gate_up_proj"].transpose(1, 2))
    assert torch.equal(layer.w_down.cpu(), t[p + "experts.down_proj"].transpose(1, 2))
    with pytest.raises(ValueError, match="layer 0 of this llama4_text model is a dense MLP"):
        onegemm.MoEFFN.from_pretrained(folder, layer=0)


@pytest.mark.gpu
def test_gpu_deepseek_layer_cuda_graph_and_compile(device, monkeypatch):
    """A DeepSeek-V3-style layer (groups, bias, shared experts; at T = 64 its routing is the
    fused kernel) is captured in a CUDA graph and replayed on new tokens (the eager result's
    bits), and compiled with fullgraph=True (routing by the torch ops; Inductor's fused
    elementwise roundings within bf16's tolerance)."""
    E, H, I, S = 16, 256, 128, 256
    gate = torch.randn(E, H, device=device).to(torch.bfloat16) * H**-0.5
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16)
    s13 = (torch.randn(2 * S, H, device=device) * H**-0.5).to(torch.bfloat16)
    s2 = (torch.randn(H, S, device=device) * S**-0.5).to(torch.bfloat16)
    layer = onegemm.MoEFFN(gate, w13, w2, top_k=4, scoring="sigmoid", correction_bias=torch.randn(E, device=device) * 0.1,
                           n_group=4, topk_group=2, routed_scaling_factor=2.5, shared_w_gate_up=s13, shared_w_down=s2)
    x = torch.randn(64, H, device=device).to(torch.bfloat16)
    with torch.inference_mode():
        graph, y = capture(lambda: layer(x))
        x.copy_(torch.randn_like(x))
        want = layer(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want)
        compiled = torch.compile(layer, fullgraph=True)(x)
        from onegemm.grouped import routing

        monkeypatch.setattr(routing, "use_fused", lambda logits, n_group: False)  # what the trace runs
        # Inductor fuses the shared expert's and the combine's elementwise bf16 ops: their
        # roundings, not the routing, may differ from eager's
        assert_close(compiled, layer(x).double(), 1e-2)


# ---- warmup: every compiled variant before the first call ----


@pytest.mark.parametrize("max_tokens,k", [(1, 1), (40, 2), (300, 8), (300, 6), (20000, 3), (70000, 8)])
def test_token_counts_meet_every_variant(max_tokens, k):
    """Each count from 1 to max_tokens shares the buckets and Triton's int classes of t and of
    t * k (the pairs, whose bucket picks the grouped body) with one of token_counts' counts,
    which stay within max_tokens' bucket."""
    from onegemm.core.configs import m_bucket, token_counts
    from onegemm.core.triton_abi import int_class

    def variant(t):
        return m_bucket(t), int_class(t), m_bucket(t * k), int_class(t * k)

    counts = token_counts(max_tokens, (1, k))
    met = {variant(t) for t in counts}
    assert max(counts) <= max(m_bucket(max_tokens), 1) and len(counts) == len(met)
    missing = [t for t in range(1, max_tokens + 1) if variant(t) not in met]
    assert not missing, missing[:10]


def _warmup_layer(fp8, E, H, I, k, dtype, device):
    """A random MoEFFN with 16/32-bit experts in ``dtype``, or FP8 ones (router in ``dtype``)."""
    torch.manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, device=device) / 10, torch.randn(E, H, I, device=device) / 10
    gate = torch.randn(E, H, device=device).to(dtype)
    if fp8:
        q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
        return onegemm.MoEFFN(gate, q13, q2, top_k=k, w_gate_up_scale=s13, w_down_scale=s2)
    return onegemm.MoEFFN(gate, w13.to(dtype), w2.to(dtype), top_k=k)


def _plan_count():
    from onegemm.core import launch

    return sum(len(launcher._plans) for launcher in launch.launchers())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_moeffn_warmup_leaves_no_plan_to_make(fp8, device):
    """After warmup(max_tokens), a forward at any token count up to max_tokens finds its
    kernels' plans made (none is added). (On the GPU: no compile either, test_gpu_moeffn_warmup.)"""
    H, k = 128, 2
    layer = _warmup_layer(fp8, 4, H, 128, k, torch.float32, device)
    assert layer.warmup(8, threads=3) == onegemm.core.configs.token_counts(8, (1, k))
    before = _plan_count()
    with torch.inference_mode():
        for t in range(1, 9):
            layer(torch.randn(t, H, device=device))
    assert _plan_count() == before
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        layer.warmup(0)
    with pytest.raises(TypeError, match="threads must be an int"):
        layer.warmup(8, threads=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_moeffn_warmup_leaves_nothing_to_compile(fp8, device):
    """After warmup(300), forwards at token counts it did not run miss Triton's in-memory
    kernel cache nowhere (its jit_cache_hook sees every miss, the Gluon body's too)."""
    import triton

    H = 512
    layer = _warmup_layer(fp8, 16, H, 256, 4, torch.bfloat16, device)
    layer.warmup(300)
    misses = []
    hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: misses.append(kw["repr"][:120])
    try:
        with torch.inference_mode():
            for t in (5, 6, 17, 33, 100, 129, 255, 299):
                layer(torch.randn(t, H, device=device, dtype=torch.bfloat16))
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = hook
    assert not misses, misses
