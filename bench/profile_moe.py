"""Where a decode-sized MoE call spends its GPU time: each kernel's time per call (torch.profiler).

    python bench/profile_moe.py                       # on the GPU: one line per case
    PYTHONPATH=/path/to/older/onegemm python bench/profile_moe.py --tag old   # the same, another tree

For Qwen3-30B-A3B's and DeepSeek-V3's (32 experts of 8 EP ranks) expert shapes at T = 1, 16, 64
and 256 tokens: onegemm.moe_ffn with bf16 and FP8 experts, and (T <= 64) the MoEFFN layer under
torch.inference_mode (router GEMM, routing and moe_ffn). Each line gives the kernels' summed time
per call and the six longest kernels with their launches per call. A line per case, so two trees
(e.g. a commit and its parent on PYTHONPATH) can be compared in one device call; the results go
into bench/results by hand (bench/results/moe_prep.md).
"""

from __future__ import annotations

import argparse

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch

# name: (hidden, intermediate, experts, top_k, MoEFFN routing options)
MODELS = {
    "Qwen3": (2048, 768, 128, 8, {}),
    "DSv3-EP8": (7168, 2048, 32, 8, dict(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5)),
}


def profile_line(tag: str, label: str, fn, calls: int = 20) -> str:
    """``label``'s kernels over ``calls`` calls (after one that compiles), per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / calls, e.count // calls) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    kernels = " | ".join(f"{name[:48]} x{count} {us:.1f}" for name, us, count in rows[:6])
    return f"{tag} {label} total_us={sum(r[1] for r in rows):.1f} :: {kernels}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="new", help="the first word of each line (which tree ran)")
    parser.add_argument("--tokens", default="1,16,64,256", help="comma-separated token counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("profiles GPU kernels: run it on the GPU machine")
    torch.manual_seed(0)
    for name, (H, I, E, k, opts) in MODELS.items():
        gate = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
        bias = torch.randn(E, device="cuda") * 0.1 if opts else None
        layers = {"bf16": onegemm.MoEFFN(gate, w13, w2, top_k=k, correction_bias=bias, **opts),
                  "fp8": onegemm.MoEFFN(gate, q13, q2, w_gate_up_scale=s13, w_down_scale=s2, top_k=k,
                                        correction_bias=bias, **opts)}
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            w, ids = onegemm.route(torch.randn(T, E, device="cuda"), k)
            print(profile_line(args.tag, f"ffn {name} T={T} bf16", lambda: onegemm.moe_ffn(x, w13, w2, w, ids)),
                  flush=True)
            print(profile_line(args.tag, f"ffn {name} T={T} fp8", lambda: onegemm.moe_ffn(
                x, q13, q2, w, ids, w_gate_up_scale=s13, w_down_scale=s2)), flush=True)
            if T <= 64:
                for kind, layer in layers.items():
                    with torch.inference_mode():
                        print(profile_line(args.tag, f"layer {name} T={T} {kind}", lambda: layer(x)), flush=True)


if __name__ == "__main__":
    main()
