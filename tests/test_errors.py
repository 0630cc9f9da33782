"""Bad input gets a TypeError (wrong type or dtype) or a ValueError (wrong value) whose message
starts with the public argument's name; nothing is computed, nothing is mutated.

Each row: (case, call, exception, fragment of the message). The rows are the defects a probe
of the public API found, and their neighbours.
"""

import pytest
import torch
from safetensors.torch import save_file

import onegemm
from onegemm.grouped import STORED_LAYER
from onegemm.testing import TOL, assert_close, blockscaled_matmul_ref, quantize_fp8_ref


def _f(*shape, device, dtype=torch.float32):
    return torch.randn(*shape, device=device).to(dtype)


def _moe_args(device, E=4, T=6, H=16, I=8, k=2):
    x = _f(T, H, device=device)
    return dict(x=x, w_gate_up=_f(E, 2 * I, H, device=device), w_down=_f(E, H, I, device=device),
                topk_weights=torch.rand(T, k, device=device), topk_ids=torch.randint(0, E, (T, k), device=device))


def _layer(device, **changes):
    E, H, I = 4, 16, 8
    args = dict(gate_weight=_f(E, H, device=device), w_gate_up=_f(E, 2 * I, H, device=device), w_down=_f(E, H, I, device=device))
    args.update(changes)
    return args


