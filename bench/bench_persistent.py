"""Persistent vs launch-per-tile scheduling of the same core GEMM, in both load flavours.

    python bench/bench_persistent.py                # on the H200: table + bench/results/persistent.{md,png}
    python bench/bench_persistent.py --dtype fp16   # the same sweep in fp16 (persistent_fp16.{md,png})
    python bench/bench_persistent.py --quick        # CPU interpreter: the same code path on tiny shapes
    python bench/bench_persistent.py --default-configs   # what a call picks (table / heuristic), no
                                                         # autotuning: minutes, not an hour (persistent_default.md)

Five GEMMs on the same inputs (A [M, K] row-major, B = W.t() of an nn.Linear weight [N, K]):
    lpt_ptr   onegemm.matmul, one program per tile, pointer loads   (tma=False, persistent=False)
    lpt_tma   onegemm.matmul, one program per tile, TMA loads       (tma=True, persistent=False)
    pers_ptr  onegemm.persistent_matmul, one program per SM (two for small tiles), pointer loads
    pers_tma  onegemm.persistent_matmul, one program per SM (two for small tiles), TMA loads
    cuBLAS    torch.matmul
Both schedules are autotuned (onegemm.autotune: every candidate timed in GPU time, the winner
kept in the user's tuning cache) over the same tiles and run the same tile body, so
pers_x / lpt_x is the scheduling effect alone (the chosen tile shapes are printed). With
--default-configs each call runs the config it gets without autotuning (the shipped table's
or the heuristic's): what a user sees by default.

Sweep: square 512..8192; small-M LLM linears (M 16..256, (N, K) of bench_matmul.py); K in
{512, 1024, 8192} at 4096 x 4096 (4096 is in the square set); and "wave tail" shapes whose
tile count is just past a multiple of the 132 SMs (133 and 265 tiles of 128 x 256; 136/272 for
128 x 128) next to one with exactly 132.
"""

from __future__ import annotations

import argparse
import math
import sys

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
import triton
from common import bench_ms, geomean, header, markdown_table, plot_ratios, tflops, update_summary, write_results
from onegemm import testing
from onegemm.core import configs
from onegemm.testing import TOL, assert_close, matmul_ref, rel_err

