"""Gradients of every differentiable op against float64 torch, torch.compile(fullgraph=True)
against eager, torch.library.opcheck of the registered ops, and the errors that stand where a
gradient cannot be given.

On the CPU, torch.compile uses the "aot_eager" backend (AOTAutograd traces the registered ops
and their backward; the interpreter runs the kernels); on the H200 also "inductor".
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import onegemm
from onegemm.grouped import configs as grouped_configs
from onegemm.testing import (
    TOL,
    assert_close,
    dequantize_ref,
    grouped_mm_ref,
    matmul_ref,
    moe_ref,
    ref_grads,
)

from helpers import make

BACKENDS = ["aot_eager"] if onegemm.INTERPRET else ["aot_eager", "inductor"]
# Gradients pass two roundings (the output gradient's cast, then the GEMM's output): twice
# the forward's bound.
GRAD_TOL = {dtype: 2 * tol for dtype, tol in TOL.items()}


def leaf(t):
    return t.detach().clone().requires_grad_()


def check_grads(got, want, dtype, names):
    for name, g, w in zip(names, got, want):
        if w is None:
            continue
        assert g is not None, f"{name}: no gradient"
        assert g.dtype == dtype or name in ("topk_weights",), f"{name}: gradient dtype {g.dtype}"
        assert_close(g, w, GRAD_TOL[dtype], f"grad of {name}")


# ---- dense: matmul, persistent_matmul, linear ----

# (op, M, N, K, dtype, activation, bias, layout of a, layout of b)
DENSE_CASES = [
    ("matmul", 17, 33, 65, torch.float32, None, True, "contig", "contig"),
    ("matmul", 1, 300, 127, torch.float32, "gelu", True, "transposed", "contig"),
    ("matmul", 127, 1, 17, torch.bfloat16, "silu", False, "sliced", "transposed"),
    ("persistent", 40, 70, 96, torch.float32, "relu", True, "contig", "transposed"),
    ("linear", 30, 20, 50, torch.bfloat16, "gelu_tanh", True, "contig", "contig"),
]


def _dense(op, a, b, bias, activation):
    if op == "matmul":
        return onegemm.matmul(a, b, bias=bias, activation=activation)
    if op == "persistent":
        return onegemm.persistent_matmul(a, b, bias=bias, activation=activation, num_programs=3)
    return onegemm.linear(a, b.t(), bias, activation=activation)


@pytest.mark.parametrize("op,M,N,K,dtype,activation,with_bias,layout_a,layout_b", DENSE_CASES)
def test_dense_gradients(op, M, N, K, dtype, activation, with_bias, layout_a, layout_b, device):
    a = leaf(make((M, K), dtype, device, layout_a))
    b = leaf(make((K, N), dtype, device, layout_b))
    bias = leaf(torch.randn(N, device=device).to(dtype)) if with_bias else None
    out = _dense(op, a, b, bias, activation)
    assert out.requires_grad and out.dtype == dtype
    assert_close(out, matmul_ref(a, b, bias, activation), TOL[dtype])
    grad = torch.randn_like(out)
    out.backward(grad)
    want = ref_grads(lambda a, b, bias: matmul_ref(a, b, bias, activation), [a, b, bias], grad)
    check_grads([a.grad, b.grad, None if bias is None else bias.grad], want, dtype, ["a", "b", "bias"])


def test_dense_gradient_of_one_input_only(device):
    """Only the inputs that require grad get one; the others are not computed."""
    a = leaf(make((20, 30), torch.float32, device))
    b = make((30, 10), torch.float32, device)
    onegemm.matmul(a, b).sum().backward()
    assert b.grad is None
    want = ref_grads(lambda a, b: matmul_ref(a, b), [a, b], torch.ones(20, 10, device=device))[0]
    assert_close(a.grad, want, GRAD_TOL[torch.float32])


# Weights are passed transposed (nn.Linear's W as b = W.t(), experts as W.transpose(1, 2)):
# their gradients must arrive in the leaf's own layout, or autograd adds a transposing copy
# of the whole weight to every backward. (name, leaves, call)
LAYOUT_CASES = [
    ("linear", lambda d: [torch.randn(9, 32, device=d), torch.randn(48, 32, device=d)],
     lambda x, w: onegemm.linear(x, w)),
    ("matmul b=W.t()", lambda d: [torch.randn(9, 32, device=d), torch.randn(48, 32, device=d)],
     lambda x, w: onegemm.matmul(x, w.t())),
    ("matmul a=X.t()", lambda d: [torch.randn(32, 9, device=d), torch.randn(32, 48, device=d)],
     lambda x, w: onegemm.matmul(x.t(), w)),
    ("2Dx3D b=W.transpose", lambda d: [torch.randn(20, 32, device=d), torch.randn(3, 48, 32, device=d)],
     lambda x, w: onegemm.grouped_matmul(x, w.transpose(1, 2), torch.tensor([7, 7, 20], dtype=torch.int32, device=x.device))),
    ("3Dx3D b=W.transpose", lambda d: [torch.randn(3, 9, 32, device=d), torch.randn(3, 48, 32, device=d)],
     lambda x, w: onegemm.grouped_matmul(x, w.transpose(1, 2))),
    ("2Dx2D b=W.t()", lambda d: [torch.randn(9, 20, device=d), torch.randn(48, 20, device=d)],
     lambda x, w: onegemm.grouped_matmul(x, w.t(), torch.tensor([5, 5, 20], dtype=torch.int32, device=x.device))),
]


@pytest.mark.parametrize("name,leaves,call", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_gradients_arrive_in_the_inputs_layout(name, leaves, call, device):
    inputs = [leaf(t) for t in leaves(device)]
    arrived = {}
    for i, t in enumerate(inputs):
        t.register_hook(lambda g, i=i: arrived.__setitem__(i, g.stride()))
    out = call(*inputs)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = ref_grads(lambda *t: _ref_of(name, *t), inputs, grad)
    for i, t in enumerate(inputs):
        assert arrived[i] == t.stride(), f"input {i}: gradient strides {arrived[i]}, the input's {t.stride()}"
        assert_close(t.grad, want[i], GRAD_TOL[torch.float32], f"grad of input {i}")


def _ref_of(name, x, w):
    """The float64 reference of a LAYOUT_CASES call (the same call with torch's ops)."""
    if name in ("linear", "matmul b=W.t()"):
        return x @ w.t()
    if name == "matmul a=X.t()":
        return x.t() @ w
    offs = {"2Dx3D b=W.transpose": [7, 7, 20], "2Dx2D b=W.t()": [5, 5, 20]}.get(name)
    b = w.transpose(-2, -1)
    return grouped_mm_ref(x, b, None if offs is None else torch.tensor(offs, dtype=torch.int32, device=x.device))


# ---- grouped_matmul: each mode's backward is two other modes ----

# (mode, G, M, N, K, group sizes along the ragged dim (with an empty group) and a tail past offs[-1], bias)
GROUPED_CASES = [
    ("2Dx3D", [5, 0, 17], 3, 40, 24, True),
    ("3Dx3D", None, 3, 17, 24, True),
    ("2Dx2D", [30, 0, 17], 3, 20, 24, True),
    ("2Dx2D", [0, 1, 127, 129], 4, 9, 17, True),  # the weight-gradient mode's ragged K: empty, 1, around 128
    ("3Dx2D", [9, 0, 17], 3, 20, 24, True),
]


def _grouped_inputs(mode, sizes, G, M, N, dtype, device):
    offs = None if sizes is None else torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    total = 0 if sizes is None else sum(sizes) + 3  # 3 rows (columns) past offs[-1]
    if mode == "2Dx3D":
        a, b, bias = torch.randn(total, M), torch.randn(G, M, N), torch.randn(G, N)
    elif mode == "3Dx3D":
        a, b, bias = torch.randn(G, M, 24), torch.randn(G, 24, N), torch.randn(G, N)
    elif mode == "2Dx2D":
        a, b, bias = torch.randn(M, total), torch.randn(total, N), torch.randn(G, N)
    else:
        a, b, bias = torch.randn(G, M, 24), torch.randn(24, total), torch.randn(total)
    return [leaf(t.to(device=device, dtype=dtype)) for t in (a, b, bias)] + [offs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode,sizes,G,M,N,with_bias", GROUPED_CASES,
                         ids=[f"{c[0]} sizes {c[1]}" for c in GROUPED_CASES])
def test_grouped_gradients(mode, sizes, G, M, N, with_bias, dtype, device):
    a, b, bias, offs = _grouped_inputs(mode, sizes, G, M, N, dtype, device)
    out = onegemm.grouped_matmul(a, b, offs, bias=bias, activation="silu")
    assert_close(out, grouped_mm_ref(a, b, offs, bias, "silu"), TOL[dtype])
    grad = torch.randn_like(out)
    out.backward(grad)
    want = ref_grads(lambda a, b, bias: grouped_mm_ref(a, b, offs, bias, "silu"), [a, b, bias], grad)
    check_grads([a.grad, b.grad, bias.grad], want, dtype, ["a", "b", "bias"])
    # Deterministic: a second backward pass gives the same bits.
    first = [t.grad.clone() for t in (a, b, bias)]
    for t in (a, b, bias):
        t.grad = None
    onegemm.grouped_matmul(a, b, offs, bias=bias, activation="silu").backward(grad)
    assert all(torch.equal(f, t.grad) for f, t in zip(first, (a, b, bias)))


@pytest.mark.parametrize("mode", ["2Dx3D", "3Dx2D"])
def test_grouped_gradients_without_groups(mode, device):
    """G = 0: the output is all zero (bias or not), so every gradient is zero."""
    offs = torch.zeros(0, dtype=torch.int32, device=device)
    if mode == "2Dx3D":
        a, b, bias = leaf(torch.randn(5, 8, device=device)), leaf(torch.randn(0, 8, 6, device=device)), None
    else:
        a, b, bias = (leaf(torch.randn(0, 5, 8, device=device)), leaf(torch.randn(8, 6, device=device)),
                      leaf(torch.randn(6, device=device)))
    out = onegemm.grouped_matmul(a, b, offs, bias=bias)
    assert not out.abs().sum()
    out.backward(torch.randn_like(out))
    for t in (a, b, bias):
        if t is not None:
            assert t.grad is not None and t.grad.shape == t.shape and not t.grad.abs().sum()


# ---- moe_ffn and MoEFFN ----


def _moe_inputs(T, H, I, E, k, dtype, device, bad_id=True):
    x = torch.randn(T, H, device=device).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(dtype)
    weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
    ids[ids == E - 1] = 0  # expert E-1 gets no token: an empty group
    if bad_id:
        ids[0, 0] = E + 3  # outside [0, E): contributes nothing, and gets no gradient
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("P,I", [(3, 1), (5, 1100), (0, 8)], ids=["I=1", "I=1100 (two chunks)", "no rows"])
def test_swiglu_backward_kernel(P, I, device):
    """moe_ffn's activation backward (one pass: grouped.ops.swiglu_backward) against float64 autograd."""
    from onegemm.grouped.ops import swiglu_backward

    h_pre, dh_u, w = torch.randn(P, 2 * I, device=device), torch.randn(P, I, device=device), torch.rand(P, device=device)
    dh_pre, h_w, dw = swiglu_backward(h_pre, dh_u, w, torch.float32)
    leaf64 = h_pre.double().requires_grad_()
    wl = w.double().requires_grad_()
    h64 = torch.nn.functional.silu(leaf64[:, :I]) * leaf64[:, I:]
    (h64 * wl[:, None] * dh_u.double()).sum().backward()
    assert_close(h_w, h64 * wl[:, None], 1e-6, "w * h (dW2's operand)")
    assert_close(dh_pre, leaf64.grad, 1e-6, "dh_pre")
    assert_close(dw, wl.grad, 1e-6, "dweight")


@pytest.mark.parametrize("T,H,I,E,k,dtype", [(17, 32, 48, 4, 2, torch.float32), (9, 64, 32, 5, 3, torch.bfloat16)])
def test_moe_ffn_gradients(T, H, I, E, k, dtype, device):
    x, w13, w2, weights, ids = _moe_inputs(T, H, I, E, k, dtype, device)
    x, w13, w2, weights = (leaf(t) for t in (x, w13, w2, weights))
    out = onegemm.moe_ffn(x, w13, w2, weights, ids)
    assert_close(out, moe_ref(x, w13, w2, weights, ids), TOL[dtype])
    grad = torch.randn_like(out)
    out.backward(grad)
    want = ref_grads(lambda x, w13, w2, w: moe_ref(x, w13, w2, w, ids), [x, w13, w2, weights], grad)
    # topk_weights is fp32 whatever x's dtype: its gradient's bound is the GEMMs' (x's dtype).
    check_grads([x.grad, w13.grad, w2.grad, weights.grad], want, dtype, ["x", "w_gate_up", "w_down", "topk_weights"])
    first = [t.grad.clone() for t in (x, w13, w2, weights)]
    for t in (x, w13, w2, weights):
        t.grad = None
    onegemm.moe_ffn(x, w13, w2, weights, ids).backward(grad)
    assert all(torch.equal(f, t.grad) for f, t in zip(first, (x, w13, w2, weights)))


def test_moe_layer_router_gets_its_gradient(device):
    """MoEFFN's parameters train: the router's through the routing weights, the experts'."""
    torch.manual_seed(1)
    T, H, I, E, k = 12, 32, 16, 4, 2
    gate = torch.randn(E, H, device=device) * H**-0.5
    w13 = torch.randn(E, 2 * I, H, device=device) * H**-0.5
    w2 = torch.randn(E, H, I, device=device) * I**-0.5
    layer = onegemm.MoEFFN(gate, w13, w2, top_k=k)
    x = torch.randn(T, H, device=device)
    grad = torch.randn(T, H, device=device)
    layer(x).backward(grad)
    _, ids = onegemm.route(x @ gate.t(), k)  # the same expert choice as the layer's

    def ref(gate, w13, w2):
        probs = torch.softmax(x.double() @ gate.t(), dim=-1)
        w = probs.gather(1, ids.long())
        return moe_ref(x, w13, w2, w / w.sum(-1, keepdim=True), ids)

    want = ref_grads(ref, [gate, w13, w2], grad)
    got = [layer.gate_weight.grad, layer.w_gate_up.grad, layer.w_down.grad]
    check_grads(got, want, torch.float32, ["gate_weight", "w_gate_up", "w_down"])


# ---- Fp8Linear: gradients through FP8 GEMMs ----

# FP8 e4m3 keeps 3 mantissa bits: one quantised operand puts ~2^-5 relative error on each
# product, summed over K with random signs; 4e-2 holds the measured 2.5e-2 with margin.
FP8_GRAD_TOL = 4e-2


# (trainable, x requires grad, weight requires grad, bias): each gradient the layer can be asked for
FP8_GRAD_CASES = [
    pytest.param(False, True, False, True, id="frozen"),
    pytest.param(True, True, True, True, id="trainable"),
    pytest.param(True, False, True, True, id="trainable-weight-only"),
    pytest.param(True, True, False, False, id="trainable-frozen-weight-no-bias"),
]


@pytest.mark.parametrize("trainable,x_grad,w_grad,bias", FP8_GRAD_CASES)
def test_fp8_linear_gradients(trainable, x_grad, w_grad, bias, device):
    """Each gradient asked for arrives, within FP8's error of the float64 one of the same
    (dequantised, for a frozen layer) weight; none is made that was not asked for."""
    torch.manual_seed(2)
    linear = nn.Linear(200, 136, bias=bias, device=device)
    linear.weight.requires_grad_(w_grad)
    layer = onegemm.Fp8Linear.from_linear(linear, trainable=trainable)
    x = torch.randn(37, 200, device=device).requires_grad_(x_grad)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    if trainable:
        w = linear.weight.detach()
        assert layer.weight.dtype == torch.float32
    else:
        w = dequantize_ref(layer.weight, layer.weight_scale, 128, 128)
    if w_grad:
        assert_close(layer.weight.grad, grad.double().t() @ x.detach().double(), FP8_GRAD_TOL, "grad of weight")
    else:
        assert layer.weight.grad is None
    if x_grad:
        assert_close(x.grad, grad.double() @ w.double(), FP8_GRAD_TOL, "grad of x")
    else:
        assert x.grad is None
    if bias:
        assert_close(layer.bias.grad, grad.double().sum(0), TOL[torch.float32], "grad of bias")


def test_fp8_training_filter_sees_linears_only_as_torchao(device):
    """module_filter_fn is called on the nn.Linear modules only, with their fully qualified
    names (torchao's contract: a filter reading in_features works on any model); the root
    Linear is converted and returned; a Linear subclass is left alone and never asked about."""
    class Scaled(nn.Linear):  # a subclass with its own forward
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(64, 32), nn.Sequential(nn.Linear(32, 48), Scaled(48, 48)), nn.Linear(48, 8))
    model = model.to(device)
    seen = []

    def torchao_filter(m, fqn):  # as torchao's docs write one: every call must be on a Linear
        seen.append((type(m), fqn))
        return m.in_features % 16 == 0 and m.out_features % 16 == 0

    assert onegemm.fp8_training(model, module_filter_fn=torchao_filter) is model
    assert seen == [(nn.Linear, "0"), (nn.Linear, "1.0"), (nn.Linear, "2")]
    assert isinstance(model[0], onegemm.Fp8Linear) and isinstance(model[1][0], onegemm.Fp8Linear)
    assert type(model[1][1]) is Scaled and type(model[2]) is nn.Linear  # 8 output features: kept
    root = nn.Linear(32, 16).to(device)
    converted = onegemm.fp8_training(root)
    assert isinstance(converted, onegemm.Fp8Linear) and converted.weight is root.weight
    with pytest.raises(TypeError, match="moe_filter_fn must be a callable"):
        onegemm.fp8_training(model, moe_filter_fn="all")


