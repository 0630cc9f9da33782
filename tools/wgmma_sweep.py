"""Every candidate config of core's Gluon FP8 body, timed on the H200, per K loop.

    python tools/wgmma_sweep.py            # markdown tables on stdout (GPU time, TFLOP/s)
    python tools/wgmma_sweep.py --peer M N K   # torch._scaled_mm row-wise on one shape (a process of its own)
    python tools/wgmma_sweep.py --tall     # 256 x 128 tiles against 128 x 128 and DeepGEMM, dense and grouped

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
from pathlib import Path

import torch
from triton.testing import do_bench

import onegemm
from onegemm.core import configs
from onegemm.core.hopper_configs import WgmmaKey, wgmma_candidates
from onegemm.core.scaling import Scaling
from onegemm.testing import graph_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench_moe's shapes, common's peers

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
        cells = (r["tflops"].get(n, "-") for r in rows)
        text += f"| {n} | " + " | ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in cells) + " |\n"
    return text + "\n"


def peer(M, N, K):
    qa, sa, qb, sb = inputs(M, N, K, "row", "row")
    sb = sb.contiguous()
    out = {}
    for fast in (False, True):
        out[fast] = tflops(M, N, K, do_bench(lambda: torch._scaled_mm(qa, qb, sa, sb, out_dtype=torch.bfloat16,
                                                                       use_fast_accum=fast)))
    print(f"| {M}x{N}x{K} | {out[False]:.0f} | {out[True]:.0f} |", flush=True)


def _tall_dense_cfgs():
    from onegemm.core.hopper_configs import tall_cfg, wgmma_cfg
    return {"128x128 s6 kg3": wgmma_cfg(128, 6, 3), "256x128 s3 r232/40": wgmma_cfg(128, 3, 1, bm=256),
            "256x128 s3 r224/56": tall_cfg(3)}


TALL_SHAPES = [(4096, 7168, 16384), (4096, 4096, 7168), (4096, 2112, 7168), (8192, 7168, 2048), (2048, 24576, 1536),
               (8192, 8192, 8192)]


def _timed(fn, like, tol, M, N, K):
    """TFLOP/s of fn in GPU time, or why not: its output must match ``like`` (calc_diff < tol)."""
    from onegemm.testing import calc_diff
    try:
        d = calc_diff(fn(), like)
        return tflops(M, N, K, graph_bench(fn)) if d < tol else f"differs ({d:.1e})"
    except Exception as e:  # noqa: BLE001 - a config or peer that fails is a table entry
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"


def tall(dg):
    """The 256 x 128 tiles (hopper_configs.tall_cfg and the 232 / 40 split) against 128 x 128 and
    DeepGEMM on the same fp8 values: dense per scaling of A, then the grouped flavour on
    bench_moe.py's prefill expert GEMMs (DeepGEMM: m_grouped contiguous on its padded layout)."""
    import bench_moe
    from onegemm.core.hopper_configs import tall_cfg, wgmma_cfg
    from onegemm.core.scaling import BLOCKWISE
    from onegemm.grouped.ops import row_tiles
    from onegemm.grouped.wgmma import run_wgmma_grouped
    cfgs, rows = _tall_dense_cfgs(), []
    for M, N, K in TALL_SHAPES:
        x, w = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
        for kind in ("1x128", "128x128", "row"):
            qx, sx = onegemm.quantize_fp8(x, {"1x128": (1, 128), "128x128": (128, 128)}.get(kind, kind))
            qw, sw = onegemm.quantize_fp8(w, "row" if kind == "row" else (128, 128))
            ref = onegemm.blockscaled_matmul(qx, qw.t(), sx, sw.t())
            row = dict(shape=f"{M}x{N}x{K} {kind}", tflops={
                "default": _timed(lambda: onegemm.blockscaled_matmul(qx, qw.t(), sx, sw.t()), ref, 1e-5, M, N, K)})
            for name, c in cfgs.items():
                row["tflops"][name] = _timed(lambda: onegemm.blockscaled_matmul(qx, qw.t(), sx, sw.t(), config=c), ref,
                                             1e-5, M, N, K)
            if dg is not None and kind == "1x128":
                sx_dg, sw_dg = dg.get_mn_major_tma_aligned_tensor(sx), sw.contiguous()
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                row["tflops"]["DeepGEMM"] = _timed(lambda: dg.fp8_gemm_nt((qx, sx_dg), (qw, sw_dg), out) or out, ref,
                                                   1e-3, M, N, K)
            rows.append(row)
            print(row, flush=True)
    print(table("dense: 128 x 128 and 256 x 128 tiles, scale_a as named x 128x128 (row: x col) (TFLOP/s)", rows),
          flush=True)
    gcfgs, grows = {"128x128 s6 kg3": wgmma_cfg(128, 6, 3), "256x128 s3": tall_cfg(3), "256x128 s4": tall_cfg(4)}, []
    for name, E, N, K, M in bench_moe.SHAPES:
        x, w, offs = bench_moe.inputs(E, N, K, M, "cuda")
        qa, sa, qw, sw = bench_moe.quantize_blocks(x, w)
        grouped = lambda: onegemm.grouped_matmul(qa, qw.transpose(1, 2), offs, scale_a=sa, scale_b=sw.transpose(1, 2))  # noqa: E731
        ref = grouped()
        row = dict(shape=name, tflops={"default": _timed(grouped, ref, 1e-5, M, N, K)})
        key = WgmmaKey(configs.m_bucket(M // E), N, K, BLOCKWISE, "bf16", "grouped")
        for cname, c in gcfgs.items():
            def forced(c=c):
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                run_wgmma_grouped(qa, qw, out, lambda bm: row_tiles(offs, E, M, bm), sa, sw.transpose(1, 2), N=N,
                                  key=key, config=c)
                return out
            row["tflops"][cname] = _timed(forced, ref, 1e-5, M, N, K)
        if dg is not None:
            call, real = bench_moe.deepgemm_contiguous(dg, qa, sa, qw, sw, offs)
            checked = _timed(lambda: real(call()), ref, 1e-3, M, N, K)
            # timed: its kernel alone, not the gather of its real rows
            row["tflops"]["DeepGEMM"] = tflops(M, N, K, graph_bench(call)) if isinstance(checked, float) else checked
        grows.append(row)
        print(row, flush=True)
    print(table("grouped (prefill expert GEMMs, 1x128 x 128x128; TFLOP/s of real rows)", grows), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", nargs=3, type=int, metavar=("M", "N", "K"))
    p.add_argument("--tall", action="store_true", help="256 x 128 tiles vs 128 x 128 and DeepGEMM (ONEGEMM_PEERS' build)")
    args = p.parse_args()
    if args.peer:
        return peer(*args.peer)
    if args.tall:
        from common import import_deepgemm
        return tall(import_deepgemm())
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
