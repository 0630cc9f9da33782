"""Grouped GEMM and MoE expert FFN: onegemm against torch, on real models' MoE shapes.

    python bench/bench_grouped.py           # on the H200: tables + bench/results/grouped.{md,png}
    python bench/bench_grouped.py --quick   # CPU interpreter: the same code path on tiny shapes,
                                            # correctness checks only (no timing, no files)

1. bf16 expert GEMMs, 2D x 3D with offs (the MoE forward), b = expert weights [E, N, K] read
   as a transposed view [E, K, N]:
     onegemm     onegemm.grouped_matmul(a, b, offs)
     grouped_mm  torch._grouped_mm(a, b, offs=offs) (CUTLASS)
     mm-loop     one torch.mm per expert (group sizes read on the host outside the timing)
   Models: Qwen3-30B-A3B (E=128, H=2048, I=768), Mixtral-8x7B (E=8, H=4096, I=14336),
   DeepSeek-V3 EP8-local (E=32, H=7168, I=2048); gate_up (N=2I, K=H) and down (N=H, K=I);
   decode (64 and 512 rows) and prefill (4K and 32K rows; Mixtral 4K and 8K); uniform routing
   (rows spread evenly) and skewed routing (Zipf s=1.2 over the experts: a few experts get most
   rows, many get none). Decode is memory-bound: also reported as TB/s of the weight bytes of
   the experts that got rows.
2. fp16: onegemm against torch._grouped_mm's fp16 path (a host-synced loop in torch 2.11).
3. moe_ffn end to end (routing given) against the plain-torch implementation
   (onegemm.testing.moe_ffn_torch with torch._grouped_mm: permuted copy of x, two grouped
   GEMMs, SwiGLU, index_add combine).
Every ratio is the peer's time / onegemm's time, measured in the same run (above 1: onegemm
is faster). Targets: geomean >= 1.0x torch._grouped_mm on the prefill shapes, decode
at >= 3.1 TB/s of weight bandwidth, fp16 >= 2x torch's fp16 path.
"""

from __future__ import annotations

import argparse
import sys

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import bench_ms, config_of, geomean, header, markdown_table, plot_ratios, tflops, write_results
from onegemm.testing import assert_close, grouped_mm_ref, moe_ffn_torch, moe_ref

# name: (E, H, I, top_k, decode rows, prefill rows)
MODELS = {
    "Qwen3-30B-A3B": (128, 2048, 768, 8, (64, 512), (4096, 32768)),
    "Mixtral-8x7B": (8, 4096, 14336, 2, (64, 512), (4096, 8192)),
    "DeepSeek-V3-EP8": (32, 7168, 2048, 8, (64, 512), (4096, 32768)),
}
QUICK_MODELS = {
    "tiny-many-experts": (16, 64, 48, 4, (8, 40), (150,)),
    "tiny-few-experts": (4, 96, 80, 2, (5,), (120,)),
}
FP16_CASES = [("Qwen3-30B-A3B", "gate_up", 512), ("Qwen3-30B-A3B", "gate_up", 4096), ("Qwen3-30B-A3B", "down", 4096),
              ("Mixtral-8x7B", "gate_up", 4096), ("DeepSeek-V3-EP8", "down", 4096)]
QUICK_FP16_CASES = [("tiny-many-experts", "gate_up", 40), ("tiny-few-experts", "down", 120)]
MOE_CASES = [("Qwen3-30B-A3B", 64), ("Qwen3-30B-A3B", 4096), ("Mixtral-8x7B", 64), ("Mixtral-8x7B", 4096),
             ("DeepSeek-V3-EP8", 64), ("DeepSeek-V3-EP8", 4096)]
QUICK_MOE_CASES = [("tiny-many-experts", 10), ("tiny-few-experts", 30)]
ROUTINGS = ("uniform", "skewed")


