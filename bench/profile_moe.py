"""Where a decode-sized MoE call spends its GPU time: each kernel's time per call (torch.profiler),
next to the call's graph and eager time and the time its expert bytes take at the copy speed.

    python bench/profile_moe.py                       # on the GPU: a block per case
    python bench/profile_moe.py --models qwen3,gpt --tokens 1,4 --no-layer
    PYTHONPATH=/path/to/older/tree python bench/profile_moe.py --tag old   # the same, another tree

For Qwen3-30B-A3B's, Mixtral-8x7B's, gpt-oss-120b's and DeepSeek-V3's (32 experts of 8 EP
ranks) expert shapes: onegemm.moe_ffn with bf16 and FP8 experts, and (T <= 64) the MoEFFN layer
under torch.inference_mode (router GEMM, routing and moe_ffn; over the rank's own experts).
Each case prints one summary line
(graph time: a CUDA-graph replay, L2 flushed; eager: as a user calls it; kernels: the
profiler's summed kernel time, whose difference from the graph time is the gaps between
launches; bytes: the experts the call touches, and their time at this run's copy speed), the
configs each launch took, and every kernel with its launches per call. Two trees (e.g. a commit
and its parent on PYTHONPATH) can be compared in one device call; the results go into
bench/results by hand (bench/results/moe_prep.md).
"""

from __future__ import annotations

import argparse

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import copy_tb_s
from onegemm.testing import eager_ms, gpu_ms, launched

# name: (local experts, routed experts, hidden, intermediate, top_k, MoEFFN routing options);
# routed past local: the other ranks' experts (expert parallelism), whose ids contribute nothing
MODELS = {
    "Qwen3": (128, 128, 2048, 768, 8, {}),
    "Mixtral": (8, 8, 4096, 14336, 2, {}),
    "gpt-oss": (128, 128, 2880, 2880, 4, {}),
    "DSv3-EP8": (32, 256, 7168, 2048, 8,
                 dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)),
}


def kernel_rows(fn, calls: int = 20) -> list:
    """(kernel name, us per call, launches per call) over ``calls`` calls after one that
    compiles, longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted(((e.key, e.device_time_total / calls, e.count / calls) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])


def report(tag: str, label: str, fn, copy: float, weight_bytes: float | None = None) -> None:
    """One case: its summary line (``weight_bytes``: the expert bytes it reads, where known),
    its launches' configs and its kernels."""
    rows = kernel_rows(fn)
    graph_us, eager_us = gpu_ms(fn) * 1e3, eager_ms(fn, 10, 50) * 1e3
    read = "" if weight_bytes is None else (f" weight_MB={weight_bytes / 1e6:.1f}"
                                            f" at_copy_us={weight_bytes / (copy * 1e12) * 1e6:.1f}")
    print(f"{tag} {label}: graph_us={graph_us:.1f} eager_us={eager_us:.1f} kernels_us={sum(r[1] for r in rows):.1f}{read}")
    for x in launched(fn):
        print(f"    launch {x['family']} {x['config']} ({x['source']})")
    for name, us, count in rows:
        print(f"    {us:8.1f} us x{count:.1f}  {name[:100]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="new", help="the first word of each line (which tree ran)")
    parser.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts")
    parser.add_argument("--models", help="comma-separated model name fragments (default every model)")
    parser.add_argument("--no-layer", action="store_true", help="moe_ffn alone, not the MoEFFN layer")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("profiles GPU kernels: run it on the GPU machine")
    copy = copy_tb_s()
    print(f"{args.tag} copy TB/s {copy:.2f} ({torch.cuda.get_device_name()})")
    for name, (E, E_routed, H, I, k, opts) in MODELS.items():
        if args.models and not any(w.lower() in name.lower() for w in args.models.split(",")):
            continue
        torch.manual_seed(0)
        gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5  # the layer: this rank's experts
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
        bias = torch.randn(E, device="cuda") * 0.1 if opts else None
        layers = {} if args.no_layer else {
            "bf16": onegemm.MoEFFN(gate, w13, w2, top_k=k, correction_bias=bias, **opts),
            "fp8": onegemm.MoEFFN(gate, q13, q2, w_gate_up_scale=s13, w_down_scale=s2, top_k=k, correction_bias=bias,
                                  **opts)}
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            w, ids = onegemm.route(torch.randn(T, E_routed, device="cuda"), k)
            hit = int(torch.unique(ids[(ids >= 0) & (ids < E)]).numel())
            per_expert = 3 * H * I  # values; fp8: one byte each, bf16 two
            report(args.tag, f"ffn {name} T={T} bf16 ({hit} experts)", lambda: onegemm.moe_ffn(x, w13, w2, w, ids),
                   copy, 2 * hit * per_expert)
            report(args.tag, f"ffn {name} T={T} fp8 ({hit} experts)", lambda: onegemm.moe_ffn(
                x, q13, q2, w, ids, w_gate_up_scale=s13, w_down_scale=s2), copy, hit * per_expert)
            if T <= 64:
                for kind, layer in layers.items():
                    with torch.inference_mode():
                        report(args.tag, f"layer {name} T={T} {kind}", lambda: layer(x), copy)


if __name__ == "__main__":
    main()
