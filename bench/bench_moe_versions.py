"""bf16 moe_ffn of one onegemm checkout, for comparing versions side by side on one GPU.

    PYTHONPATH=<dir holding an 'onegemm' link to an old checkout> python bench/bench_moe_versions.py old.json
    python bench/bench_moe_versions.py new.json

Times onegemm.moe_ffn (bf16, inference mode) at Qwen3-30B-A3B and Mixtral-8x7B decode and
prefill sizes, GPU time (CUDA-graph replay) and eager, with inputs drawn from a fixed seed so
every version sees the same ones, and writes them as JSON. Run the versions alternately, twice
each, in one session of the machine; bench/results/moe_fp8.md section 3 has such a run.
"""

from __future__ import annotations

import argparse
import json

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from onegemm.testing import eager_ms, gpu_ms

# (model, E, H, I, top-k, T)
CASES = [("Qwen3-30B-A3B", 128, 2048, 768, 8, 64), ("Qwen3-30B-A3B", 128, 2048, 768, 8, 8192),
         ("Mixtral-8x7B", 8, 4096, 14336, 2, 16), ("Mixtral-8x7B", 8, 4096, 14336, 2, 4096)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write")
    args = parser.parse_args()
    result = {"onegemm": onegemm.__file__}
    for name, E, H, I, k, T in CASES:
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).bfloat16()
        w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).bfloat16()
        weights, ids = onegemm.route(torch.randn(T, E, device="cuda", generator=g), k)
        with torch.inference_mode():
            call = lambda: onegemm.moe_ffn(x, w13, w2, weights, ids)  # noqa: E731
            result[f"{name} T={T}"] = dict(gpu_ms=gpu_ms(call, 10, 60), eager_ms=eager_ms(call, 10, 60))
        print(name, T, result[f"{name} T={T}"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
