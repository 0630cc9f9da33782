"""Every candidate config of core's Gluon FP8 body, timed on the H200, per K loop.

    python tools/wgmma_sweep.py            # markdown tables on stdout (GPU time, TFLOP/s)
    python tools/wgmma_sweep.py --peer M N K   # torch._scaled_mm row-wise on one shape (a process of its own)

For each shape it forces each config of ``hopper_configs.wgmma_candidates`` through
blockscaled_matmul (row-wise scales, promoted and use_fast_accum; 1x128 and 128x128 block
scales) and prints TFLOP/s in GPU time (CUDA-graph replays), next to the heuristic's pick and
core's Triton body. What the tuned table and the heuristic choose follows these tables
(bench/results/wgmma_modes.md). torch._scaled_mm row-wise is timed by ``--peer`` in a
process of its own, eagerly: on the H200 (torch 2.11) its cuBLASLt call failed once the same
process had computed a float64 reference, and a CUDA-graph capture of it failed, leaving a
sticky error.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch
from triton.testing import do_bench

import onegemm
from onegemm.core import configs
from onegemm.core.hopper_configs import WgmmaKey, wgmma_candidates
from onegemm.core.scaling import Scaling
from onegemm.testing import graph_bench

ROW_SHAPES = [(4096, 7168, 16384), (4096, 4096, 7168), (8192, 8192, 8192), (4096, 14336, 4096), (2048, 24576, 1536)]
BLOCK_SHAPES = [(4096, 7168, 16384, "1x128"), (4096, 2112, 7168, "1x128"), (4096, 7168, 16384, "128x128")]


def tflops(M, N, K, ms):
    return 2 * M * N * K / ms / 1e9


def inputs(M, N, K, a_kind, b_kind):
    x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    qa, sa = onegemm.quantize_fp8(x, a_kind)
    qw, sw = onegemm.quantize_fp8(w, b_kind)
    return qa, sa, qw.t(), sw.t()


def sweep(M, N, K, scaling: str, qa, sa, qb, sb, fast: bool) -> dict:
    row = {"default": tflops(M, N, K, graph_bench(lambda: onegemm.blockscaled_matmul(qa, qb, sa, sb, use_fast_accum=fast)))}
    key = WgmmaKey(configs.m_bucket(M), N, K, Scaling.parse(scaling), "bf16", fast_accum=fast)
    for c in wgmma_candidates(key, torch.cuda.get_device_properties(0).multi_processor_count):
        f = lambda: onegemm.blockscaled_matmul(qa, qb, sa, sb, use_fast_accum=fast, config=c)  # noqa: E731
        row[configs.label(c)] = tflops(M, N, K, graph_bench(f))
    return row


def table(title, rows) -> str:
    names = sorted({k for r in rows for k in r["tflops"]}, key=lambda k: (k != "default", k))
    text = f"### {title}\n\n| config | " + " | ".join(r["shape"] for r in rows) + " |\n|---|" + "---|" * len(rows) + "\n"
    for n in names:
        text += f"| {n} | " + " | ".join(f"{r['tflops'][n]:.0f}" if n in r["tflops"] else "-" for r in rows) + " |\n"
    return text + "\n"


def peer(M, N, K):
    qa, sa, qb, sb = inputs(M, N, K, "row", "row")
    sb = sb.contiguous()
    out = {}
    for fast in (False, True):
        out[fast] = tflops(M, N, K, do_bench(lambda: torch._scaled_mm(qa, qb, sa, sb, out_dtype=torch.bfloat16,
                                                                       use_fast_accum=fast)))
    print(f"| {M}x{N}x{K} | {out[False]:.0f} | {out[True]:.0f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", nargs=3, type=int, metavar=("M", "N", "K"))
    args = p.parse_args()
    if args.peer:
        return peer(*args.peer)
    print("### torch._scaled_mm row-wise, TFLOP/s (eager do_bench, a process per shape)\n\n"
          "| shape | promoted | use_fast_accum |\n|---|---|---|", flush=True)
    for M, N, K in ROW_SHAPES:
        subprocess.run([sys.executable, __file__, "--peer", str(M), str(N), str(K)], check=False)
    print()
    for fast in (False, True):
        rows = []
        for M, N, K in ROW_SHAPES:
            qa, sa, qb, sb = inputs(M, N, K, "row", "row")
            rows.append(dict(shape=f"{M}x{N}x{K}", tflops=sweep(M, N, K, "row,col", qa, sa, qb, sb, fast)))
        print(table(f"row-wise, {'use_fast_accum' if fast else 'promoted'} (TFLOP/s)", rows), flush=True)
    rows = []
    for M, N, K, a_kind in BLOCK_SHAPES:
        qa, sa, qb, sb = inputs(M, N, K, (1, 128) if a_kind == "1x128" else (128, 128), (128, 128))
        rows.append(dict(shape=f"{M}x{N}x{K} {a_kind}", tflops=sweep(M, N, K, f"{a_kind},128x128", qa, sa, qb, sb, False)))
    print(table("block scales x 128x128 (TFLOP/s)", rows), flush=True)


if __name__ == "__main__":
    main()