BAD = [
    # matmul / linear / persistent_matmul
    ("matmul config as a dict", lambda d: onegemm.matmul(_f(4, 8, device=d), _f(8, 4, device=d), config={"BLOCK_M": 16}),
     TypeError, "config must be a triton.Config"),
    ("matmul tma as a str", lambda d: onegemm.matmul(_f(4, 8, device=d), _f(8, 4, device=d), tma="yes"),
     TypeError, "tma must be None"),
    ("linear dtype mix", lambda d: onegemm.linear(_f(4, 8, device=d), _f(5, 8, device=d, dtype=torch.float16)),
     TypeError, "x and weight must be of the same dtype"),
    ("linear weight 3-D", lambda d: onegemm.linear(_f(4, 8, device=d), _f(2, 5, 8, device=d)), ValueError, "weight must be 2-D"),
    ("linear bias shape", lambda d: onegemm.linear(_f(4, 8, device=d), _f(5, 8, device=d), _f(4, device=d)),
     ValueError, "bias must be of shape"),
    ("linear 0-D x", lambda d: onegemm.linear(torch.tensor(1.0, device=d), _f(5, 8, device=d)), ValueError, "x must be \\[..., K\\]"),
    ("persistent config dict", lambda d: onegemm.persistent_matmul(_f(4, 8, device=d), _f(8, 4, device=d), config={}),
     TypeError, "config must be a triton.Config"),
    ("persistent num_programs str", lambda d: onegemm.persistent_matmul(_f(4, 8, device=d), _f(8, 4, device=d), num_programs="4"),
     TypeError, "num_programs must be an int"),
    # grouped_matmul
    ("grouped offs as a list", lambda d: onegemm.grouped_matmul(_f(6, 8, device=d), _f(2, 8, 4, device=d), [3, 6]),
     TypeError, "offs must be a torch.Tensor"),
    ("grouped bias as a list", lambda d: onegemm.grouped_matmul(_f(2, 3, 8, device=d), _f(2, 8, 4, device=d), bias=[[0.0] * 4] * 2),
     TypeError, "bias must be a torch.Tensor"),
    ("grouped offs int64", lambda d: onegemm.grouped_matmul(_f(6, 8, device=d), _f(2, 8, 4, device=d),
                                                            torch.tensor([3, 6], device=d)), TypeError, "offs must be of dtype"),
    ("grouped 2Dx2D offs 2-D", lambda d: onegemm.grouped_matmul(_f(4, 6, device=d), _f(6, 5, device=d),
                                                                torch.tensor([[3, 6]], dtype=torch.int32, device=d)),
     ValueError, "offs must be 1-D for the reduction"),
    ("grouped config dict", lambda d: onegemm.grouped_matmul(_f(2, 3, 8, device=d), _f(2, 8, 4, device=d), config={}),
     TypeError, "config must be a triton.Config"),
    ("grouped check_offs str", lambda d: onegemm.grouped_matmul(_f(6, 8, device=d), _f(2, 8, 4, device=d),
                                                                torch.tensor([3, 6], dtype=torch.int32, device=d), check_offs="yes"),
     TypeError, "check_offs must be a bool"),
    ("list mode with offs", lambda d: onegemm.grouped_matmul([_f(3, 8, device=d)], [_f(8, 4, device=d)],
                                                             torch.tensor([3], dtype=torch.int32, device=d)),
     ValueError, "offs must be None in list mode"),
    # blockscaled_matmul and quantize_fp8: one convention with matmul (dtype -> TypeError)
    ("blockscaled a not fp8", lambda d: onegemm.blockscaled_matmul(_f(4, 128, device=d), _f(128, 4, device=d, dtype=torch.float8_e4m3fn),
                                                                    torch.ones((), device=d), torch.ones((), device=d)),
     TypeError, "a must be float8"),
    ("blockscaled both e5m2", lambda d: onegemm.blockscaled_matmul(_f(4, 128, device=d, dtype=torch.float8_e5m2),
                                                                    _f(128, 4, device=d, dtype=torch.float8_e5m2),
                                                                    torch.ones((), device=d), torch.ones((), device=d)),
     TypeError, "b must be float8_e4m3fn when a is float8_e5m2"),
    ("blockscaled config dict", lambda d: onegemm.blockscaled_matmul(_f(4, 128, device=d, dtype=torch.float8_e4m3fn),
                                                                      _f(128, 4, device=d, dtype=torch.float8_e4m3fn),
                                                                      torch.ones((), device=d), torch.ones((), device=d), config={}),
     TypeError, "config must be a triton.Config"),
    ("quantize block", lambda d: onegemm.quantize_fp8(_f(4, 128, device=d), (2, 64)), ValueError, "block must be one of"),
    ("quantize check_finite", lambda d: onegemm.quantize_fp8(_f(4, 128, device=d), check_finite=1), TypeError, "check_finite must be a bool"),
    ("quantize pow2_scale", lambda d: onegemm.quantize_fp8(_f(4, 128, device=d), pow2_scale="no"), TypeError, "pow2_scale must be a bool"),
    # MoE
    ("moe_ffn no experts", lambda d: onegemm.moe_ffn(**_moe_args(d, E=1) | dict(w_gate_up=_f(0, 16, 16, device=d),
                                                                                w_down=_f(0, 16, 8, device=d))),
     ValueError, "w_gate_up must be \\[E, 2I, H\\] = \\[E >= 1"),
    ("moe_ffn w_down shape", lambda d: onegemm.moe_ffn(**_moe_args(d) | dict(w_down=_f(4, 16, 9, device=d))),
     ValueError, "w_down must be \\[E, H, I\\]"),
    ("route top_k bool", lambda d: onegemm.route(_f(6, 4, device=d), True), TypeError, "top_k must be an int"),
    ("route top_k too large", lambda d: onegemm.route(_f(6, 4, device=d), 5), ValueError, "top_k must be an int in \\[1, 4\\]"),
    ("route top_k float", lambda d: onegemm.route(_f(6, 4, device=d), 2.0), TypeError, "top_k must be an int"),
    ("MoEFFN top_k str", lambda d: onegemm.MoEFFN(**_layer(d), top_k="2"), TypeError, "top_k must be an int"),
    ("MoEFFN top_k float", lambda d: onegemm.MoEFFN(**_layer(d), top_k=2.5), TypeError, "top_k must be an int"),
    ("MoEFFN w_down shape", lambda d: onegemm.MoEFFN(**_layer(d, w_down=_f(4, 16, 9, device=d))), ValueError, "w_down must be"),
    ("MoEFFN w_gate_up dtype", lambda d: onegemm.MoEFFN(**_layer(d, w_gate_up=_f(4, 16, 16, device=d, dtype=torch.float16))),
     TypeError, "w_gate_up must be of dtype"),
    ("MoEFFN forward hidden size", lambda d: onegemm.MoEFFN(**_layer(d))(_f(3, 15, device=d)),
     ValueError, "x must be \\[T, H\\] with H = 16"),
    # Fp8Linear
    ("Fp8Linear.from_linear not a Linear", lambda d: onegemm.Fp8Linear.from_linear(torch.nn.Conv1d(2, 2, 1)),
     TypeError, "linear must be a torch.nn.Linear"),
    ("Fp8Linear.from_linear NaN weight", lambda d: onegemm.Fp8Linear.from_linear(_nan_linear(d)), ValueError, "linear.weight must be finite"),
    ("Fp8Linear x features", lambda d: onegemm.Fp8Linear(128, 64, device=d)(_f(2, 127, device=d)),
     ValueError, "x must be \\[..., in_features\\]"),
]