def test_fp8_training_swaps_linears(device):
    model = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Sequential(nn.Linear(32, 32)), nn.Linear(32, 8)).to(device)
    onegemm.fp8_training(model, module_filter_fn=lambda m, fqn: fqn != "3")
    assert isinstance(model[0], onegemm.Fp8Linear) and model[0].trainable
    assert isinstance(model[2][0], onegemm.Fp8Linear)
    assert type(model[3]) is nn.Linear  # the filter kept the head
    assert {n for n, _ in model.named_parameters()} == {"0.weight", "0.bias", "2.0.weight", "2.0.bias", "3.weight", "3.bias"}
    x = torch.randn(5, 64, device=device)
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- double backward: create_graph=True against float64 torch ----
#
# torch.autograd.gradgradcheck needs float64 inputs, which no onegemm op takes (its finite
# differences in float32 need loose bounds and cost seconds per op on the interpreter), so
# each op's second-order gradients are compared with float64 torch's double backward of the
# same inputs instead.


def second_order(fn, inputs, u, v):
    """dL2/d(inputs) for L2 = sum_i <v_i, dL1/d(input_i)> and L1 = <u, y> + |y|^2 / 2: the
    first-order gradients are differentiated again, and their incoming gradient u + y depends
    on the inputs too (the loss of issue 31: |dx|^2 + |y|^2 has both kinds of term)."""
    ys = fn(*inputs)
    ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
    first = sum((y * w).sum() + 0.5 * (y * y).sum() for y, w in zip(ys, u))
    grads = torch.autograd.grad(first, inputs, create_graph=True)
    return torch.autograd.grad(sum((g * w).sum() for g, w in zip(grads, v)), inputs)