def group_sizes(rows: int, E: int, routing: str, gen: torch.Generator) -> list[int]:
    """Rows per expert. uniform: as even as possible; skewed: Zipf(1.2) over a random order."""
    if routing == "uniform":
        sizes = [rows // E] * E
        for e in torch.randperm(E, generator=gen)[: rows % E].tolist():
            sizes[e] += 1
        return sizes
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p = p[torch.randperm(E, generator=gen)]
    return torch.bincount(torch.multinomial(p, rows, replacement=True, generator=gen), minlength=E).tolist()


def gemm_shape(model: dict, name: str, which: str):
    E, H, I = model[name][:3]
    return (E, 2 * I, H) if which == "gate_up" else (E, H, I)  # (E, N, K)


def make_problem(E, N, K, sizes, dtype, device):
    a = torch.randn(sum(sizes), K, device=device).to(dtype)
    w = (torch.randn(E, N, K, device=device) * K**-0.5).to(dtype)  # [E, N, K], as stored
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return a, w.transpose(1, 2), offs


def peers(a, b, offs, sizes):
    ends = torch.tensor(sizes).cumsum(0).tolist()  # host copy made once, outside the timing
    spans = [(s, e, g) for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)) if e > s]

    def mm_loop():
        out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
        for s, e, g in spans:
            torch.mm(a[s:e], b[g], out=out[s:e])
        return out

    return {
        "onegemm": lambda: onegemm.grouped_matmul(a, b, offs),
        "grouped_mm": lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=a.dtype),
        "mm-loop": mm_loop,
    }


def check(fns, a, b, offs, quick):
    """onegemm against float64 (quick, small) or against each peer (GPU, large: the peers are
    the reference there; a float64 product of these sizes would take longer than the bench)."""
    out = fns["onegemm"]()
    if quick:
        assert_close(out, grouped_mm_ref(a, b, offs), 2e-2, "onegemm vs float64")
        for name in ("grouped_mm", "mm-loop"):
            assert_close(fns[name](), grouped_mm_ref(a, b, offs), 2e-2, f"{name} vs float64")
    else:
        assert_close(out, fns["grouped_mm"]().float(), 2e-2, "onegemm vs torch._grouped_mm")


def bench_bf16(models, quick, gen, device):
    rows_out = []
    for name, (E, H, I, k, decode, prefill) in models.items():
        for which in ("gate_up", "down"):
            _, N, K = gemm_shape(models, name, which)
            for phase, rows_list in (("decode", decode), ("prefill", prefill)):
                for rows in rows_list:
                    for routing in ROUTINGS:
                        sizes = group_sizes(rows, E, routing, gen)
                        a, b, offs = make_problem(E, N, K, sizes, torch.bfloat16, device)
                        fns = peers(a, b, offs, sizes)
                        check(fns, a, b, offs, quick)
                        row = dict(model=name, gemm=which, phase=phase, rows=rows, routing=routing, N=N, K=K)
                        if not quick:
                            ms = {p: bench_ms(f, warmup_ms=10, rep_ms=60) for p, f in fns.items()}
                            row["tile"] = config_of(fns["onegemm"])
                            flop = 2 * rows * N * K
                            weight_bytes = sum(1 for s in sizes if s) * N * K * 2
                            row.update(
                                onegemm_tflops=tflops(flop, ms["onegemm"]),
                                vs_grouped_mm=ms["grouped_mm"] / ms["onegemm"],
                                vs_mm_loop=ms["mm-loop"] / ms["onegemm"],
                                weight_TBps=weight_bytes / (ms["onegemm"] * 1e-3) / 1e12,
                                grouped_mm_TBps=weight_bytes / (ms["grouped_mm"] * 1e-3) / 1e12,
                            )
                            print(" ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
                        rows_out.append(row)
                        del a, b, offs, fns
    return rows_out


def bench_fp16(models, cases, quick, gen, device):
    out = []
    for name, which, rows in cases:
        E, N, K = gemm_shape(models, name, which)
        sizes = group_sizes(rows, E, "uniform", gen)
        a, b, offs = make_problem(E, N, K, sizes, torch.float16, device)
        one = lambda: onegemm.grouped_matmul(a, b, offs)  # noqa: E731
        peer = lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.float16)  # noqa: E731
        if quick:
            assert_close(one(), grouped_mm_ref(a, b, offs), 1e-3, "fp16 onegemm vs float64")
        else:
            assert_close(one(), peer().float(), 1e-2, "fp16 onegemm vs torch")
        row = dict(model=name, gemm=which, rows=rows, N=N, K=K)
        if not quick:
            t1, t2 = bench_ms(one, 10, 60), bench_ms(peer, 10, 60)
            row.update(onegemm_tflops=tflops(2 * rows * N * K, t1), torch_fp16_tflops=tflops(2 * rows * N * K, t2), vs_torch_fp16=t2 / t1)
            print(row, flush=True)
        out.append(row)
    return out