def _nan_linear(device):
    lin = torch.nn.Linear(128, 64, device=device)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
    return lin


@pytest.mark.parametrize("case,call,exc,match", BAD, ids=[row[0] for row in BAD])
def test_bad_input(case, call, exc, match, device):
    with pytest.raises(exc, match=match):
        call(device)


# ---- safetensors files that cannot be read: a ValueError naming the file ----


def _truncated(path):
    path.write_bytes(STORED_LAYER.read_bytes()[:5000])


def _float64(path):
    save_file({"gate.weight": torch.randn(4, 8, dtype=torch.float64), "experts.0.w1.weight": torch.randn(4, 8, dtype=torch.float64)},
              str(path))


FILES = [
    ("missing", lambda p: None, "cannot be read"),
    ("empty", lambda p: p.write_bytes(b""), "cannot be read"),
    ("text", lambda p: p.write_text("not a tensor file\n" * 10), "cannot be read"),
    ("truncated", _truncated, "cannot be read"),
    ("directory", lambda p: p.mkdir(), "cannot be read"),
    ("float64 layer", _float64, "has dtype torch.float64, expected one of"),
]


@pytest.mark.parametrize("case,make,match", FILES, ids=[row[0] for row in FILES])
def test_from_safetensors_bad_file(case, make, match, tmp_path, device):
    path = tmp_path / "layer.safetensors"
    make(path)
    with pytest.raises(ValueError, match=match) as err:
        onegemm.MoEFFN.from_safetensors(path, device=device)
    assert str(path) in str(err.value)


# ---- MoEFFN's loaders: a wrong path or device names the argument ----


# A device torch knows but the kernels do not run on: torch's own error would be an
# AssertionError ("Torch not compiled with CUDA enabled") or the layer's check of gate_weight.
WRONG_DEVICE = "cuda" if onegemm.INTERPRET else "cpu"
WHERE_KERNELS_RUN = "'cpu' or None under Triton's interpreter" if onegemm.INTERPRET else "a CUDA device or None"
LOADERS = {
    "from_safetensors": lambda **kw: onegemm.MoEFFN.from_safetensors(kw.pop("path", STORED_LAYER), **kw),
    "from_pretrained": lambda **kw: onegemm.MoEFFN.from_pretrained(kw.pop("path", STORED_LAYER.parent), 0, **kw),
    "from_state_dict": lambda **kw: onegemm.MoEFFN.from_state_dict({}, {}, **kw),
}
LOADER_ARGS = [
    ("from_safetensors", dict(path=None), TypeError, "path must be a str or os.PathLike (the safetensors file), got NoneType"),
    ("from_pretrained", dict(path=None), TypeError, "path must be a str or os.PathLike (the model folder), got NoneType"),
    *((loader, dict(device=WRONG_DEVICE), ValueError, f"device must be {WHERE_KERNELS_RUN}") for loader in LOADERS),
    ("from_safetensors", dict(device="gpu"), ValueError, "device must be a device such as 'cuda', 'cuda:1' or 'cpu', got 'gpu'"),
    ("from_safetensors", dict(device=1.0), TypeError,
     "device must be None, a str, an int (a CUDA ordinal) or a torch.device, got float"),
]


@pytest.mark.parametrize("loader,kwargs,exc,start", LOADER_ARGS,
                         ids=[f"{row[0]}-{'-'.join(f'{k}={v}' for k, v in row[1].items())}" for row in LOADER_ARGS])
def test_moeffn_loaders_name_path_and_device(loader, kwargs, exc, start):
    with pytest.raises(exc) as err:
        LOADERS[loader](**kwargs)
    assert str(err.value).startswith(start), str(err.value)


# ---- Fp8Linear under a module dtype cast ----


@pytest.mark.parametrize("cast", ["half", "bfloat16", "float", "to"])
def test_fp8linear_dtype_cast_keeps_the_fp8_weight(cast, device):
    """.half() / .bfloat16() / .float() / .to(dtype): the fp8 weight and fp32 scales stay as
    they are; the bias (and with it the output) takes the new dtype; forward still works."""
    dtype = {"half": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "to": torch.float16}[cast]
    layer = onegemm.Fp8Linear(256, 192, device=device)
    w, s = layer.weight.clone(), layer.weight_scale.clone()
    layer = layer.to(dtype) if cast == "to" else getattr(layer, cast)()
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight.view(torch.uint8), w.view(torch.uint8))
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, s)
    assert layer.bias.dtype == dtype
    x = torch.randn(5, 256, device=device).to(dtype)
    y = layer(x)
    qx, sx = quantize_fp8_ref(x.float(), (1, 128))
    ref = blockscaled_matmul_ref(qx, w.t(), sx, s.t(), (1, 128), (128, 128)) + layer.bias.double()
    assert y.dtype == dtype
    assert_close(y, ref, TOL[dtype] if dtype != torch.float32 else 1e-3)