def _second_order_case(case, device):
    """(onegemm function, its float64 torch reference, the inputs to differentiate)."""
    if case == "matmul":
        a, b, bias = make((17, 9), torch.float32, device), make((9, 5), torch.float32, device, "transposed"), torch.randn(5)
        return (lambda a, b, bias: onegemm.matmul(a, b, bias=bias, activation="gelu"),
                lambda a, b, bias: matmul_ref(a, b, bias, "gelu"), [a, b, bias.to(device)])
    if case == "persistent_matmul":
        return (lambda a, b: onegemm.persistent_matmul(a, b, activation="silu", num_programs=2),
                lambda a, b: matmul_ref(a, b, None, "silu"), [torch.randn(6, 33, device=device), torch.randn(33, 7, device=device)])
    if case == "linear":
        return (lambda x, w, bias: onegemm.linear(x, w, bias, activation="gelu_tanh"),
                lambda x, w, bias: F.gelu(F.linear(x, w, bias), approximate="tanh"),
                [torch.randn(2, 3, 8, device=device), torch.randn(5, 8, device=device), torch.randn(5, device=device)])
    if case in ("2Dx3D", "3Dx3D", "2Dx2D", "3Dx2D"):
        sizes = {"2Dx3D": [5, 0, 7], "3Dx3D": None, "2Dx2D": [6, 0, 5], "3Dx2D": [4, 0, 7]}[case]
        a, b, bias, offs = _grouped_inputs(case, sizes, 3, 8, 6, torch.float32, device)
        return (lambda a, b, bias: onegemm.grouped_matmul(a, b, offs, bias=bias, activation="silu"),
                lambda a, b, bias: grouped_mm_ref(a, b, offs, bias, "silu"), [a.detach(), b.detach(), bias.detach()])
    if case == "list":
        shapes = [(17, 8, 5), (1, 3, 30)]
        ts = [torch.randn(m, k, device=device) for m, k, _ in shapes] + [torch.randn(k, n, device=device) for _, k, n in shapes]
        return (lambda *t: onegemm.grouped_matmul(list(t[:2]), list(t[2:]), activation="silu"),
                lambda *t: [F.silu(a @ b) for a, b in zip(t[:2], t[2:])], ts)
    x, w13, w2, weights, ids = _moe_inputs(5, 8, 4, 3, 2, torch.float32, device)  # "moe_ffn"
    return (lambda *t: onegemm.moe_ffn(*t, ids), lambda *t: moe_ref(*t, ids), [x, w13, w2, weights])


