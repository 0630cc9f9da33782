"""The seed's exercise measured: GROUP_M = 1 against 8, L2 hit rate next to the time ratio.

    python bench/bench_l2.py      # on the H200 with Nsight Compute: bench/results/l2.md

Grouped program order (GROUP_M rows of tiles walked column by column) exists so that tiles
running at the same time share their A rows and B columns in L2. For each shape, the config
onegemm.matmul runs is forced with GROUP_M = 1 and 8; GPU time comes from CUDA-graph replays
in this process, and the L2 hit rate from ncu's ``lts__t_sector_hit_rate.pct`` of the same
launch in a child process (``--child``), profiled once with ``--clock-control none`` and
ncu's default cache control (L2 flushed before the kernel, so both orders start cold).
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import bench_ms, header, markdown_table, require_gpu, tflops, write_results
from onegemm import testing
from onegemm.core import configs

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 14336, 4096)]


def forced(M, N, K, group_m):
    """(call, config): onegemm.matmul on bf16 operands (b = W.t()) with the config that runs
    unforced, GROUP_M replaced."""
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    (ran,) = testing.launched(lambda: onegemm.matmul(a, b))
    cfg = configs.with_meta(ran["triton_config"], GROUP_M=group_m)
    return (lambda: onegemm.matmul(a, b, config=cfg)), cfg


def child(M, N, K, group_m):
    call, _ = forced(M, N, K, group_m)
    call()  # compiles (ncu skips this launch and testing.launched's)
    call()
    torch.cuda.synchronize()


def hit_rate(M, N, K, group_m) -> float:
    """ncu's L2 sector hit rate (%) of the forced matmul kernel's second launch."""
    cmd = ["ncu", "--clock-control", "none", "--metrics", "lts__t_sector_hit_rate.pct", "--kernel-name", "regex:matmul",
           "--launch-skip", "2", "--launch-count", "1", "--csv", sys.executable, __file__, "--child",
           str(M), str(N), str(K), str(group_m)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = [r for r in csv.DictReader(io.StringIO(out[out.index('"ID"'):])) if r["Metric Name"].startswith("lts__")]
    return float(rows[0]["Metric Value"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=4, type=int, metavar=("M", "N", "K", "GROUP_M"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    require_gpu()
    if shutil.which("ncu") is None:
        raise SystemExit("needs Nsight Compute (ncu) on PATH")
    rows = []
    for M, N, K in SHAPES:
        row = dict(M=M, N=N, K=K)
        ms = {}
        for g in (1, 8):
            call, cfg = forced(M, N, K, g)
            ms[g] = bench_ms(call)
            row[f"GROUP_M{g}_TFLOPs"] = tflops(2.0 * M * N * K, ms[g])
            row[f"GROUP_M{g}_L2_hit_pct"] = hit_rate(M, N, K, g)
        row["speedup_of_GROUP_M8"] = ms[1] / ms[8]
        row["config"] = configs.label(cfg)
        rows.append(row)
        print(row, flush=True)
        # written after every shape: a run stopped at a time limit keeps what it measured
        text = header("GROUP_M 1 against 8: L2 hit rate and time (bf16 matmul, b = W.t())")
        text += ("L2 hit rate: ncu `lts__t_sector_hit_rate.pct` of one launch (`--clock-control none`, L2 flushed "
                 "before it); time: GPU time of the same call. The config is what onegemm.matmul runs for the shape, "
                 "with GROUP_M forced.\n\n" + markdown_table(rows) + "\n")
        write_results("l2", text)


if __name__ == "__main__":
    main()