def bench_moe(models, cases, quick, device):
    out = []
    for name, T in cases:
        E, H, I, k = models[name][:4]
        x = torch.randn(T, H, device=device).to(torch.bfloat16)
        w_gate_up = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(torch.bfloat16)
        w_down = (torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16)
        weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
        one = lambda: onegemm.moe_ffn(x, w_gate_up, w_down, weights, ids)  # noqa: E731
        peer = lambda: moe_ffn_torch(x, w_gate_up, w_down, weights, ids, use_grouped_mm=True)  # noqa: E731
        y = one()
        if quick:
            assert_close(y, moe_ref(x, w_gate_up, w_down, weights, ids), 2e-2, "moe_ffn vs float64")
            assert_close(peer(), moe_ref(x, w_gate_up, w_down, weights, ids), 2e-2, "torch moe vs float64")
        else:
            assert_close(y, peer().float(), 2e-2, "moe_ffn vs torch")
        assert torch.equal(one(), y), "moe_ffn is not deterministic"
        row = dict(model=name, tokens=T, top_k=k, E=E, H=H, I=I)
        if not quick:
            t1, t2 = bench_ms(one, 10, 60), bench_ms(peer, 10, 60)
            flop = 2 * T * k * 3 * H * I
            row.update(onegemm_ms=t1, torch_ms=t2, onegemm_tflops=tflops(flop, t1), vs_torch=t2 / t1)
            print(row, flush=True)
        out.append(row)
        del x, w_gate_up, w_down
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes under the CPU interpreter, checks only")
    args = parser.parse_args()
    quick = args.quick
    if not quick and onegemm.INTERPRET:
        sys.exit("the benchmark needs a CUDA GPU (use --quick for the CPU interpreter check)")
    device = "cpu" if onegemm.INTERPRET else "cuda"
    models = QUICK_MODELS if quick else MODELS
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)

    bf16 = bench_bf16(models, quick, gen, device)
    fp16 = bench_fp16(models, QUICK_FP16_CASES if quick else FP16_CASES, quick, gen, device)
    moe = bench_moe(models, QUICK_MOE_CASES if quick else MOE_CASES, quick, device)
    if quick:
        print(f"quick: {len(bf16)} bf16 cases, {len(fp16)} fp16 cases, {len(moe)} moe_ffn cases: all checks passed")
        return

    prefill = [r["vs_grouped_mm"] for r in bf16 if r["phase"] == "prefill"]
    decode_tbps = [r["weight_TBps"] for r in bf16 if r["phase"] == "decode" and r["rows"] == max(r2["rows"] for r2 in bf16 if r2["phase"] == "decode")]
    summary = [
        dict(target="prefill geomean vs torch._grouped_mm >= 1.0x", measured=geomean(prefill)),
        dict(target="decode (512 rows) weight bandwidth >= 3.1 TB/s (geomean)", measured=geomean(decode_tbps)),
        dict(target="decode (512 rows) weight bandwidth, worst case", measured=min(decode_tbps)),
        dict(target="fp16 geomean vs torch's fp16 path >= 2x", measured=geomean([r["vs_torch_fp16"] for r in fp16])),
        dict(target="moe_ffn end to end vs torch, geomean", measured=geomean([r["vs_torch"] for r in moe])),
        dict(target="bf16 geomean vs per-expert torch.mm loop (all cases)", measured=geomean([r["vs_mm_loop"] for r in bf16])),
    ]
    text = header("Grouped GEMM and MoE expert FFN: onegemm vs torch")
    text += "Ratios are the peer's time / onegemm's time in the same run (above 1: onegemm faster).\n\n"
    text += "## Summary\n\n" + markdown_table(summary)
    text += (
        "\n## What the numbers say\n\n"
        "<!-- EXPLANATION: written by a person after reading this run's numbers. "
        "bench/bench_grouped.py regenerates everything else in this file. -->\n"
    )
    text += "\n## bf16 expert GEMMs (2D x 3D, offs over rows)\n\n" + markdown_table(bf16)
    text += "\n## fp16 (torch._grouped_mm's fp16 path is a host-synced loop)\n\n" + markdown_table(fp16)
    text += "\n## moe_ffn end to end (routing given) vs plain torch with torch._grouped_mm\n\n" + markdown_table(moe)
    write_results("grouped", text)
    labels = [f"{r['model'][:6]} {r['gemm']} {r['rows']} {r['routing'][:4]}" for r in bf16]
    plot_ratios(
        "grouped", labels,
        {"vs torch._grouped_mm": [r["vs_grouped_mm"] for r in bf16], "vs torch.mm loop": [r["vs_mm_loop"] for r in bf16]},
        ylabel="speed-up (peer time / onegemm time)",
        title="onegemm.grouped_matmul bf16 on MoE expert GEMMs (H200)",
    )


if __name__ == "__main__":
    main()