# Every differentiable op with a second derivative. Fp8Linear has none: the test below.
SECOND_ORDER_CASES = [pytest.param(c, id=c) for c in (
    "matmul", "persistent_matmul", "linear", "2Dx3D", "3Dx3D", "2Dx2D", "3Dx2D", "list", "moe_ffn")]


@pytest.mark.parametrize("case", SECOND_ORDER_CASES)
def test_double_backward(case, device):
    fn, ref, inputs = _second_order_case(case, device)
    inputs = [leaf(t) for t in inputs]
    ys = fn(*inputs)
    ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
    u = [torch.randn_like(y) for y in ys]
    v = [torch.randn_like(t) for t in inputs]
    got = second_order(fn, inputs, u, v)
    want = second_order(ref, [leaf(t.double()) for t in inputs], [w.double() for w in u], [w.double() for w in v])
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, GRAD_TOL[torch.float32], f"second-order gradient of input {i}")


@pytest.mark.parametrize("trainable,loss", [
    pytest.param(True, "dx2+y2", id="trainable-|dx|^2+|y|^2"),
    pytest.param(True, "dx2", id="trainable-|dx|^2"),
    pytest.param(False, "dx2+y2", id="frozen-|dx|^2+|y|^2"),
])
def test_fp8_linear_refuses_second_derivatives(trainable, loss, device):
    """Fp8Linear's backward quantises dy and runs FP8 GEMMs: it has no second derivative, so
    differentiating its gradients raises ValueError naming create_graph and Fp8Linear (never
    a loss whose second-order terms are dropped, never torch's "does not require grad")."""
    layer = onegemm.Fp8Linear(128, 16, device=device, trainable=trainable)
    x = leaf(torch.randn(3, 128, device=device))
    y = layer(x)
    first = (y * y).sum() if loss == "dx2+y2" else y.sum()
    gx, = torch.autograd.grad(first, x, create_graph=True)
    second = (gx * gx).sum() + ((y * y).sum() if loss == "dx2+y2" else 0)
    with pytest.raises(ValueError, match="create_graph must be False for gradients through Fp8Linear"):
        second.backward()
    # create_graph=True alone (the gradients not differentiated) gives the usual gradients.
    again = torch.autograd.grad(layer(x).sum(), x, create_graph=True)[0]
    assert_close(again, torch.autograd.grad(layer(x).sum(), x)[0], 0.0)