# ---- no public op writes to its inputs ----


class _OpInputs:
    """Every public op's inputs, on one device; each is checked after each op's call."""

    def __init__(self, device):
        self.a, self.b, self.bias = _f(33, 40, device=device), _f(40, 20, device=device), _f(20, device=device)
        self.ga, self.gb = _f(9, 16, device=device), _f(3, 16, 8, device=device)
        self.offs = torch.tensor([4, 4, 9], dtype=torch.int32, device=device)
        self.qa, self.sa = quantize_fp8_ref(_f(12, 256, device=device), (1, 128))
        self.qw, self.sw = quantize_fp8_ref(_f(24, 256, device=device), (128, 128))
        self.x = _f(10, 256, device=device)
        self.moe = _moe_args(device)
        self.logits = _f(6, 4, device=device)
        self.lin = torch.nn.Linear(256, 24, device=device)

    def tensors(self):
        named = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        named |= {f"moe {k}": v for k, v in self.moe.items()}
        return named | {f"lin.{k}": v.detach() for k, v in self.lin.named_parameters()}


# Every public op, as called on _OpInputs.
OPS = [
    pytest.param(lambda t: onegemm.matmul(t.a, t.b, bias=t.bias, activation="gelu"), id="matmul"),
    pytest.param(lambda t: onegemm.linear(t.a, t.b.t(), t.bias), id="linear"),
    pytest.param(lambda t: onegemm.persistent_matmul(t.a, t.b, bias=t.bias), id="persistent_matmul"),
    pytest.param(lambda t: onegemm.grouped_matmul(t.ga, t.gb, t.offs), id="grouped_matmul"),
    pytest.param(lambda t: onegemm.grouped_matmul([t.a, t.a], [t.b, t.b]), id="grouped_matmul list"),
    pytest.param(lambda t: onegemm.blockscaled_matmul(t.qa, t.qw.t(), t.sa, t.sw.t()), id="blockscaled_matmul"),
    pytest.param(lambda t: onegemm.quantize_fp8(t.x, (128, 128)), id="quantize_fp8"),
    pytest.param(lambda t: onegemm.route(t.logits, 2), id="route"),
    pytest.param(lambda t: onegemm.moe_ffn(**t.moe), id="moe_ffn"),
    pytest.param(lambda t: onegemm.Fp8Linear.from_linear(t.lin)(t.x), id="Fp8Linear"),
]


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("call", OPS)
def test_inputs_are_not_written(call, device):
    inputs = _OpInputs(device)
    before = {name: t.clone() for name, t in inputs.tensors().items()}
    call(inputs)
    for name, t in inputs.tensors().items():
        assert torch.equal(_bits(t), _bits(before[name])), f"{name} changed"


# ---- a wrong type is a TypeError naming the argument, with gradients or without ----


def _fp8_args(device):
    """Quantised operands: blockscaled (a [4, 128] 1x128, b = W.t() 128x128) and grouped 2D x 3D."""
    qa, sa = quantize_fp8_ref(_f(4, 128, device=device), (1, 128))
    qw, sw = quantize_fp8_ref(_f(16, 128, device=device), (128, 128))
    offs = torch.tensor([1, 4], dtype=torch.int32, device=device)
    return dict(qa=qa, sa=sa, qb=qw.t(), sb=sw.t(), gb=torch.stack([qw.t(), qw.t()]), gsb=sw.t().expand(2, 1, 1).contiguous(),
                offs=offs)


def _moe_fp8_args(device):
    moe = _moe_args(device)
    q13, s13, q2, s2 = onegemm.quantize_experts(moe["w_gate_up"], moe["w_down"])
    return moe | dict(w_gate_up=q13, w_down=q2, w_gate_up_scale=s13, w_down_scale=s2)


def _grad_leaf(*shape, device):
    return _f(*shape, device=device).requires_grad_()


