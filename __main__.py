"""python -m onegemm: run the stored MoE layer's expert FFN through grouped_matmul.

The main job. It loads the Mixtral-style layer shipped in grouped/data/ (8 experts, hidden 256,
intermediate 512, bf16), routes a batch of random tokens (top-2), runs the expert FFN through
onegemm's grouped kernels (gather + SwiGLU GEMM, routing-weighted down GEMM, fixed-order
combine) and compares it with plain torch: errors against a float64 reference of the same
routing, and timings against torch's bf16 implementation. Then a short core-GEMM comparison
(onegemm.matmul against torch.matmul).

Without a GPU the kernels run under Triton's CPU interpreter: correct, but slow, so the batch is
small there and the timings only say that it ran (they are not performance numbers).

    python -m onegemm                 # 4096 tokens on a GPU, 128 under the interpreter
    python -m onegemm --tokens 16384
"""

from __future__ import annotations

import argparse
import time

import torch

import onegemm
from onegemm.grouped import STORED_LAYER
from onegemm.grouped.moe import moe_ffn_torch


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def timed_ms(fn, gpu: bool) -> float:
    """Median ms (triton's do_bench, CUDA events) on a GPU; one wall-clock run otherwise."""
    if gpu:
        import triton

        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onegemm", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="batch size T (default: 4096 on a GPU, 128 interpreted)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    gpu = not onegemm.INTERPRET
    device = "cuda" if gpu else "cpu"
    where = f"GPU {torch.cuda.get_device_name()}" if gpu else "Triton CPU interpreter (no GPU: slow, timings are not performance)"
    T = args.tokens or (4096 if gpu else 128)
    torch.manual_seed(args.seed)

    layer = onegemm.MoEFFN.from_safetensors(STORED_LAYER, top_k=2, device=device)
    E, H = layer.gate_weight.shape
    I = layer.w_down.shape[2]
    print(f"onegemm {onegemm.__version__}: {where}; torch {torch.__version__}")
    print(f"layer: {STORED_LAYER.name}: {E} experts, hidden {H}, intermediate {I}, {layer.w_gate_up.dtype}, top-{layer.top_k}")
    print(f"batch: {T} tokens\n")

    x = torch.randn(T, H, device=device).to(layer.w_gate_up.dtype)
    weights, ids = onegemm.route(layer.router_logits(x), layer.top_k)
    loads = torch.bincount(ids.reshape(-1).long(), minlength=E).tolist()
    print(f"rows per expert (sorted on the device into grouped_matmul's offs): {loads}")

    y = layer(x)
    # Errors: the same routing, in float64 (the reference) and in torch bf16 (the peer).
    w_gu, w_dn = layer.w_gate_up, layer.w_down
    ref = moe_ffn_torch(x.double(), w_gu.double(), w_dn.double(), weights, ids)
    torch_bf16 = moe_ffn_torch(x, w_gu, w_dn, weights, ids, use_grouped_mm=gpu)
    logits64 = x.double() @ layer.gate_weight.double().t()
    _, ids64 = torch.topk(logits64, layer.top_k, dim=-1)
    same_experts = (ids.long().sort(-1).values == ids64.sort(-1).values).all(-1).float().mean().item()
    print(f"routing: {100 * same_experts:.2f}% of tokens pick the same experts as float64 logits")
    print("expert FFN, relative Frobenius error against float64 torch on the same routing:")
    print(f"  onegemm MoEFFN (grouped_matmul kernels): {rel_err(y, ref):.2e}")
    print(f"  torch {x.dtype} ({'torch._grouped_mm' if gpu else 'torch.mm per expert'}): {rel_err(torch_bf16, ref):.2e}")
    print(f"  bitwise identical on a rerun: {torch.equal(layer(x), y)}")

    t_one = timed_ms(lambda: onegemm.moe_ffn(x, w_gu, w_dn, weights, ids), gpu)
    t_torch = timed_ms(lambda: moe_ffn_torch(x, w_gu, w_dn, weights, ids, use_grouped_mm=gpu), gpu)
    flop = 2 * T * layer.top_k * (2 * I * H + H * I)
    print("expert FFN time (routing excluded):")
    print(f"  onegemm.moe_ffn: {t_one:9.3f} ms ({flop / t_one / 1e9:.1f} TFLOP/s)" if gpu else f"  onegemm.moe_ffn: {t_one:9.1f} ms")
    print(f"  torch:           {t_torch:9.3f} ms -> onegemm is {t_torch / t_one:.2f}x" if gpu else f"  torch:           {t_torch:9.1f} ms")

    # The core GEMM everything is built on.
    M, N, K = (T, 4 * H, H) if gpu else (128, 256, 256)
    a = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = torch.randn(N, K, device=device).to(torch.bfloat16)
    c = onegemm.matmul(a, w.t())
    c_ref = a.double() @ w.double().t()
    print(f"\ncore GEMM [{M}, {K}] @ [{K}, {N}] bf16 (weight as W.t()):")
    print(f"  error vs float64: onegemm.matmul {rel_err(c, c_ref):.2e}, torch.matmul {rel_err(a @ w.t(), c_ref):.2e}")
    t_c = timed_ms(lambda: onegemm.matmul(a, w.t()), gpu)
    t_t = timed_ms(lambda: a @ w.t(), gpu)
    if gpu:
        print(f"  time: onegemm.matmul {t_c:.3f} ms, torch.matmul {t_t:.3f} ms -> {t_t / t_c:.2f}x")
    else:
        print(f"  time: onegemm.matmul {t_c:.1f} ms (interpreted), torch.matmul {t_t:.1f} ms")
    ok = rel_err(y, ref) < 2e-2 and rel_err(c, c_ref) < 1e-2
    print("\nOK" if ok else "\nFAILED: error above the bf16 bound (2e-2)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
