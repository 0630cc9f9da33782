"""FP8 block-scaled GEMM: onegemm.blockscaled_matmul (1x128 x 128x128) vs cuBLAS and DeepGEMM, speed and accuracy.

    python bench/bench_blockscaled.py           # on the H200: tables + bench/results/blockscaled.{md,png}
    python bench/bench_blockscaled.py --quick   # CPU interpreter: the same code path on tiny shapes
    # DeepGEMM's column needs `import deep_gemm` to work (else one line says why, and the column is
    # nan). Here, copy DeepGEMM (a checkout with its build.sh, from the peers folder named by
    # $ONEGEMM_PEERS) into the ignored .peers/, which travels with the working tree:
    mkdir -p .peers && cp -r "$ONEGEMM_PEERS/deepgemm" .peers/ && chmod -R u+w .peers/deepgemm
    # then on the GPU machine, from the checkout (build.sh writes .peers/deepgemm/dg_env.sh):
    bash .peers/deepgemm/build.sh > $OUT/dg_build.log 2>&1 && source .peers/deepgemm/dg_env.sh && python3 bench/bench_blockscaled.py

Inputs: x [M, K] and an nn.Linear-style weight W [N, K], random bf16. Each GEMM computes x @ W.T:
    onegemm       blockscaled_matmul(qx, qW.t(), sx, sW.t()): x 1x128, W 128x128 (DeepSeek-V3)
    Fp8Linear     onegemm.Fp8Linear on W: the per-call 1x128 quantisation of x + the GEMM
    cuBLAS-block  torch._scaled_mm blockwise, the same fp8 values and scales as onegemm
    cuBLAS-row    torch._scaled_mm row-wise (x per row, W per output channel)
    cuBLAS-tensor torch._scaled_mm tensor-wise
    cuBLAS-bf16   torch.matmul(x, W.t()) on the unquantised bf16 inputs
    DeepGEMM      deep_gemm.fp8_gemm_nt((qx, sx), (qW, sW), out): the same fp8 values and scales as
                  onegemm, bf16 out; sx put in DeepGEMM's TMA-aligned MN-major layout
                  (get_mn_major_tma_aligned_tensor) and out allocated outside the timed call; timed
                  only where its output matches onegemm's (calc_diff < 1e-3)
Shapes: square, LLM (four (N, K) pairs) and DeepSeek-V3's dense GEMMs, DeepGEMM's own targets
(4096x7168x16384, 4096x4096x7168, 4096x2112x7168, 8192x7168x2048 (listed as LLM),
2048x24576x1536; the summary's DeepSeek-V3 row).
Row-wise (x per row, W per output channel, the same fp8 values as cuBLAS-row), like for like:
    onegemm-row       blockscaled_matmul(..., use_fast_accum=False): fp32 promotion per K block,
                      against cuBLAS-row (torch._scaled_mm's default, which promotes too)
    onegemm-row-fast  use_fast_accum=True: the whole K in the tensor core's accumulator,
                      against cuBLAS-row-fast (torch._scaled_mm(..., use_fast_accum=True))
Speed: each ratio is the peer's time / onegemm's time (above 1: onegemm faster), in GPU time
(CUDA-graph replays); 'eager' columns time eager calls as a user makes them (host included), and
'first call ms' is onegemm's first call at the shape (plan, and a compile where the kernel's
specialisation is new). The quantisers' times are outside the GEMM timings (Fp8Linear's column
includes its activation one). On the H200, M >= 128 runs core's Gluon body (core/hopper_fp8.py).
Accuracy: calc_diff and SQNR of each output against the fp32 product of the unquantised bf16
inputs (first 1024 rows), and calc_diff of onegemm with K up to 16384.
Targets: >= 0.9x cuBLAS-block and >= 1.3x cuBLAS-bf16 at M >= 2048; calc_diff < 1e-3; row-wise
>= 1.05x torch._scaled_mm row-wise at M >= 2048.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import (bench_ms, config_of, differs, geomean, header, import_deepgemm, markdown_table, plot_ratios, run_or_reason,
                    tflops, update_summary, write_results)
from onegemm.testing import assert_close, blockscaled_matmul_ref, calc_diff, sqnr_db

LLM_NK = [(4096, 4096), (7168, 2048), (2112, 7168), (14336, 4096)]
SHAPES = [("square", s, s, s) for s in (1024, 2048, 4096, 8192)] + [
    ("LLM", m, n, k) for m in (16, 64, 128, 2048, 8192) for (n, k) in LLM_NK
]
# DeepSeek-V3's dense GEMMs (M, N, K), the shapes DeepGEMM is tuned for; those not above join SHAPES.
DEEPSEEK_V3 = [(4096, 7168, 16384), (4096, 4096, 7168), (4096, 2112, 7168), (8192, 7168, 2048), (2048, 24576, 1536)]
SHAPES += [("DeepSeek-V3", *mnk) for mnk in DEEPSEEK_V3 if mnk not in {s[1:] for s in SHAPES}]
QUICK_SHAPES = [("square", 128, 128, 128), ("LLM", 16, 160, 272), ("LLM", 70, 96, 300)]
K_SWEEP = [(512, 1024, k) for k in (1024, 4096, 16384)]
QUICK_K_SWEEP = [(32, 64, k) for k in (256, 640)]
ACC_ROWS = 1024  # accuracy on the first rows only: keeps the fp32 reference to a few hundred MB
PEERS = ["cuBLAS-block", "cuBLAS-row", "cuBLAS-tensor", "cuBLAS-bf16", "DeepGEMM"]
ROWWISE = [("onegemm-row", "cuBLAS-row"), ("onegemm-row-fast", "cuBLAS-row-fast")]  # (onegemm, its like-for-like peer)
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def _scaled_mm(qa, qb, sa, sb, fast=False):
    return torch._scaled_mm(qa, qb, scale_a=sa, scale_b=sb, out_dtype=BF16, use_fast_accum=fast)


def deepgemm_dense(dg, qx, sx, qw, sw):
    """DeepGEMM's fp8_gemm_nt on onegemm's quantised values, its inputs made here once: A = qx
    [M, K] with sx [M, K/128] in DeepGEMM's TMA-aligned MN-major layout (a view, no copy, when
    sx already is), B = qW [N, K] (K-major, the 'nt' form) with sW [N/128, K/128] contiguous,
    and the bf16 output D [M, N] that every call writes."""
    sx_dg = dg.get_mn_major_tma_aligned_tensor(sx)
    sw_dg = sw.contiguous()
    out = torch.empty(qx.shape[0], qw.shape[0], device=qx.device, dtype=BF16)

    def call():
        dg.fp8_gemm_nt((qx, sx_dg), (qw, sw_dg), out)
        return out
    return call


def make_gemms(x, w, dg=None):
    """{name: zero-argument callable returning x @ W.T in bf16}. Quantisation happens here,
    outside the timed calls. cuBLAS layouts (scale_a outer-dim-major, scale_b a
    transposed view of a contiguous [N/128, K/128]; row-wise scales contiguous). DeepGEMM
    (dg, the deep_gemm module) is None where it is not importable."""
    qx, sx = onegemm.quantize_fp8(x)  # 1x128, outer-dim-major scale (torch._scaled_mm's layout)
    qw, sw = onegemm.quantize_fp8(w, (128, 128))
    qx_r, sx_r = onegemm.quantize_fp8(x, "row")
    qw_r, sw_r = onegemm.quantize_fp8(w, "row")
    qx_t, sx_t = onegemm.quantize_fp8(x, "tensor")
    qw_t, sw_t = onegemm.quantize_fp8(w, "tensor")
    sw_r_t = sw_r.t().contiguous()
    layer = onegemm.Fp8Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=BF16)
    layer.weight, layer.weight_scale = qw, sw
    gemms = {
        "onegemm": lambda: onegemm.blockscaled_matmul(qx, qw.t(), sx, sw.t()),
        "Fp8Linear": lambda: layer(x),
        "cuBLAS-block": lambda: _scaled_mm(qx, qw.t(), sx, sw.t()),
        "cuBLAS-row": lambda: _scaled_mm(qx_r, qw_r.t(), sx_r, sw_r_t),
        "onegemm-row": lambda: onegemm.blockscaled_matmul(qx_r, qw_r.t(), sx_r, sw_r.t()),
        "cuBLAS-row-fast": lambda: _scaled_mm(qx_r, qw_r.t(), sx_r, sw_r_t, fast=True),
        "onegemm-row-fast": lambda: onegemm.blockscaled_matmul(qx_r, qw_r.t(), sx_r, sw_r.t(), use_fast_accum=True),
        "cuBLAS-tensor": lambda: _scaled_mm(qx_t, qw_t.t(), sx_t, sw_t),
        "cuBLAS-bf16": lambda: torch.matmul(x, w.t()),
        "DeepGEMM": deepgemm_dense(dg, qx, sx, qw, sw) if dg is not None else None,
    }
    return gemms, (qx, sx, qw, sw)


def measure(kind, M, N, K, device, timer, quick, dg=None):
    x = torch.randn(M, K, device=device, dtype=BF16)
    w = torch.randn(N, K, device=device, dtype=BF16)
    gemms, (qx, sx, qw, sw) = make_gemms(x, w, dg)
    r = min(M, ACC_ROWS)
    ref = x[:r].float() @ w.float().t()
    speed = dict(kind=kind, M=M, N=N, K=K)
    acc = dict(kind=kind, M=M, N=N, K=K)
    ms, ours = {}, None
    if not quick:
        torch.cuda.synchronize()
        start = time.perf_counter()
        gemms["onegemm"]()
        torch.cuda.synchronize()
        speed["first call ms"] = 1e3 * (time.perf_counter() - start)
    for name, fn in gemms.items():
        if fn is None:  # a peer that is not importable (said once, at the start)
            out, reason = None, None
        elif name.startswith(("onegemm", "Fp8Linear")):
            out, reason = fn(), None
        else:  # DeepGEMM is checked against onegemm's product of the same fp8 values and scales
            out, reason = run_or_reason(fn, (lambda o: differs(o, ours)) if name == "DeepGEMM" else None)
        if out is None:
            if reason:
                print(f"  {name} refused {M}x{N}x{K}: {reason}", flush=True)
            ms[name] = math.nan
            acc[f"calc_diff {name}"] = acc[f"SQNR dB {name}"] = "n/a"
            continue
        if name == "onegemm":
            ours = out
            # The kernel itself against float64 on the same fp8 values (the quick run's check).
            assert_close(out[:r], blockscaled_matmul_ref(qx[:r], qw.t(), sx[:r], sw.t(), (1, 128), (128, 128)), 1e-2)
            speed["tile"] = config_of(fn)
        ms[name] = timer(fn)
        acc[f"calc_diff {name}"] = calc_diff(out[:r], ref)
        acc[f"SQNR dB {name}"] = sqnr_db(out[:r], ref)
    speed["onegemm TFLOP/s"] = tflops(2.0 * M * N * K, ms["onegemm"])
    for peer in PEERS:
        speed[f"vs {peer}"] = ms[peer] / ms["onegemm"]
    speed["Fp8Linear vs cuBLAS-bf16"] = ms["cuBLAS-bf16"] / ms["Fp8Linear"]
    for ours, peer in ROWWISE:
        speed[f"{ours} TFLOP/s"] = tflops(2.0 * M * N * K, ms[ours])
        speed[f"{ours} vs {peer}"] = ms[peer] / ms[ours]
    if not quick:
        names = ("onegemm", "cuBLAS-block", "onegemm-row", "cuBLAS-row")
        eager = {name: bench_ms(gemms[name], warmup_ms=10, rep_ms=50, graph=False) for name in names}
        speed["eager us"] = 1e3 * eager["onegemm"]
        speed["eager vs cuBLAS-block"] = eager["cuBLAS-block"] / eager["onegemm"]
        speed["onegemm-row eager vs cuBLAS-row"] = eager["cuBLAS-row"] / eager["onegemm-row"]
    return speed, acc


def k_sweep(M, N, K, device, dg=None):
    x = torch.randn(M, K, device=device, dtype=BF16)
    w = torch.randn(N, K, device=device, dtype=BF16)
    gemms, _ = make_gemms(x, w, dg)
    ref = x.float() @ w.float().t()
    row = dict(M=M, N=N, K=K)
    for name in ["onegemm", "cuBLAS-block", "cuBLAS-row", "cuBLAS-tensor", "cuBLAS-bf16", "DeepGEMM"]:
        fn = gemms[name]
        out, _ = (fn(), None) if name == "onegemm" else (None, None) if fn is None else run_or_reason(fn)
        row[f"calc_diff {name}"] = "n/a" if out is None else calc_diff(out, ref)
    return row


def summarize(speed: list[dict]) -> list[dict]:
    out = []
    for group, sel in [
        ("all", speed),
        ("M >= 2048 (targets)", [r for r in speed if r["M"] >= 2048]),
        ("M <= 128", [r for r in speed if r["M"] <= 128]),
        ("DeepSeek-V3", [r for r in speed if (r["M"], r["N"], r["K"]) in DEEPSEEK_V3]),
    ]:
        row = dict(group=group, shapes=len(sel))
        for col in ([f"vs {p}" for p in PEERS] + ["Fp8Linear vs cuBLAS-bf16", "eager vs cuBLAS-block"]
                    + [f"{ours} vs {peer}" for ours, peer in ROWWISE] + ["onegemm-row eager vs cuBLAS-row"]):
            row[col] = geomean([r.get(col) for r in sel])
        out.append(row)
    return out


def report(speed, acc, sweep) -> str:
    text = header("FP8 block-scaled GEMM: onegemm.blockscaled_matmul vs torch._scaled_mm, bf16 cuBLAS and DeepGEMM")
    text += (
        __doc__.split("\n\n", 2)[2] + "\n"
        "Speed ratios are peer time / onegemm time (above 1: onegemm faster); 'tile' is the config "
        "onegemm's autotuner chose. 'nan' means the peer refused the shape (the reason is printed "
        "in the run's log) or, for DeepGEMM, that it was not importable (the log's first lines say why).\n\n"
    )
    text += "## Summary (geomean of ratios)\n\n" + markdown_table(summarize(speed)) + "\n"
    worst = max((v for r in acc for k, v in r.items() if k == "calc_diff onegemm"), default=math.nan)
    worst_k = max((r["calc_diff onegemm"] for r in sweep), default=math.nan)
    text += f"Largest onegemm calc_diff: {worst:.3g} over the shapes, {worst_k:.3g} in the K sweep (target < 1e-3).\n\n"
    text += (
        "## What the numbers say\n\n"
        "<!-- EXPLANATION: written by a person after reading this run's numbers. "
        "bench/bench_blockscaled.py regenerates everything else in this file. -->\n\n"
    )
    text += "## Speed, every shape\n\n" + markdown_table(speed) + "\n"
    text += "## Accuracy against the unquantised bf16 product (fp32), every shape\n\n" + markdown_table(acc, floatfmt=".3g") + "\n"
    text += "## calc_diff as K grows\n\n" + markdown_table(sweep) + "\n"
    return text


def run(quick: bool):
    device = "cpu" if quick else "cuda"

    def timer(fn):
        if quick:
            return math.nan  # the interpreter's time means nothing: the code path ran above
        return bench_ms(fn, warmup_ms=10, rep_ms=50)

    dg = import_deepgemm()
    speed, acc = [], []
    for kind, M, N, K in QUICK_SHAPES if quick else SHAPES:
        s, a = measure(kind, M, N, K, device, timer, quick, dg)
        speed.append(s)
        acc.append(a)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}, flush=True)
    sweep = [k_sweep(M, N, K, device, dg) for M, N, K in (QUICK_K_SWEEP if quick else K_SWEEP)]
    text = report(speed, acc, sweep)
    labels = [f"{r['kind']} {r['M']}x{r['N']}x{r['K']}" for r in speed]
    series = {f"vs {p}": [r[f"vs {p}"] for r in speed] for p in PEERS if p != "DeepGEMM" or dg is not None}
    print(markdown_table(summarize(speed)))
    print(markdown_table(acc))
    print(markdown_table(sweep))
    if quick:
        assert "## Speed, every shape" in text and all(len(v) == len(labels) for v in series.values())
        assert all(r["calc_diff onegemm"] < 1e-2 for r in acc + sweep)
        assert all("vs DeepGEMM" in r for r in speed) and "vs DeepGEMM" in summarize(speed)[0]
        assert dg is not None or all(r["calc_diff DeepGEMM"] == "n/a" for r in acc + sweep)
        print(f"quick: onegemm and Fp8Linear ran and matched the reference on {len(speed)} shapes; no files written")
        return
    write_results("blockscaled", text)
    groups = {g["group"]: g for g in summarize(speed)}
    figures = [
        dict(name="blockscaled_vs_cublas_blockwise_large_m", value=groups["M >= 2048 (targets)"]["vs cuBLAS-block"],
             peer="torch._scaled_mm blockwise 1x128 x 128x128 (cuBLAS), GPU time, M >= 2048"),
        dict(name="blockscaled_vs_cublas_blockwise_small_m", value=groups["M <= 128"]["vs cuBLAS-block"],
             peer="torch._scaled_mm blockwise 1x128 x 128x128 (cuBLAS), GPU time, M <= 128"),
        dict(name="rowwise_vs_scaled_mm", value=groups["M >= 2048 (targets)"]["onegemm-row vs cuBLAS-row"],
             peer="torch._scaled_mm row-wise (both promote per K block), GPU time, M >= 2048"),
        dict(name="rowwise_fast_accum_vs_scaled_mm", value=groups["M >= 2048 (targets)"]["onegemm-row-fast vs cuBLAS-row-fast"],
             peer="torch._scaled_mm row-wise use_fast_accum=True (both), GPU time, M >= 2048")]
    vs_deepgemm = groups["M >= 2048 (targets)"]["vs DeepGEMM"]
    if dg is not None and math.isfinite(vs_deepgemm):  # no figure from a run without DeepGEMM
        large = [r["vs DeepGEMM"] for r in speed if r["M"] >= 2048]
        timed = sum(math.isfinite(v) for v in large)
        peer = f"DeepGEMM {getattr(dg, '__version__', '?')} fp8_gemm_nt 1x128 x 128x128, bf16 out, GPU time, M >= 2048"
        peer += f" ({timed} of {len(large)} shapes; it refused the others)" if timed < len(large) else ""
        figures.append(dict(name="blockscaled_vs_deepgemm_large_m", value=vs_deepgemm, peer=peer))
    update_summary(figures)
    path = plot_ratios("blockscaled", labels, series, "speed-up (peer time / onegemm time)",
                       f"blockscaled_matmul (1x128 x 128x128) vs cuBLAS{' and DeepGEMM' if dg else ''} on "
                       f"{torch.cuda.get_device_name()}")
    print(f"wrote {path}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes under the CPU interpreter, no timing, no files")
    args = p.parse_args()
    if not args.quick and not torch.cuda.is_available():
        sys.exit("the benchmark needs a CUDA GPU; use --quick for the CPU code-path check")
    run(args.quick)
