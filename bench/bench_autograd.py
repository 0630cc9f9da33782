"""Training with onegemm's ops on the H200: forward+backward against torch, an FP8-trained MLP
against bf16, and what recording gradients adds to an eager call.

    python bench/bench_autograd.py           # H200: bench/results/autograd.md and fp8_training.png
    python bench/bench_autograd.py --moe-fp8 # H200: the FP8 MoE training part alone (moe_fp8_training.md)
    python bench/bench_autograd.py --mlp-fp8 # H200: the FP8 MLP part alone (fp8_training.md;
                                             # --tokens 8192 --no-block: one batch size, no block)
    python bench/bench_autograd.py --quick   # CPU interpreter: every path once, tiny shapes, no files

Forward+backward is timed in GPU time (the whole step, forward and backward, replayed from a
CUDA graph) with the same output gradient for both sides: linear against F.linear,
grouped_matmul (2D x 3D, MoE shapes) against torch._grouped_mm's autograd, moe_ffn against
the torch MoE built on torch._grouped_mm (onegemm.testing.moe_ffn_torch).

The FP8 MLP (d -> 4d -> d, GELU) learns a fixed random teacher of the same shape on synthetic
inputs (MSE loss, AdamW); onegemm.fp8_training(recipe=...) swaps its two nn.Linear layers for
trainable Fp8Linear ones (forward, dgrad and wgrad in FP8), once per recipe (blockwise, and
torchao's tensorwise, rowwise, rowwise_with_gw_hp), and torchao's convert_to_float8_training
with the same recipe runs beside it. Every model starts from the same weights and sees the same
batches. The step times also cover a Llama-3-8B-shaped block's seven linears (BlockLinears).

FP8 MoE training: moe_ffn(..., fp8_training=True) against bf16 moe_ffn, forward+backward of
the benchmark's expert FFNs in GPU time, and an MoEFFN layer (router included) trained in bf16
and under onegemm.fp8_training to a teacher layer: loss curves and step times.
"""

from __future__ import annotations

import argparse
import copy
import math

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
import torch.nn.functional as F
from common import bench_ms, geomean, header, markdown_table, update_summary, write_results
from onegemm.testing import assert_close, calc_diff, host_us, moe_ffn_torch
from torch import nn

LINEAR_SHAPES = [(4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336), (8192, 4096, 4096), (8192, 14336, 4096)]
# (name, E, H, I, top_k, T): the expert FFNs of Qwen3-30B-A3B and Mixtral-8x7B at prefill.
MOE_SHAPES = [("Qwen3-30B-A3B", 128, 2048, 768, 8, 8192), ("Mixtral-8x7B", 8, 4096, 14336, 2, 4096)]
QUICK = dict(linear=[(64, 48, 32)], moe=[("tiny", 4, 32, 16, 2, 24)], mlp=(64, 6, 64),
             moe_fp8=[("tiny", 4, 128, 64, 2, 24)], moe_layer=(4, 128, 64, 2, 32, 4))
# The trained MoE layer: (E, H, I, top_k, tokens per step, steps).
MOE_LAYER = (32, 1024, 512, 4, 4096, 200)


def fwd_bwd(fn, inputs, grad):
    """One training step's GEMM work: fn(*inputs) and its backward against ``grad``."""
    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return step


def leaf(t):
    return t.detach().clone().requires_grad_()


def measure_linear(shapes, device, timer):
    rows = []
    for M, N, K in shapes:
        x = leaf(torch.randn(M, K, device=device, dtype=torch.bfloat16))
        w = leaf(torch.randn(N, K, device=device, dtype=torch.bfloat16) * K**-0.5)
        b = leaf(torch.randn(N, device=device, dtype=torch.bfloat16))
        grad = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        ours, peer = fwd_bwd(onegemm.linear, (x, w, b), grad), fwd_bwd(F.linear, (x, w, b), grad)
        ours()
        got = [t.grad.clone() for t in (x, w, b)]
        peer()
        for g, t, name in zip(got, (x, w, b), ("x", "weight", "bias")):
            assert_close(g, t.grad, 2e-2, f"linear grad of {name}")
        t1, t2 = timer(ours), timer(peer)
        rows.append(dict(op="linear", shape=f"{M}x{N}x{K}", onegemm_ms=t1, torch_ms=t2, vs_torch=t2 / t1,
                         onegemm_TFLOPs=3 * 2 * M * N * K / (t1 * 1e-3) / 1e12))
        print(rows[-1], flush=True)
    return rows