# (case, call, the message's start). The calls hold a tensor that requires grad where the
# path with gradients differs from the one without.
BAD_TYPES = [
    ("grouped scale_a float", lambda d, q: onegemm.grouped_matmul(q["qa"], q["gb"], q["offs"], scale_a=1.0, scale_b=q["gsb"]),
     "scale_a must be a torch.Tensor, got float"),
    ("grouped scale_b list", lambda d, q: onegemm.grouped_matmul(q["qa"], q["gb"], q["offs"], scale_a=q["sa"], scale_b=[1.0]),
     "scale_b must be a torch.Tensor, got list"),
    ("grouped b float", lambda d, q: onegemm.grouped_matmul(_grad_leaf(6, 8, device=d), 2.0, q["offs"]),
     "b must be a torch.Tensor, got float"),
    ("grouped list a[0] float", lambda d, q: onegemm.grouped_matmul([1.0], [_grad_leaf(8, 4, device=d)]),
     "a\\[0\\] must be a torch.Tensor, got float"),
    ("grouped list b[1] None", lambda d, q: onegemm.grouped_matmul([_grad_leaf(3, 8, device=d)] * 2, [_f(8, 4, device=d), None]),
     "b\\[1\\] must be a torch.Tensor, got NoneType"),
    ("blockscaled scale_a float", lambda d, q: onegemm.blockscaled_matmul(q["qa"], q["qb"], 1.0, q["sb"]),
     "scale_a must be a torch.Tensor, got float"),
    ("blockscaled bias list", lambda d, q: onegemm.blockscaled_matmul(q["qa"], q["qb"], q["sa"], q["sb"], bias=[0.0] * 16),
     "bias must be a torch.Tensor, got list"),
    ("moe_ffn fp8 w_down_scale float", lambda d, q: onegemm.moe_ffn(**_moe_fp8_args(d) | dict(w_down_scale=1.0)),
     "w_down_scale must be a torch.Tensor, got float"),
    ("moe_ffn fp8 w_gate_up_scale list", lambda d, q: onegemm.moe_ffn(**_moe_fp8_args(d) | dict(w_gate_up_scale=[1.0])),
     "w_gate_up_scale must be a torch.Tensor, got list"),
    ("moe_ffn fp8 x list", lambda d, q: onegemm.moe_ffn(**_moe_fp8_args(d) | dict(x=[[0.0] * 16] * 6)),
     "x must be a torch.Tensor, got list"),
    ("moe_ffn fp8 topk_weights list", lambda d, q: onegemm.moe_ffn(**_moe_fp8_args(d) | dict(topk_weights=[[0.5, 0.5]] * 6)),
     "topk_weights must be a torch.Tensor, got list"),
    ("moe_ffn w_gate_up None", lambda d, q: onegemm.moe_ffn(**_moe_args(d) | dict(x=_grad_leaf(6, 16, device=d), w_gate_up=None)),
     "w_gate_up must be a torch.Tensor, got NoneType"),
    ("moe_ffn w_gate_up list", lambda d, q: onegemm.moe_ffn(**_moe_args(d) | dict(w_gate_up=[[[0.0]]])),
     "w_gate_up must be a torch.Tensor, got list"),
    ("moe_ffn bf16 experts w_down_scale float", lambda d, q: onegemm.moe_ffn(**_moe_args(d), w_down_scale=1.0),
     "w_down_scale must be a torch.Tensor, got float"),
    ("matmul a list", lambda d, q: onegemm.matmul([[1.0] * 8] * 4, _grad_leaf(8, 4, device=d)), "a must be a torch.Tensor, got list"),
    ("persistent_matmul b float", lambda d, q: onegemm.persistent_matmul(_grad_leaf(4, 8, device=d), 1.0),
     "b must be a torch.Tensor, got float"),
    ("matmul persistent 1.0", lambda d, q: onegemm.matmul(_grad_leaf(4, 8, device=d), _f(8, 4, device=d), persistent=1.0),
     "persistent must be None \\(automatic\\), True or False, got float"),
]


@pytest.mark.parametrize("grad", [pytest.param(True, id="grad"), pytest.param(False, id="no_grad")])
@pytest.mark.parametrize("case,call,match", BAD_TYPES, ids=[row[0] for row in BAD_TYPES])
def test_bad_type_with_and_without_gradients(case, call, match, grad, device):
    q = _fp8_args(device)
    with torch.set_grad_enabled(grad), pytest.raises(TypeError, match=match):
        call(device, q)