SM_COUNT = 132  # H200; the table's "waves" column uses the real count when a GPU is present
LLM_NK = [(4096, 4096), (14336, 4096), (4096, 14336)]
SHAPES = (
    [("square", s, s, s) for s in (512, 1024, 2048, 4096, 8192)]
    + [("small-M", m, n, k) for m in (16, 64, 256) for (n, k) in LLM_NK]
    + [("K sweep", 4096, 4096, k) for k in (512, 1024, 8192)]
    + [
        ("wave tail", 1536, 2816, 4096),  # 12 x 11 = 132 tiles of 128 x 256: exactly one wave
        ("wave tail", 896, 4864, 4096),  # 7 x 19 = 133 tiles of 128 x 256 (266 of 128 x 128)
        ("wave tail", 1024, 4352, 4096),  # 136 tiles of 128 x 256 or 256 x 128; 272 of 128 x 128
        ("wave tail", 640, 13568, 4096),  # 5 x 53 = 265 tiles of 128 x 256
    ]
)
QUICK_SHAPES = [("square", 64, 64, 64), ("small-M", 16, 96, 80), ("wave tail", 96, 160, 48)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

VARIANTS = {
    "lpt_ptr": lambda a, b, **kw: onegemm.matmul(a, b, tma=False, persistent=False, **kw),
    "lpt_tma": lambda a, b, **kw: onegemm.matmul(a, b, tma=True, persistent=False, **kw),
    "pers_ptr": lambda a, b, **kw: onegemm.persistent_matmul(a, b, tma=False, **kw),
    "pers_tma": lambda a, b, **kw: onegemm.persistent_matmul(a, b, tma=True, **kw),
}
# (numerator, denominator): the ratio columns, each "denominator time / numerator time".
RATIOS = [
    ("pers_ptr", "lpt_ptr"),
    ("pers_tma", "lpt_tma"),
    ("lpt_ptr", "cuBLAS"),
    ("lpt_tma", "cuBLAS"),
    ("pers_ptr", "cuBLAS"),
    ("pers_tma", "cuBLAS"),
]


def operands(M, N, K, dtype, device):
    a = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
    return a, w.t()


def cfg_name(cfg: triton.Config) -> str:
    return configs.label(cfg)


def tiles_of(M, N, cfg: triton.Config) -> int:
    k = cfg.kwargs
    return triton.cdiv(M, k["BLOCK_M"]) * triton.cdiv(N, k["BLOCK_N"])


def ratio_name(num: str, den: str) -> str:
    return f"{num}/{den}"


def measure(kind, M, N, K, dtype, device, timer, autotuned=True) -> dict:
    """One shape: every variant checked against the reference, then timed by ``timer``."""
    a, b = operands(M, N, K, dtype, device)
    ref = torch.matmul(a, b) if device == "cuda" else matmul_ref(a, b)
    ms, chosen, err = {}, {}, 0.0
    for name, fn in VARIANTS.items():
        with onegemm.autotune(device == "cuda" and autotuned):
            (ran,) = testing.launched(lambda: fn(a, b))  # the first call autotunes (if it may)
        out = fn(a, b)
        # Same inputs, fp32 accumulation everywhere: outputs differ from cuBLAS by rounding only.
        assert_close(out, ref, TOL[dtype], f"{name} {M}x{N}x{K}")
        err = max(err, rel_err(out, ref))
        ms[name] = timer(lambda: fn(a, b))
        chosen[name] = ran["triton_config"]  # both ops run core's matmul_kernel
    ms["cuBLAS"] = timer(lambda: torch.matmul(a, b))
    flop = 2.0 * M * N * K
    tiles = tiles_of(M, N, chosen["pers_tma"])
    row = dict(kind=kind, M=M, N=N, K=K, tiles=tiles, waves=tiles / sm_count(), cuBLAS_TFLOPs=tflops(flop, ms["cuBLAS"]))
    row["pers_tma_TFLOPs"] = tflops(flop, ms["pers_tma"])
    for num, den in RATIOS:
        row[ratio_name(num, den)] = ms[den] / ms[num]
    row["max_err_vs_cuBLAS"] = err
    row["cfg lpt_ptr / pers_ptr"] = f"{cfg_name(chosen['lpt_ptr'])} / {cfg_name(chosen['pers_ptr'])}"
    row["cfg lpt_tma / pers_tma"] = f"{cfg_name(chosen['lpt_tma'])} / {cfg_name(chosen['pers_tma'])}"
    return row


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else SM_COUNT


def summarize(rows: list[dict]) -> list[dict]:
    groups = ["all"] + sorted({r["kind"] for r in rows}) + ["square 4096-8192"]
    out = []
    for g in groups:
        if g == "all":
            sel = rows
        elif g == "square 4096-8192":
            sel = [r for r in rows if r["kind"] == "square" and r["M"] >= 4096]
        else:
            sel = [r for r in rows if r["kind"] == g]
        out.append(dict(group=g, shapes=len(sel), **{ratio_name(n, d): geomean([r[ratio_name(n, d)] for r in sel]) for n, d in RATIOS}))
    return out


def report(dname: str, rows: list[dict], autotuned: bool = True) -> str:
    summary = summarize(rows)
    configs_said = ("both schedules are autotuned over the same tiles (persistent also at two per SM)" if autotuned else
                    "each call runs the config it gets without autotuning (the shipped table's or the heuristic's)")
    text = header(f"Persistent vs launch-per-tile GEMM ({dname}), pointer and TMA loads, vs cuBLAS")
    text += (
        "Each ratio column X/Y is Y's time / X's time: above 1, X is faster. lpt = launch-per-tile "
        "(onegemm.matmul with persistent=False), pers = onegemm.persistent_matmul (one program per "
        f"SM, or two for a '2/SM' config), _ptr / _tma = pointer / tensor-descriptor loads; {configs_said}; "
        "both run the same "
        "kernel, core's matmul_kernel, with its PERSISTENT switch off or on. tiles and waves "
        "(tiles / SMs) are for pers_tma's chosen tile shape. "
        "B = W.t() of an nn.Linear weight.\n\n"
        "Targets: pers_ptr/lpt_ptr geomean over the sweep >= 1.0; pers_tma/cuBLAS >= 1.0 at "
        "4096-8192 square.\n\n"
    )
    text += "## Summary (geomean of ratios)\n\n" + markdown_table(summary) + "\n"
    text += (
        "## What the numbers say\n\n"
        "<!-- EXPLANATION: written by a person after reading this run's numbers (where persistence wins or "
        "loses, and why). bench/bench_persistent.py regenerates everything else in this file. -->\n\n"
    )
    text += "## Every shape\n\n" + markdown_table(rows) + "\n"
    return text


def run(quick: bool, dname: str, autotuned: bool = True):
    dtype = DTYPES[dname]
    device = "cpu" if quick else "cuda"

    def timer(fn):
        if quick:
            fn()  # the interpreter's time means nothing: run the code path, report no number
            return math.nan
        return bench_ms(fn, warmup_ms=10, rep_ms=50)

    rows = []
    for kind, M, N, K in QUICK_SHAPES if quick else SHAPES:
        rows.append(measure(kind, M, N, K, dtype, device, timer, autotuned))
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    text = report(dname, rows, autotuned)
    labels = [f"{r['kind']} {r['M']}x{r['N']}x{r['K']}" for r in rows]
    plotted = ("pers_ptr/lpt_ptr", "pers_tma/lpt_tma", "lpt_tma/cuBLAS", "pers_tma/cuBLAS")
    series = {k: [r[k] for r in rows] for k in plotted}
    print("\nGeomeans the explanation needs (ratio X/Y > 1: X faster):")
    print(markdown_table(summarize(rows)))
    if quick:
        assert "## Every shape" in text and len(labels) == len(series["pers_tma/cuBLAS"])
        print(f"quick: every variant ran and matched the reference ({len(rows)} shapes); no files written")
        return
    name = ("persistent" if dname == "bf16" else f"persistent_{dname}") + ("" if autotuned else "_default")
    write_results(name, text)
    path = plot_ratios(name, labels, series, "speed ratio X/Y (Y time / X time)",
                       f"persistent vs launch-per-tile ({dname}) on {torch.cuda.get_device_name()}")
    print(f"wrote {path}")
    if dname == "bf16":
        how = "both autotuned" if autotuned else "each with the config a call gets (table / heuristic)"
        update_summary([dict(name="persistent_vs_launch_per_tile", value=summarize(rows)[0]["pers_tma/lpt_tma"],
                             peer=f"onegemm.matmul launch-per-tile (TMA), GPU time, geomean over bench_persistent's "
                                  f"shapes, {how}")])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes under the CPU interpreter, no timing, no files")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--default-configs", action="store_true",
                   help="no autotuning: each call runs the shipped table's or the heuristic's config")
    args = p.parse_args()
    if not args.quick and not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU; use --quick for the CPU code-path check")
    run(args.quick, args.dtype, not args.default_configs)
