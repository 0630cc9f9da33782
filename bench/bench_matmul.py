"""onegemm.matmul (launch-per-tile, autotuned) against cuBLAS (torch.matmul), side by side.

    python bench/bench_matmul.py            # on the H200: table + bench/results/matmul.{md,png}
    python bench/bench_matmul.py --quick    # CPU interpreter: the same code path on tiny shapes

Shapes (DESIGN.md): square 512..8192 and the LLM linears M in {16, 128, 4096, 16384} x
(N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}; B is W.t() of an nn.Linear weight
[N, K] as in a real layer. bf16 and fp16. Plus the seed lesson's GROUP_M=1 vs GROUP_M=8
comparison at the tuner's chosen tile shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import onegemm  # noqa: E402,I001  (first: it picks Triton's interpreter when there is no GPU)
import torch  # noqa: E402
from common import bench_ms, config_label, geomean, header, markdown_table, plot_ratios, tflops, write_results  # noqa: E402
from onegemm.core.matmul import _matmul  # noqa: E402
from onegemm.core.runtime import with_meta  # noqa: E402
from reference import TOL, assert_close, matmul_ref, rel_err  # noqa: E402

SQUARE = [512, 1024, 2048, 4096, 8192]
LLM_M = [16, 128, 4096, 16384]
LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shapes(quick: bool):
    if quick:
        return [("square", 64, 64, 64), ("llm", 17, 96, 80)]
    out = [("square", s, s, s) for s in SQUARE]
    out += [("llm", m, n, k) for m in LLM_M for (n, k) in LLM_NK]
    return out


def operands(M, N, K, dtype, device):
    a = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
    return a, w.t()


def run_quick():
    for name, M, N, K in shapes(True):
        for dt in DTYPES.values():
            a, b = operands(M, N, K, dt, "cpu")
            assert_close(onegemm.matmul(a, b), matmul_ref(a, b), TOL[dt], f"{name} {M}x{N}x{K} {dt}")
    print("quick: matmul code path OK under the interpreter")


def run_full():
    rows = []
    for kind, M, N, K in shapes(False):
        for dname, dt in DTYPES.items():
            a, b = operands(M, N, K, dt, "cuda")
            ours = onegemm.matmul(a, b)
            theirs = torch.matmul(a, b)
            # Same inputs, both fp32-accumulated: they differ by rounding only.
            err = rel_err(ours, theirs)
            t_ours = bench_ms(lambda: onegemm.matmul(a, b))
            t_cublas = bench_ms(lambda: torch.matmul(a, b))
            flop = 2.0 * M * N * K
            cfg = _matmul.best_config()
            rows.append(dict(
                kind=kind, dtype=dname, M=M, N=N, K=K,
                onegemm_TFLOPs=tflops(flop, t_ours), cuBLAS_TFLOPs=tflops(flop, t_cublas),
                ratio=t_cublas / t_ours, err_vs_cuBLAS=err,
                config=config_label(cfg),
            ))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)

    # GROUP_M: the tuner's tile shape, forced with GROUP_M = 1 and 8.
    group_rows = []
    for M, N, K in [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 14336, 4096)]:
        a, b = operands(M, N, K, torch.bfloat16, "cuda")
        onegemm.matmul(a, b)
        best = _matmul.best_config()
        t = {}
        for g in (1, 8):
            cfg = with_meta(best, GROUP_M=g)
            t[g] = bench_ms(lambda: onegemm.matmul(a, b, config=cfg))
        flop = 2.0 * M * N * K
        group_rows.append(dict(M=M, N=N, K=K, GROUP_M1_TFLOPs=tflops(flop, t[1]), GROUP_M8_TFLOPs=tflops(flop, t[8]),
                               speedup_of_GROUP_M8=t[1] / t[8]))

    big = [r for r in rows if r["M"] >= 1024]
    summary = []
    for dname in DTYPES:
        summary.append(dict(dtype=dname,
                            geomean_ratio_M_ge_1024=geomean([r["ratio"] for r in big if r["dtype"] == dname]),
                            geomean_ratio_all=geomean([r["ratio"] for r in rows if r["dtype"] == dname])))
    text = header("onegemm.matmul vs cuBLAS (torch.matmul)")
    text += "ratio = cuBLAS time / onegemm time (> 1: onegemm faster). B = W.t() of an nn.Linear weight.\n\n"
    text += "## Summary (geomean of ratios)\n\n" + markdown_table(summary) + "\n"
    text += "## Every shape\n\n" + markdown_table(rows) + "\n"
    text += "## GROUP_M (bf16, tuner's tile shape forced with GROUP_M = 1 and 8)\n\n" + markdown_table(group_rows)
    write_results("matmul", text)
    labels = [f"{r['dtype']} {r['M']}x{r['N']}x{r['K']}" for r in rows]
    plot_ratios("matmul", labels, {"onegemm / cuBLAS": [r["ratio"] for r in rows]},
                "speed ratio (cuBLAS time / onegemm time)", "onegemm.matmul vs cuBLAS on H200")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes under the CPU interpreter, no timing")
    args = p.parse_args()
    if args.quick:
        run_quick()
    else:
        run_full()