# ---- list mode: each pair's gradients ----


@pytest.mark.parametrize("shapes,act", [
    pytest.param([(17, 8, 5), (1, 33, 3), (127, 16, 1)], None, id="three-pairs"),
    pytest.param([(0, 4, 6), (5, 0, 3), (9, 7, 2)], "gelu", id="empty-pairs-gelu"),
])
def test_list_mode_gradients(shapes, act, device):
    """grouped_matmul([a_i], [b_i]) differentiates every a_i and b_i (one list-mode call for
    the a's, one for the b's); an input that does not require grad gets none."""
    As = [leaf(make((m, k), torch.float32, device, "transposed" if i == 1 else "contig")) for i, (m, k, _) in enumerate(shapes)]
    Bs = [leaf(torch.randn(k, n, device=device)) for _, k, n in shapes]
    Bs[0].requires_grad_(False)
    ys = onegemm.grouped_matmul(As, Bs, activation=act)
    assert all(y.requires_grad for y in ys)
    grads = [torch.randn_like(y) for y in ys]
    torch.autograd.backward(ys, grads)
    for i, (a, b, g) in enumerate(zip(As, Bs, grads)):
        want = ref_grads(lambda a, b: matmul_ref(a, b, None, act), [a, b], g)
        assert_close(a.grad, want[0], GRAD_TOL[torch.float32], f"grad of a[{i}]")
        if i == 0:
            assert b.grad is None
        else:
            assert_close(b.grad, want[1], GRAD_TOL[torch.float32], f"grad of b[{i}]")


# ---- errors where no gradient can be given ----


def test_errors_instead_of_dropped_gradients(device):
    a = leaf(torch.randn(4, 8, device=device))
    b = torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match="config must be None when gradients are recorded"):
        onegemm.matmul(a, b, config=onegemm.core.configs.MATMUL_INTERPRET)
    q = leaf(torch.randn(4, 8, device=device)).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a must be free of requires_grad for a float8 tensor"):
        onegemm.matmul(q, b.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="x must be free of requires_grad: quantize_fp8 has no gradient"):
        onegemm.quantize_fp8(a)
    qa, sa = onegemm.quantize_fp8(a.detach())
    qb, sb = onegemm.quantize_fp8(b.t().contiguous())
    with pytest.raises(ValueError, match="bias must be free of requires_grad: blockscaled_matmul has no gradient"):
        onegemm.blockscaled_matmul(qa, qb.t(), sa, sb.t(), bias=leaf(torch.zeros(4, device=device)))
    with pytest.raises(ValueError, match="config must be None when gradients are recorded"):
        onegemm.grouped_matmul([a], [b], config=onegemm.core.configs.MATMUL_INTERPRET)
    with pytest.raises(ValueError, match="a\\[1\\] must be free of requires_grad for a float8 tensor"):
        onegemm.grouped_matmul([a.detach(), q], [b, b.to(torch.float8_e4m3fn)])
    with torch.no_grad():
        onegemm.quantize_fp8(a)  # no gradient recorded: fine