def moe_inputs(E, H, I, k, T, device):
    x = leaf(torch.randn(T, H, device=device, dtype=torch.bfloat16))
    w13 = leaf((torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(torch.bfloat16))
    w2 = leaf((torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16))
    weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
    return x, w13, w2, leaf(weights), ids


def measure_moe(shapes, device, timer):
    rows = []
    for name, E, H, I, k, T in shapes:
        x, w13, w2, weights, ids = moe_inputs(E, H, I, k, T, device)
        grad = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        ours = fwd_bwd(lambda *t: onegemm.moe_ffn(*t, ids), (x, w13, w2, weights), grad)
        peer = fwd_bwd(lambda *t: moe_ffn_torch(*t, ids, use_grouped_mm=device == "cuda"), (x, w13, w2, weights), grad)
        ours()
        got = [t.grad.clone() for t in (x, w13, w2, weights)]
        peer()
        for g, t, what in zip(got, (x, w13, w2, weights), ("x", "w_gate_up", "w_down", "topk_weights")):
            assert_close(g, t.grad, 3e-2, f"moe_ffn grad of {what}")
        t1, t2 = timer(ours), timer(peer)
        rows.append(dict(op="moe_ffn", shape=f"{name} T={T}", onegemm_ms=t1, torch_ms=t2, vs_torch=t2 / t1))
        print(rows[-1], flush=True)
        # The two expert GEMMs alone: grouped_matmul against torch._grouped_mm, each with autograd.
        P = T * k
        offs = (torch.arange(1, E + 1, device=device) * (P // E)).to(torch.int32)
        a = leaf(torch.randn(P, H, device=device, dtype=torch.bfloat16))
        g = torch.randn(P, 2 * I, device=device, dtype=torch.bfloat16)
        ours = fwd_bwd(lambda a, w: onegemm.grouped_matmul(a, w.transpose(1, 2), offs), (a, w13), g)
        if device == "cuda":
            peer = fwd_bwd(lambda a, w: torch._grouped_mm(a, w.transpose(1, 2), offs=offs), (a, w13), g)
            t1, t2 = timer(ours), timer(peer)
        else:
            ours()
            t1 = t2 = math.nan
        rows.append(dict(op="grouped_matmul 2Dx3D", shape=f"{name} GEMM1 [{P}, {H}] x [{E}, {H}, {2 * I}]",
                         onegemm_ms=t1, torch_ms=t2, vs_torch=t2 / t1))
        print(rows[-1], flush=True)
    return rows


def train(model, steps, batch, d, teacher, device, seed):
    """AdamW on MSE against ``teacher``; returns (losses, median step ms over the second half)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(seed)
    losses, times = [], []
    for step in range(steps):
        x = torch.randn(batch, d, device=device, dtype=torch.bfloat16, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        loss = F.mse_loss(model(x).float(), y.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        losses.append(loss.item())
    half = sorted(times[len(times) // 2:])
    return losses, (half[len(half) // 2] if half else math.nan)


def mlp(d, device):
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).to(device, torch.bfloat16)


class BlockLinears(nn.Module):
    """A Llama-3-8B-shaped transformer block's seven linears, no bias (q, k, v, o: d -> d,
    d/4, d/4, d; the SwiGLU MLP d -> 3.5d -> d): attention stands in as q plus k and v
    repeated over the 4 query heads per key head (GQA), so every linear keeps its shape and
    its gradient."""

    def __init__(self, d):
        super().__init__()
        kv, hidden = d // 4, 7 * d // 2
        self.q, self.k, self.v, self.o = (nn.Linear(d, n, bias=False) for n in (d, kv, kv, d))
        self.gate, self.up, self.down = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False), \
            nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        x = x + self.o(self.q(x) + (self.k(x) + self.v(x)).repeat(1, 4))
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


def block(d, device):
    return BlockLinears(d).to(device, torch.bfloat16)


RECIPES = ("blockwise", "tensorwise", "rowwise", "rowwise_with_gw_hp")


def measure_fp8_training(d, steps, batch, device):
    """bf16 against onegemm.fp8_training with each recipe over ``steps`` steps: (rows of final
    losses and step times, bf16 losses, {recipe: fp8 losses})."""
    torch.manual_seed(0)
    teacher, base = mlp(d, device), mlp(d, device)
    bf16_losses, bf16_ms = train(copy.deepcopy(base), steps, batch, d, teacher, device, seed=1)
    rows, curves = [], {}
    for recipe in RECIPES:
        fp8 = onegemm.fp8_training(copy.deepcopy(base), recipe=recipe)
        row, curves[recipe] = against_bf16(f"MLP {d}->{4 * d}->{d}, batch {batch}, {recipe}", fp8, bf16_losses,
                                           bf16_ms, steps, batch, d, teacher, device)
        rows.append(row)
    return rows, bf16_losses, curves


def against_bf16(model_name, fp8, bf16_losses, bf16_ms, steps, batch, d, teacher, device, seed=1):
    """``fp8`` trained to ``teacher`` on the batches bf16 saw: (row of final losses and step
    times against bf16's, fp8 losses)."""
    fp8_losses, fp8_ms = train(fp8, steps, batch, d, teacher, device, seed=seed)
    tail = max(1, steps // 10)
    final_bf16, final_fp8 = sum(bf16_losses[-tail:]) / tail, sum(fp8_losses[-tail:]) / tail
    row = dict(model=model_name, steps=steps, bf16_final_loss=final_bf16, fp8_final_loss=final_fp8,
               fp8_vs_bf16_loss=final_fp8 / final_bf16, bf16_step_ms=bf16_ms, fp8_step_ms=fp8_ms,
               fp8_speedup=bf16_ms / fp8_ms)
    print(row, flush=True)
    return row, fp8_losses


def bf16_against_fp8(model_name, teacher, bf16, steps, batch, d, device, seed=1):
    """``bf16`` and its onegemm.fp8_training copy trained to ``teacher`` on the same batches:
    (row of final losses and step times, bf16 losses, fp8 losses)."""
    fp8 = onegemm.fp8_training(copy.deepcopy(bf16))
    bf16_losses, bf16_ms = train(bf16, steps, batch, d, teacher, device, seed=seed)
    row, fp8_losses = against_bf16(model_name, fp8, bf16_losses, bf16_ms, steps, batch, d, teacher, device, seed)
    return row, bf16_losses, fp8_losses


def measure_moe_fp8(shapes, device, timer):
    """moe_ffn(fp8_training=True) against bf16 moe_ffn: forward+backward GPU time, and how far
    its gradients are from bf16's (calc_diff, DeepSeek's measure: 0 for equal directions)."""
    rows = []
    for name, E, H, I, k, T in shapes:
        x, w13, w2, weights, ids = moe_inputs(E, H, I, k, T, device)
        grad = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        bf16 = fwd_bwd(lambda *t: onegemm.moe_ffn(*t, ids), (x, w13, w2, weights), grad)
        fp8 = fwd_bwd(lambda *t: onegemm.moe_ffn(*t, ids, fp8_training=True), (x, w13, w2, weights), grad)
        bf16()
        want = [t.grad.clone() for t in (x, w13, w2, weights)]
        fp8()
        diffs = {f"diff_{what}": calc_diff(t.grad, g)
                 for t, g, what in zip((x, w13, w2, weights), want, ("dx", "dw13", "dw2", "dweights"))}
        t_bf16, t_fp8 = timer(bf16), timer(fp8)
        rows.append(dict(shape=f"{name} T={T}", bf16_ms=t_bf16, fp8_ms=t_fp8, fp8_vs_bf16=t_bf16 / t_fp8, **diffs))
        print(rows[-1], flush=True)
    return rows


def moe_layer(E, H, I, k, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    return onegemm.MoEFFN(rand(E, H, scale=H**-0.5), rand(E, 2 * I, H, scale=H**-0.5), rand(E, H, I, scale=I**-0.5),
                          top_k=k)


def measure_moe_fp8_training(E, H, I, k, batch, steps, device):
    """An MoEFFN layer trained in bf16 and under onegemm.fp8_training: final losses, step times."""
    return bf16_against_fp8(f"MoEFFN E={E} H={H} I={I} top-{k}, batch {batch}", moe_layer(E, H, I, k, device, seed=0),
                            moe_layer(E, H, I, k, device, seed=1), steps, batch, H, device, seed=2)


def run_moe_fp8(quick, device, timer):
    """The FP8 MoE training part: bench/results/moe_fp8_training.md, its plot, its summary figure."""
    rows = measure_moe_fp8(QUICK["moe_fp8"] if quick else MOE_SHAPES, device, timer)
    E, H, I, k, batch, steps = QUICK["moe_layer"] if quick else MOE_LAYER
    train_row, bf16_losses, fp8_losses = measure_moe_fp8_training(E, H, I, k, batch, steps, device)
    if quick:
        assert all(math.isfinite(x) for x in bf16_losses + fp8_losses)
        return
    text = header("FP8 MoE training: moe_ffn(fp8_training=True) against bf16 moe_ffn")
    text += (
        "Forward+backward of the expert FFN in GPU time (CUDA-graph replay), same inputs and output "
        "gradient; fp8_vs_bf16 = bf16 time / FP8 time (> 1: FP8 faster). diff_*: calc_diff of each FP8 "
        "gradient against bf16's (1 - cosine-like similarity; 0 = same direction). Target: >= 1.3x.\n\n"
        "FP8 here: the four expert GEMMs of the forward and the input gradient (1x128 activations, 128x128 "
        "experts quantised every step); the two weight-gradient GEMMs, router, SwiGLU and combine in bf16.\n\n"
    ) + markdown_table(rows) + "\n"
    text += (
        "## An MoEFFN layer trained in bf16 and in FP8\n\n"
        "AdamW (lr 1e-3) on MSE against a fixed random teacher layer, the same batches for both; step time: "
        "median of the second half (router, experts, loss, backward, optimizer), eager. Target: final loss "
        "within 2% of bf16's.\n\n" + markdown_table([train_row]) + "\n![loss curves](moe_fp8_training.png)\n\n"
    )
    text += ("## What the numbers say\n\n<!-- EXPLANATION: written after reading this run's numbers. "
             "bench/bench_autograd.py regenerates everything else. -->\n\n")
    write_results("moe_fp8_training", text)
    plot_losses({"bf16 (moe_ffn)": bf16_losses, "FP8 (fp8_training)": fp8_losses}, "moe_fp8_training.png", "MoEFFN")
    update_summary([dict(name="fp8_moe_train_vs_bf16", value=geomean([r["fp8_vs_bf16"] for r in rows]),
                         peer="onegemm moe_ffn bf16 forward+backward, GPU time (Qwen3-30B-A3B T=8192, Mixtral T=4096)")])


def torchao_recipes():
    """torchao's float8 training conversions by recipe name, or {} where torchao is missing
    (its C++ extensions are not needed: TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        print(f"torchao not importable ({e}): its columns are left out", flush=True)
        return {}
    return {name: (lambda m, name=name: convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(name)))
            for name in RECIPES[1:]}


def measure_fp8_speed(d, batch, steps, device, model="MLP", build=mlp):
    """Step ms (forward, backward, AdamW) of the same model (``build(d, device)``: the MLP, or
    BlockLinears) in bf16, under onegemm.fp8_training with each recipe and under torchao's
    float8 training with the same recipe, eager and under torch.compile (the model compiled),
    in one run: one row per recipe."""
    torch.manual_seed(0)
    teacher = build(d, device)
    base = build(d, device)

    def step_ms(convert, compiled):
        torch._dynamo.reset()
        model = convert(copy.deepcopy(base))
        return train(torch.compile(model) if compiled else model, steps, batch, d, teacher, device, seed=1)[1]

    bf16 = {mode: step_ms(lambda m: m, mode == "compiled") for mode in ("eager", "compiled")}
    torchao = torchao_recipes()
    rows = []
    for recipe in RECIPES:
        row = dict(model=model, tokens=batch, recipe=recipe, bf16_eager_ms=bf16["eager"],
                   bf16_compiled_ms=bf16["compiled"])
        for mode in ("eager", "compiled"):
            ms = row[f"onegemm_{mode}_ms"] = step_ms(lambda m: onegemm.fp8_training(m, recipe=recipe), mode == "compiled")
            row[f"vs_bf16_{mode}"] = bf16[mode] / ms
            if recipe in torchao:
                row[f"torchao_{mode}_ms"] = step_ms(torchao[recipe], mode == "compiled")
                row[f"vs_torchao_{mode}"] = row[f"torchao_{mode}_ms"] / ms
        print(row, flush=True)
        rows.append(row)
    return rows


def measure_host(device):
    """Host us per eager call of a small matmul: no gradient (the direct path), an input that
    requires grad (the autograd.Function), and the registered op called as torch.ops."""
    a = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16).t()
    ag = leaf(a)
    op = torch.ops.onegemm.matmul
    cases = [
        ("onegemm.matmul, no gradient", lambda: onegemm.matmul(a, b)),
        ("onegemm.matmul, a requires grad", lambda: onegemm.matmul(ag, b)),
        ("torch.ops.onegemm.matmul (the registered op)", lambda: op(a, b, None, None, None, None, None, None)),
        ("torch.matmul, no gradient", lambda: torch.matmul(a, b)),
        ("torch.matmul, a requires grad", lambda: torch.matmul(ag, b)),
    ]
    rows = [dict(call=name, host_us=host_us(fn, calls=1000)) for name, fn in cases]
    for r in rows:
        print(r, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU interpreter: run every path once, write nothing")
    parser.add_argument("--steps", type=int, default=300, help="training steps of the loss comparison")
    parser.add_argument("--speed-steps", type=int, default=40, help="steps per variant of the step-time matrix")
    parser.add_argument("--moe-fp8", action="store_true", help="the FP8 MoE training part alone")
    parser.add_argument("--mlp-fp8", action="store_true", help="the FP8 MLP training part alone")
    parser.add_argument("--tokens", default="8192,16384", help="the FP8 MLP part's batch sizes, comma-separated")
    parser.add_argument("--no-block", action="store_true", help="leave the Llama-3-8B block's step times out")
    args = parser.parse_args()
    quick = args.quick
    device = "cpu" if quick else "cuda"

    def timer(fn):
        if quick:
            fn()
            return math.nan
        return bench_ms(fn, warmup_ms=10, rep_ms=50)

    if not args.mlp_fp8:
        run_moe_fp8(quick, device, timer)
    if not args.moe_fp8:
        run_mlp_fp8(quick, device, args.steps, args.speed_steps, [int(t) for t in args.tokens.split(",")],
                    not args.no_block)
    if args.moe_fp8 or args.mlp_fp8:
        return
    gemm_rows = measure_linear(QUICK["linear"] if quick else LINEAR_SHAPES, device, timer)
    gemm_rows += measure_moe(QUICK["moe"] if quick else MOE_SHAPES, device, timer)
    if quick:
        print("quick: every path ran; no files written")
        return
    host_rows = measure_host(device)

    text = header("Training: forward+backward, FP8 training, eager overhead with gradients")
    text += (
        "Forward+backward in GPU time (the step replayed from a CUDA graph), same output gradient "
        "for both; vs_torch = torch time / onegemm time (> 1: onegemm faster). Gradients are "
        "checked against torch's in the same run before timing.\n\n"
        "Targets: linear >= 1.0x F.linear at M >= 4096 (each shape >= 0.97x); grouped_matmul >= 1.1x "
        "torch._grouped_mm; moe_ffn >= 1.3x the torch MoE on torch._grouped_mm.\n\n"
    )
    text += markdown_table(gemm_rows) + "\n"
    lin = [r["vs_torch"] for r in gemm_rows if r["op"] == "linear"]
    text += f"Geomean linear vs F.linear: {geomean(lin):.3f}.\n\n"
    text += "## Eager host time of one call (us), M = 16, 4096 x 4096 bf16\n\n" + markdown_table(host_rows) + "\n"
    text += ("## What the numbers say\n\n<!-- EXPLANATION: written after reading this run's numbers. "
             "bench/bench_autograd.py regenerates everything else. -->\n\n")
    write_results("autograd", text)
    by_op = lambda op: geomean([r["vs_torch"] for r in gemm_rows if r["op"] == op])  # noqa: E731
    update_summary([
        dict(name="linear_fwd_bwd_vs_torch", value=by_op("linear"), peer="F.linear forward+backward, GPU time, M >= 4096"),
        dict(name="grouped_fwd_bwd_vs_torch", value=by_op("grouped_matmul 2Dx3D"),
             peer="torch._grouped_mm forward+backward, GPU time (Qwen3-30B-A3B and Mixtral gate_up)"),
        dict(name="moe_ffn_fwd_bwd_vs_torch", value=by_op("moe_ffn"),
             peer="the torch MoE on torch._grouped_mm forward+backward, GPU time (Qwen3 T=8192, Mixtral T=4096)"),
    ])


def run_mlp_fp8(quick, device, steps, speed_steps, tokens=(8192, 16384), with_block=True):
    """The FP8 MLP part: each recipe's losses and step times against bf16 and torchao's same
    recipe; bench/results/fp8_training.md, its plot and summary figures."""
    d, batches = (QUICK["mlp"][0], [QUICK["mlp"][2]]) if quick else (4096, list(tokens))
    steps = QUICK["mlp"][1] if quick else steps
    train_rows, speed_rows = [], []
    for batch in batches:
        rows, bf16_losses, curves = measure_fp8_training(d, steps, batch, device)
        train_rows += rows
        if not quick:
            speed_rows += measure_fp8_speed(d, batch, speed_steps, device)
    if with_block and not quick:  # Llama-3-8B's block linears at its width, 8192 tokens
        speed_rows += measure_fp8_speed(4096, 8192, speed_steps, device, "Llama-3-8B block linears", block)
    if quick:
        assert all(math.isfinite(x) for losses in (bf16_losses, *curves.values()) for x in losses)
        return
    write_fp8_training(d, speed_steps, batches, train_rows, speed_rows)
    plot_losses({"bf16 (nn.Linear)": bf16_losses, **{f"FP8 {r}": c for r, c in curves.items()}})


def write_fp8_training(d, speed_steps, batches, train_rows, speed_rows, stamp=None, note=""):
    """bench/results/fp8_training.md and its summary figures from the FP8 MLP part's rows
    (``stamp``, ``note``: the provenance of rows gathered from several runs)."""
    text = header("FP8 training (onegemm.fp8_training, each recipe) against bf16 and torchao",
                  gpu=stamp and stamp["gpu"]) + note
    text += (
        "## Losses\n\n"
        f"The MLP {d}->{4 * d}->{d} learns a fixed random teacher (MSE, AdamW lr 1e-3), the same batches for "
        "every model. Step time: median of the second half of the steps (forward, backward, AdamW), eager. "
        "Target: final loss within 1% of bf16's.\n\n" + markdown_table(train_rows) + "\n"
        "![loss curves](fp8_training.png)\n\n"
        "## Step time against bf16 and torchao's same recipe, eager and compiled\n\n"
        f"ms per step (median of the second half of {speed_steps} steps) of the MLP and of a Llama-3-8B-shaped "
        "block's seven linears (bench_autograd.BlockLinears): bf16 nn.Linear, onegemm.fp8_training("
        "recipe=...), torchao's convert_to_float8_training with Float8LinearConfig.from_recipe_name(recipe) "
        "(none for blockwise); `compiled`: the model under torch.compile. Ratios: the peer's time / onegemm's "
        "(> 1: onegemm faster). Targets (compiled): >= 1.1x torchao's same recipe; >= 1.35x bf16 tensorwise, "
        ">= 1.25x bf16 rowwise.\n\n" + markdown_table(speed_rows) + "\n"
    )
    text += ("## What the numbers say\n\n<!-- EXPLANATION: written after reading this run's numbers. "
             "bench/bench_autograd.py regenerates everything else. -->\n\n")
    write_results("fp8_training", text)
    mlp_rows = [r for r in speed_rows if r["model"] == "MLP"]
    by = lambda recipe, key: geomean([r[key] for r in mlp_rows if r["recipe"] == recipe and key in r])  # noqa: E731
    figures = [dict(name="fp8_mlp_train_vs_bf16", value=by("tensorwise", "vs_bf16_compiled"),
                    peer="bf16 nn.Linear MLP 4096->16384->4096 training step, both compiled, onegemm's tensorwise "
                         f"recipe ({batches} tokens; every recipe in fp8_training.md)")]
    for recipe in ("tensorwise", "rowwise"):
        if any("vs_torchao_compiled" in r for r in mlp_rows if r["recipe"] == recipe):
            figures.append(dict(name=f"fp8_mlp_train_vs_torchao_{recipe}_compiled", value=by(recipe, "vs_torchao_compiled"),
                                peer=f"torchao float8 {recipe} training, both models under torch.compile, same recipe "
                                     f"({batches} tokens)"))
    update_summary(figures, stamp)


def plot_losses(curves: dict, name="fp8_training.png", model="MLP"):
    """Loss curves by label, log scale, into bench/results/``name``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(losses, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_title(f"{model} regression on {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / name, dpi=120)


if __name__ == "__main__":
    main()
