"""FP8 training recipes: Fp8Linear(trainable=True, recipe=...) and fp8_training(recipe=...).

Each recipe's three GEMMs against a float64 emulation of its casts (onegemm.testing's
fp8_linear_train_ref, written from torchao's recipe definitions, not from
blockscaled/recipes.py): the forward, dgrad and wgrad see exactly the quantised operands the
recipe names, so the only differences left are the GEMMs' fp32 sums and the output's rounding.
The same results stand within FP8's error of the unquantised float64 ones; torch.compile gives
eager's bits; gradients arrive only where asked; wrong recipes are refused by name.
"""

import pytest
import torch
from torch import nn

import onegemm
from onegemm.testing import FP8_RECIPES_REF, TOL, assert_close, fp8_linear_train_ref

RECIPES = list(FP8_RECIPES_REF)
# (M tokens, in_features, out_features, dtype, bias): odd sizes, one token, K below one 128 block
SHAPES = [
    pytest.param(37, 200, 136, torch.float32, True, id="37x200x136-fp32"),
    pytest.param(1, 17, 300, torch.float32, False, id="1x17x300-fp32"),
    pytest.param(300, 127, 17, torch.bfloat16, True, id="300x127x17-bf16"),
    pytest.param(130, 256, 65, torch.bfloat16, False, id="130x256x65-bf16"),
]
# The emulation differs from the kernels by fp32 sums (and on the GPU the fp8 MMA's reduced
# precision inside a K block, over all of K where the forward may use fast accumulation).
EXACT_TOL = {torch.float32: 1e-5 if onegemm.INTERPRET else 2e-3, torch.bfloat16: TOL[torch.bfloat16]}
# Against the unquantised float64 result: e4m3 puts ~2^-5 relative error on each operand;
# e5m2's gradient (tensorwise) has one mantissa bit less. With few outputs (1 x 17) the error
# spreads: over 300 draws of SHAPES the largest was 0.081 (e4m3 recipes), 0.117 (tensorwise).
FP8_TOL = {"tensorwise": 1.5e-1}
FP8_TOL_E4M3 = 1e-1


def layer_and_inputs(M, K, N, dtype, bias, recipe, device, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(K, N, bias=bias, device=device, dtype=dtype)
    layer = onegemm.Fp8Linear.from_linear(linear, trainable=True, recipe=recipe)
    x = torch.randn(M, K, device=device, dtype=dtype).requires_grad_()
    return linear, layer, x


@pytest.mark.parametrize("M,K,N,dtype,bias", SHAPES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_its_emulation(recipe, M, K, N, dtype, bias, device):
    """y, dx and dW of a training step equal the float64 GEMMs of the operands the recipe
    quantises (to the GEMMs' rounding), and the unquantised ones within FP8's error."""
    linear, layer, x = layer_and_inputs(M, K, N, dtype, bias, recipe, device)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    want = fp8_linear_train_ref(x, linear.weight, linear.bias, dy, recipe)
    got = (y, x.grad, linear.weight.grad)
    for name, g, w in zip(("y", "dx", "dW"), got, want):
        assert g.dtype == dtype, name
        assert_close(g, w, EXACT_TOL[dtype], f"{recipe} {name} against its emulation")
    w64, x64, dy64 = linear.weight.detach().double(), x.detach().double(), dy.double()
    b64 = linear.bias.detach().double() if bias else 0
    plain = (x64 @ w64.t() + b64, dy64 @ w64, dy64.t() @ x64)
    for name, g, w in zip(("y", "dx", "dW"), got, plain):
        assert_close(g, w, FP8_TOL.get(recipe, FP8_TOL_E4M3), f"{recipe} {name} against float64 of the unquantised operands")
    if bias:
        assert_close(linear.bias.grad, dy64.sum(0), TOL[dtype], "grad of bias")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_differs_from_the_others(recipe, device):
    """Each recipe computes its own numerics (the emulation of another recipe is further off
    than its own): a recipe silently running another's casts fails here."""
    linear, layer, x = layer_and_inputs(130, 256, 48, torch.float32, True, recipe, device, seed=5)
    # rows of x and columns of W over six decades, so per-row, per-block and per-tensor scales differ
    with torch.no_grad():
        x.mul_(torch.logspace(-3, 3, 130, device=device)[torch.randperm(130, device=device)][:, None])
        linear.weight.mul_(torch.logspace(-3, 3, 256, device=device)[None, :])
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    errors = {}
    for other in RECIPES:
        want = fp8_linear_train_ref(x, linear.weight, linear.bias, dy, other)
        errors[other] = [((g.double() - w).norm() / w.norm()).item() for g, w in zip((y, x.grad, linear.weight.grad), want)]
    own = max(errors[recipe])
    assert own <= EXACT_TOL[torch.float32], errors
    for other, errs in errors.items():
        if other != recipe:
            assert max(errs) > 10 * own + 1e-6, (other, errors)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_forward_without_gradients_is_the_training_forward(recipe, device):
    """Under no_grad a trainable layer computes y with its recipe's casts: the same bits as
    the training forward (which also keeps the backward's copies)."""
    _, layer, x = layer_and_inputs(37, 200, 136, torch.float32, True, recipe, device)
    y = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), y.detach())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("x_grad,w_grad", [(True, False), (False, True)], ids=["dx-only", "dW-only"])