# ---- torch.compile(fullgraph=True) equals eager; opcheck ----


def _r(*shape, d):
    return torch.randn(*shape, device=d)


def _dense_args(d):
    return _r(33, 40, d=d), _r(40, 24, d=d), _r(24, d=d)


def _grouped(d):
    a, b, _, offs = _grouped_inputs("2Dx3D", [5, 0, 17], 3, 40, 24, torch.float32, d)
    return a.detach(), b.detach(), offs


def _moe_fp8(d):
    x, w13, w2, weights, ids = _moe_inputs(9, 32, 16, 4, 2, torch.float32, d)
    return (x, *onegemm.quantize_experts(w13, w2), weights, ids)


# (fn, args(device)): each public op as a user calls it.
COMPILE_CASES = [
    pytest.param(lambda a, b, bias: onegemm.matmul(a, b, bias=bias, activation="gelu"), _dense_args, id="matmul"),
    pytest.param(lambda a, b, bias: onegemm.linear(a, b.t(), bias), _dense_args, id="linear"),
    pytest.param(lambda a, b, bias: onegemm.persistent_matmul(a, b), _dense_args, id="persistent_matmul"),
    pytest.param(lambda a, b, offs: onegemm.grouped_matmul(a, b, offs, activation="relu"),
                 _grouped, id="grouped_matmul"),
    # more tokens than the fused decode kernel takes: eager then routes by the same torch ops
    # as the trace (the kernel's rounding differs; tests/test_moe_layers.py compares the two)
    pytest.param(lambda logits: onegemm.route(logits, 2), lambda d: (_r(grouped_configs.ROUTE_MAX_TOKENS + 1, 4, d=d),),
                 id="route"),
    pytest.param(lambda *t: onegemm.moe_ffn(*t), lambda d: _moe_inputs(9, 32, 16, 4, 2, torch.float32, d), id="moe_ffn"),
    pytest.param(lambda a: onegemm.quantize_fp8(a), lambda d: (_r(33, 40, d=d),), id="quantize_fp8"),
    pytest.param(lambda a, b: onegemm.blockscaled_matmul(
        *onegemm.quantize_fp8(a)[:1], b, onegemm.quantize_fp8(a)[1], torch.ones((), device=a.device)),
        lambda d: (_r(33, 40, d=d), _r(40, 24, d=d).to(torch.float8_e4m3fn)), id="blockscaled_matmul"),
    pytest.param(lambda layer, x: layer(x), lambda d: (onegemm.Fp8Linear(64, 40, device=d), _r(10, 64, d=d)), id="Fp8Linear"),
    pytest.param(lambda x, w13, s13, w2, s2, weights, ids: onegemm.moe_ffn(
        x, w13, w2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2), _moe_fp8, id="moe_ffn fp8"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn,args", COMPILE_CASES)
def test_compile_fullgraph_equals_eager(fn, args, backend, device):
    torch._dynamo.reset()
    args = args(device)
    want = fn(*args)
    got = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    for w, g in zip(want if isinstance(want, tuple) else [want], got if isinstance(got, tuple) else [got]):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g.float(), w.float()) or (backend == "inductor" and torch.allclose(g.float(), w.float()))


def _no_grad_moe_fp8(d):
    x, w13, s13, w2, s2, weights, ids = _moe_fp8(d)
    return (lambda x: onegemm.moe_ffn(x, w13, w2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2), x,
            lambda x: torch.ops.onegemm.moe_ffn_fp8(x, w13, w2, weights, ids, s13, s2))


def _no_grad_blockscaled(d):
    (qa, sa), (qb, sb) = onegemm.quantize_fp8(_r(17, 24, d=d)), onegemm.quantize_fp8(_r(9, 24, d=d), (128, 128))
    return (lambda bias: onegemm.blockscaled_matmul(qa, qb.t(), sa, sb.t(), bias=bias), _r(9, d=d),
            lambda bias: torch.ops.onegemm.blockscaled_mm(qa, qb.t(), sa, sb.t(), bias, None, None, None))


def _no_grad_grouped_fp8(d):
    a, b = _r(6, 32, d=d).to(torch.float8_e4m3fn), _r(2, 32, 16, d=d).to(torch.float8_e4m3fn)
    sa, sb, offs = torch.ones(6, 1, device=d), torch.ones(2, 1, 16, device=d), torch.tensor([2, 6], dtype=torch.int32, device=d)
    return (lambda bias: onegemm.grouped_matmul(a, b, offs, bias=bias, scale_a=sa, scale_b=sb), _r(2, 16, d=d),
            lambda bias: torch.ops.onegemm.grouped_mm_fp8(a, b, offs, sa, sb, bias, None, None, None, None))


# (inputs(device) -> (the public call of one tensor, that tensor, the registered op's call), the
# eager error's start): the ops without gradients.
NO_GRAD_CASES = [
    pytest.param(_no_grad_moe_fp8, "x must be free of requires_grad: moe_ffn with fp8 experts has no gradient",
                 id="moe_ffn fp8"),
    pytest.param(_no_grad_blockscaled, "bias must be free of requires_grad: blockscaled_matmul has no gradient",
                 id="blockscaled_matmul"),
    pytest.param(_no_grad_grouped_fp8, "bias must be free of requires_grad: grouped_matmul with scales (fp8) has no "
                 "gradient", id="grouped_matmul fp8"),
]


@pytest.mark.parametrize("inputs,start", NO_GRAD_CASES)
def test_compile_refuses_gradients_like_eager(inputs, start, device):
    """An op without gradients, given a tensor that requires grad: torch.compile, torch.func.grad
    and the registered op itself raise the eager call's ValueError (Dynamo used to trace the op,
    then fail in the backend: "no autograd formula was registered"). The error comes before any
    backend: aot_eager only."""
    torch._dynamo.reset()
    fn, t, op = inputs(device)
    with pytest.raises(ValueError) as eager:
        fn(leaf(t))
    assert str(eager.value).startswith(start), str(eager.value)
    for call in (lambda: torch.compile(fn, backend="aot_eager")(leaf(t)),
                 lambda: torch.func.grad(lambda t: fn(t).float().sum())(t),
                 lambda: op(leaf(t))):
        with pytest.raises(ValueError) as got:
            call()
        assert str(got.value) == str(eager.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_trains_moe_fp8_like_eager(backend, device):
    """moe_ffn(fp8_training=True) traced whole (forward and its FP8 backward): the same bits."""
    torch._dynamo.reset()
    x, w13, w2, weights, ids = _moe_inputs(9, 128, 64, 4, 2, torch.float32, device)
    tensors = [leaf(t) for t in (x, w13, w2, weights)]

    def loss(x, w13, w2, weights):
        return onegemm.moe_ffn(x, w13, w2, weights, ids, fp8_training=True).square().sum()

    eager = torch.autograd.grad(loss(*tensors), tensors)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=backend)(*tensors), tensors)
    for e, c in zip(eager, compiled):
        assert torch.equal(c, e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_trains_like_eager(backend, device):
    """Gradients through the registered ops' backward equal the eager ones."""
    torch._dynamo.reset()
    x, w13, w2, weights, ids = _moe_inputs(9, 32, 16, 4, 2, torch.float32, device)
    a, b, bias = (leaf(torch.randn(*s, device=device)) for s in ((9, 32), (32, 24), (24,)))
    tensors = [leaf(t) for t in (x, w13, w2, weights)] + [a, b, bias]

    def loss(x, w13, w2, weights, a, b, bias):
        y = onegemm.moe_ffn(x, w13, w2, weights, ids)
        return (onegemm.linear(y, b.t(), bias, activation="gelu") * onegemm.matmul(a, b)).sum()

    eager = torch.autograd.grad(loss(*tensors), tensors)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=backend)(*tensors), tensors)
    for e, c in zip(eager, compiled):
        assert_close(c, e, TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_trains_fp8_linear_like_eager(backend, device):
    """A trainable Fp8Linear's gradients (its training forward's fp8 outputs kept for the
    backward) are the eager ones under torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    layer = onegemm.Fp8Linear(64, 40, trainable=True, device=device)
    x = leaf(_r(10, 64, d=device))
    params = [x, layer.weight, layer.bias]
    loss = lambda x: layer(x).square().sum()  # noqa: E731
    eager = torch.autograd.grad(loss(x), params)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend=backend)(x), params)
    for e, c in zip(eager, compiled):
        assert_close(c, e, TOL[torch.float32])


def _opcheck_grouped(d):
    a, b, _, offs = _grouped_inputs("2Dx3D", [5, 0, 7], 3, 16, 8, torch.float32, d)
    return a, b, offs, None, None, None, None, None


def _opcheck_moe(d, grad=True):
    x, w13, w2, weights, ids = _moe_inputs(5, 16, 8, 3, 2, torch.float32, d, bad_id=False)
    return (*(leaf(t) if grad else t for t in (x, w13, w2, weights)), ids)


def _opcheck_blockscaled(d):
    q, s = onegemm.quantize_fp8(_r(17, 24, d=d))
    qw, sw = onegemm.quantize_fp8(_r(9, 24, d=d), (128, 128))
    return q, qw.t(), s, sw.t(), None, torch.bfloat16, None, None  # (a, b, scale_a, scale_b, bias, out_dtype, activation, tma)


def _opcheck_moe_fp8(d):
    x, w13, w2, weights, ids = _opcheck_moe(d, grad=False)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
    return x, q13, q2, weights, ids, s13, s2


def _opcheck_fp8_backward(d):
    """fp8_linear_backward's inputs as the blockwise training forward leaves them: dy [17, 9];
    W.t() in fp8 with its 128x128 scale; x.t() quantised 1x128 along the tokens."""
    _, _, q_wt, s_wt = torch.ops.onegemm.quantize_fp8_transposed(_r(9, 24, d=d), "128x128", torch.float8_e4m3fn, False,
                                                                 False, "onegemm")
    _, _, q_xt, s_xt = torch.ops.onegemm.quantize_fp8_transposed(_r(17, 24, d=d), "1x128", torch.float8_e4m3fn, False,
                                                                 False, "onegemm")
    return _r(17, 9, d=d), q_wt, s_wt, q_xt, s_xt, torch.float32, "blockwise"


# The training forward's registered op of each recipe (blockscaled/recipes.py)
FP8_TRAIN_OPS = [getattr(torch.ops.onegemm, f"fp8_linear_train_{recipe}").default
                 for recipe in ("blockwise", "tensorwise", "rowwise", "rowwise_with_gw_hp")]


def _opcheck_moe_fp8_train(d, grad=True):
    x, w13, w2, weights, ids = _moe_inputs(5, 128, 64, 3, 2, torch.float32, d, bad_id=False)
    return (*(leaf(t) if grad else t for t in (x, w13, w2, weights)), ids)


def _opcheck_moe_fp8_train_backward(d):
    """moe_ffn_fp8_train_backward's inputs as the training forward leaves them."""
    x, w13, w2, weights, ids = _opcheck_moe_fp8_train(d, grad=False)
    _, h_pre, q13_t, s13, q2_t, s2 = torch.ops.onegemm.moe_ffn_fp8_train(x, w13, w2, weights, ids)
    return _r(5, 128, d=d), x, weights, ids, h_pre, q13_t, s13, q2_t, s2, torch.float32, torch.float32


# (op, args(device)): each registered op on small inputs.
OPCHECK_CASES = [
    pytest.param(torch.ops.onegemm.matmul.default,
                 lambda d: (leaf(_r(17, 24, d=d)), leaf(_r(24, 9, d=d)), None, None, None, None, None, None), id="matmul"),
    pytest.param(torch.ops.onegemm.grouped_mm.default, _opcheck_grouped, id="grouped_mm"),
    pytest.param(torch.ops.onegemm.moe_ffn.default, _opcheck_moe, id="moe_ffn"),
    pytest.param(torch.ops.onegemm.moe_ffn_train.default, _opcheck_moe, id="moe_ffn_train"),
    pytest.param(torch.ops.onegemm.moe_ffn_backward.default,
                 lambda d: (_r(5, 16, d=d), *_opcheck_moe(d, grad=False)[:5], None), id="moe_ffn_backward"),
    pytest.param(torch.ops.onegemm.quantize_fp8.default,
                 lambda d: (_r(17, 24, d=d), "1x128", torch.float8_e4m3fn, False, False, "onegemm"), id="quantize_fp8"),
    pytest.param(torch.ops.onegemm.quantize_fp8.default,
                 lambda d: (_r(17, 24, d=d), "row", torch.float8_e4m3fn, True, False, "torchao"), id="quantize_fp8-torchao"),
    pytest.param(torch.ops.onegemm.blockscaled_mm.default, _opcheck_blockscaled, id="blockscaled_mm"),
    pytest.param(torch.ops.onegemm.fp8_linear.default, lambda d: (leaf(_r(17, 24, d=d)), leaf(_r(9, 24, d=d)), None, None),
                 id="fp8_linear"),
    *(pytest.param(op, lambda d: (leaf(_r(17, 24, d=d)), leaf(_r(9, 24, d=d)), leaf(_r(9, d=d)), True),
                   id=op.name().split("::")[1]) for op in FP8_TRAIN_OPS),
    pytest.param(torch.ops.onegemm.fp8_linear_backward.default, _opcheck_fp8_backward, id="fp8_linear_backward"),
    pytest.param(torch.ops.onegemm.quantize_fp8_transposed.default,
                 lambda d: (_r(17, 24, d=d), "1x128", torch.float8_e4m3fn, False, False, "onegemm"),
                 id="quantize_fp8_transposed"),
    pytest.param(torch.ops.onegemm.quantize_fp8_transposed.default,
                 lambda d: (_r(17, 24, d=d), "row", torch.float8_e4m3fn, False, False, "torchao"),
                 id="quantize_fp8_transposed-row"),
    pytest.param(torch.ops.onegemm.moe_ffn_fp8.default, _opcheck_moe_fp8, id="moe_ffn_fp8"),
    pytest.param(torch.ops.onegemm.moe_ffn_fp8_train.default, _opcheck_moe_fp8_train, id="moe_ffn_fp8_train"),
    pytest.param(torch.ops.onegemm.moe_ffn_fp8_train_backward.default, _opcheck_moe_fp8_train_backward,
                 id="moe_ffn_fp8_train_backward"),
]


ALL_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("op,args", OPCHECK_CASES)
def test_opcheck(op, args, device):
    args = args(device)
    utils = ALL_OPCHECKS
    if op in (torch.ops.onegemm.blockscaled_mm.default, torch.ops.onegemm.moe_ffn_fp8.default,
              torch.ops.onegemm.fp8_linear_backward.default, torch.ops.onegemm.moe_ffn_fp8_train_backward.default):
        # test_schema multiplies the inputs to check they are not mutated, and torch has no
        # float8 multiply (CPU or CUDA): the fp8 op is checked on the other three.
        utils = ALL_OPCHECKS[1:]
    if op in (*FP8_TRAIN_OPS, torch.ops.onegemm.moe_ffn_fp8_train.default):
        # test_aot_dispatch_dynamic sums every output into its loss, fp8 ones included, and torch
        # has no float8 sum; test_compile_trains_fp8_linear_like_eager and
        # test_compile_trains_moe_fp8_like_eager trace their autograd instead.
        utils = ALL_OPCHECKS[:3]
    torch.library.opcheck(op, args, test_utils=utils)
