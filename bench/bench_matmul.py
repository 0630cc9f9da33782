"""onegemm.matmul against cuBLAS (torch.matmul), side by side, in GPU time and eager.

    python bench/bench_matmul.py            # on the H200: table + bench/results/matmul.{md,png}
    python bench/bench_matmul.py --quick    # CPU interpreter: the same code path on tiny shapes

Shapes: square 512..8192 and the LLM linears M in {16, 128, 4096, 16384} x (N, K) in
{(4096, 4096), (14336, 4096), (4096, 14336)}; B is W.t() of an nn.Linear weight [N, K] as in a
real layer. bf16 and fp16. Columns: GPU time (CUDA-graph replay) and eager time (do_bench of
Python calls, host included) as ratios to cuBLAS; the config that ran and where it came from
(the shipped table or the heuristic); and the heuristic's own config forced, as a ratio to
what ran, so the heuristic's quality off the table is on record. Plus GROUP_M 1 vs 8.
"""

from __future__ import annotations

import argparse

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import bench_ms, geomean, header, markdown_table, plot_ratios, require_gpu, tflops, write_results
from onegemm import testing
from onegemm.core import configs

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


def heuristic_config(a, b):
    """The config the heuristic gives this call (what runs off the table)."""
    M, K = a.shape
    N = b.shape[1]
    key = configs.MatmulKey(configs.dtype_name(a.dtype), configs.m_bucket(M), N, K, a.stride(1) == 1, b.stride(0) == 1,
                            configs.EITHER, configs.ANY_SCHEDULE, 0)
    return configs.matmul_heuristic(key, torch.cuda.get_device_properties(0).multi_processor_count)


def run_quick():
    for name, M, N, K in shapes(True):
        for dt in DTYPES.values():
            a, b = operands(M, N, K, dt, "cpu")
            testing.assert_close(onegemm.matmul(a, b), testing.matmul_ref(a, b), testing.TOL[dt], f"{name} {M}x{N}x{K} {dt}")
    print("quick: matmul code path OK under the interpreter")


def run_full():
    require_gpu()
    rows = []
    for kind, M, N, K in shapes(False):
        for dname, dt in DTYPES.items():
            a, b = operands(M, N, K, dt, "cuda")
            (ran,) = testing.launched(lambda: onegemm.matmul(a, b))
            err = testing.rel_err(onegemm.matmul(a, b), torch.matmul(a, b))
            t_ours = bench_ms(lambda: onegemm.matmul(a, b))
            t_cublas = bench_ms(lambda: torch.matmul(a, b))
            e_ours = bench_ms(lambda: onegemm.matmul(a, b), graph=False)
            e_cublas = bench_ms(lambda: torch.matmul(a, b), graph=False)
            heur = heuristic_config(a, b)
            t_heur = bench_ms(lambda: onegemm.matmul(a, b, config=heur)) if ran["source"] != "heuristic" else t_ours
            flop = 2.0 * M * N * K
            rows.append(dict(
                kind=kind, dtype=dname, M=M, N=N, K=K,
                onegemm_TFLOPs=tflops(flop, t_ours), cuBLAS_TFLOPs=tflops(flop, t_cublas),
                ratio=t_cublas / t_ours, eager_ratio=e_cublas / e_ours, err_vs_cuBLAS=err,
                config=ran["config"], source=ran["source"],
                heuristic=configs.label(heur), heuristic_vs_ran=t_ours / t_heur,
            ))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)

    # GROUP_M: the tile that ran, forced with GROUP_M = 1 and 8.
    group_rows = []
    for M, N, K in [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 14336, 4096)]:
        a, b = operands(M, N, K, torch.bfloat16, "cuda")
        (ran,) = testing.launched(lambda: onegemm.matmul(a, b))
        t = {}
        for g in (1, 8):
            cfg = configs.with_meta(ran["triton_config"], GROUP_M=g)
            t[g] = bench_ms(lambda: onegemm.matmul(a, b, config=cfg))
        flop = 2.0 * M * N * K
        group_rows.append(dict(M=M, N=N, K=K, GROUP_M1_TFLOPs=tflops(flop, t[1]), GROUP_M8_TFLOPs=tflops(flop, t[8]),
                               speedup_of_GROUP_M8=t[1] / t[8]))

    big = [r for r in rows if r["M"] >= 1024]
    summary = []
    for dname in DTYPES:
        mine = [r for r in rows if r["dtype"] == dname]
        summary.append(dict(dtype=dname,
                            gpu_M_ge_1024=geomean([r["ratio"] for r in big if r["dtype"] == dname]),
                            gpu_all=geomean([r["ratio"] for r in mine]),
                            eager_all=geomean([r["eager_ratio"] for r in mine]),
                            heuristic_vs_ran=geomean([r["heuristic_vs_ran"] for r in mine])))
    text = header("onegemm.matmul vs cuBLAS (torch.matmul)")
    text += ("ratio = cuBLAS time / onegemm time in GPU time (> 1: onegemm faster); eager_ratio the same for "
             "Python calls timed by do_bench (host included). heuristic_vs_ran = time of the config that ran / "
             "time of the heuristic's config (< 1: the table's config is faster). B = W.t() of an nn.Linear weight.\n\n")
    text += "## Summary (geomean of ratios)\n\n" + markdown_table(summary) + "\n"
    text += "## Every shape\n\n" + markdown_table(rows) + "\n"
    text += "## GROUP_M (bf16, the config that ran forced with GROUP_M = 1 and 8)\n\n" + markdown_table(group_rows)
    write_results("matmul", text)
    labels = [f"{r['dtype']} {r['M']}x{r['N']}x{r['K']}" for r in rows]
    plot_ratios("matmul", labels, {"GPU time": [r["ratio"] for r in rows], "eager": [r["eager_ratio"] for r in rows]},
                "speed ratio (cuBLAS time / onegemm time)", "onegemm.matmul vs cuBLAS on H200")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes under the CPU interpreter, no timing")
    args = p.parse_args()
    if args.quick:
        run_quick()
    else:
        run_full()