def test_recipe_gradients_only_where_asked(recipe, x_grad, w_grad, device):
    linear, layer, x = layer_and_inputs(37, 200, 136, torch.float32, True, recipe, device)
    x.requires_grad_(x_grad)
    linear.weight.requires_grad_(w_grad)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    want = fp8_linear_train_ref(x, linear.weight, linear.bias, dy, recipe)
    assert (x.grad is not None) == x_grad and (linear.weight.grad is not None) == w_grad
    if x_grad:
        assert_close(x.grad, want[1], EXACT_TOL[torch.float32], "dx")
    if w_grad:
        assert_close(linear.weight.grad, want[2], EXACT_TOL[torch.float32], "dW")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_takes_a_strided_output_gradient(recipe, device):
    """The backward's quantisers read dy with its own strides: a transposed view gives the
    gradients of its contiguous copy, bit for bit."""
    linear, layer, x = layer_and_inputs(37, 200, 136, torch.float32, True, recipe, device)
    g = torch.randn(136, 37, device=device).t()
    grads = []
    for dy in (g, g.contiguous()):
        x.grad = linear.weight.grad = None
        layer(x).backward(dy)
        grads.append((x.grad, linear.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_under_torch_compile(recipe, device):
    """A step traced whole by torch.compile (the registered training op and its backward op)
    gives eager's bits."""
    linear, layer, x = layer_and_inputs(37, 200, 136, torch.float32, True, recipe, device)
    dy = torch.randn(37, 136, device=device)

    def step(x):
        return (layer(x) * dy).sum()

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        x.grad = linear.weight.grad = linear.bias.grad = None
        loss = fn(x)
        loss.backward()
        results.append((loss.detach(), x.grad, linear.weight.grad, linear.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fp8_training_takes_a_recipe(device):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).to(device)
    assert onegemm.fp8_training(model, recipe="rowwise") is model
    assert [m.recipe for m in model if isinstance(m, onegemm.Fp8Linear)] == ["rowwise", "rowwise"]
    assert "recipe=rowwise" in repr(model[0])


def test_fp8_training_refuses_moe_layers_with_another_recipe(device):
    """MoE layers train blockwise only: a picked one with another recipe is an error naming
    the recipe and the layer; leaving it out with moe_filter_fn converts the rest."""
    E, H, inter = 4, 128, 128
    moe = onegemm.MoEFFN(nn.Parameter(torch.randn(E, H, device=device)),
                         nn.Parameter(torch.randn(E, 2 * inter, H, device=device)),
                         nn.Parameter(torch.randn(E, H, inter, device=device)), top_k=2)
    model = nn.ModuleDict(dict(proj=nn.Linear(H, H, device=device), experts=moe))
    with pytest.raises(ValueError, match="recipe must be 'blockwise' where MoE layers train in FP8 .*'experts'"):
        onegemm.fp8_training(model, recipe="tensorwise")
    onegemm.fp8_training(model, recipe="tensorwise", moe_filter_fn=lambda m, fqn: False)
    assert model["proj"].recipe == "tensorwise" and not moe.fp8_training


@pytest.mark.parametrize("call,match", [
    (lambda d: onegemm.Fp8Linear(8, 8, trainable=True, recipe="mxfp8", device=d), "recipe must be one of"),
    (lambda d: onegemm.Fp8Linear(8, 8, recipe="rowwise", device=d), "recipe must be 'blockwise' for a frozen layer"),
    (lambda d: onegemm.Fp8Linear.from_linear(nn.Linear(8, 8, device=d), recipe="tensorwise"),
     "recipe must be 'blockwise' for a frozen layer"),
    (lambda d: onegemm.fp8_training(nn.Linear(8, 8, device=d), recipe="ROWWISE"), "recipe must be one of"),
], ids=["unknown", "frozen", "frozen-from-linear", "fp8_training-unknown"])
def test_bad_recipe(call, match, device):
    with pytest.raises(ValueError, match=match):
        call(device)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("M,K,N", [(4096, 1024, 2048), (1040, 272, 300)], ids=str)
def test_gpu_recipe_llm_sized(recipe, M, K, N, device):
    """LLM-sized steps (the Gluon body where it takes them) against the recipe's emulation,
    bf16 as training runs."""
    linear, layer, x = layer_and_inputs(M, K, N, torch.bfloat16, True, recipe, device)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    want = fp8_linear_train_ref(x, linear.weight, linear.bias, dy, recipe)
    for name, g, w in zip(("y", "dx", "dW"), (y, x.grad, linear.weight.grad), want):
        assert_close(g, w, TOL[torch.bfloat16], f"{recipe} {name}")
