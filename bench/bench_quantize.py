"""quantize_fp8's GPU time against a bf16 copy of the same tensor (its bandwidth floor).

    python bench/bench_quantize.py    # H200: bench/results/quantize.md

Shapes: the expert stacks FP8 MoE training quantises every step (Qwen3-30B-A3B and
Mixtral-8x7B, [E * R, C]) and activations. Each call as a user makes it: 128x128 blocks, their
transposed pair (transposed=True), 1x128 blocks and their pair. copy/x = the bf16 clone()'s
time over the call's (1.0: the call runs at the speed of reading and writing x once).
"""

from __future__ import annotations

import argparse
import sys

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch

from common import bench_ms, header, markdown_table, write_results

SHAPES = {"Qwen3-30B-A3B w13": (128 * 1536, 2048), "Qwen3-30B-A3B w2": (128 * 2048, 768),
          "Mixtral-8x7B w13": (8 * 28672, 4096), "Mixtral-8x7B w2": (8 * 4096, 14336),
          "activations 65536x2048": (65536, 2048), "activations 8192x16384": (8192, 16384)}
CALLS = {"128x128": dict(block=(128, 128)), "128x128 transposed": dict(block=(128, 128), transposed=True),
         "1x128": dict(block=(1, 128)), "1x128 transposed": dict(block=(1, 128), transposed=True)}


def main():
    rows = []
    for name, (R, C) in SHAPES.items():
        x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
        copy = bench_ms(lambda: x.clone())
        row = dict(shape=name, R=R, C=C, copy_ms=copy)
        for call, kw in CALLS.items():
            ms = bench_ms(lambda: onegemm.quantize_fp8(x, **kw))
            row[f"{call} ms"] = ms
            row[f"{call} copy/x"] = copy / ms
        rows.append(row)
        print(row, flush=True)
    write_results("quantize", header("quantize_fp8 against a bf16 copy of the same tensor") + __doc__.split("\n\n", 2)[2]
                  + "\n" + markdown_table(rows) + "\n")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU")
    main()
