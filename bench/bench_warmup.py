"""The first call at a new token count, with and without MoEFFN.warmup, each in a fresh process.

    python bench/bench_warmup.py           # H200: bench/results/warmup.md and summary.json
    python bench/bench_warmup.py --quick   # CPU interpreter: one tiny case, checked, no files

Qwen3-30B-A3B's layer (E = 128, H = 2048, I = 768, top-8) in bf16 and FP8 (quantize_experts of
the same weights), random weights. Each case runs in a process of its own with an empty Triton
cache directory (nothing compiled on disk): "cold" makes a first call at T = 64, then times
the first call at each new T of NEW_T (host included, synchronised); "warm" runs
layer.warmup(MAX_TOKENS) first (its time reported), then times the same calls. Target (issue
44): <= 50 ms for a first call at a new T after warmup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

QWEN3 = dict(E=128, H=2048, I=768, k=8)
MAX_TOKENS = 4096
NEW_T = [1, 5, 17, 100, 300, 1000, 2500, 4096]
QUICK = dict(E=4, H=128, I=128, k=2, max_tokens=16, new_t=[1, 5, 16])


def case(fmt: str, warm: bool, quick: bool) -> dict:
    """One case, in this process: {"warmup_s": ..., "first_call_ms": {T: ms}}."""
    import onegemm  # first: it picks Triton's interpreter when there is no GPU
    import torch

    shape = QUICK if quick else QWEN3
    device = "cpu" if quick else "cuda"
    dtype = torch.float32 if quick else torch.bfloat16
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["k"]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=device, generator=gen) * H**-0.5
    w2 = torch.randn(E, H, I, device=device, generator=gen) * I**-0.5
    gate = (torch.randn(E, H, device=device, generator=gen) * H**-0.5).to(dtype)
    if fmt == "fp8":
        q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
        layer = onegemm.MoEFFN(gate, q13, q2, top_k=k, w_gate_up_scale=s13, w_down_scale=s2)
    else:
        layer = onegemm.MoEFFN(gate, w13.to(dtype), w2.to(dtype), top_k=k)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    out = {}
    with torch.inference_mode():
        start = time.perf_counter()
        if warm:
            layer.warmup(QUICK["max_tokens"] if quick else MAX_TOKENS)
        else:
            layer(torch.randn(64, H, device=device, dtype=dtype))
        sync()
        out["setup_s"] = time.perf_counter() - start
        first = {}
        for t in QUICK["new_t"] if quick else NEW_T:
            x = torch.randn(t, H, device=device, dtype=dtype)
            sync()
            start = time.perf_counter()
            layer(x)
            sync()
            first[t] = (time.perf_counter() - start) * 1e3
        out["first_call_ms"] = first
    return out


def run_case(fmt: str, warm: bool, quick: bool) -> dict:
    """``case`` in a fresh process with an empty Triton cache directory."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        args = [sys.executable, __file__, "--case", fmt, "--warm" if warm else "--cold"] + (["--quick"] if quick else [])
        proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{fmt} {'warm' if warm else 'cold'}: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU interpreter: one tiny case, no files")
    parser.add_argument("--case", choices=["bf16", "fp8"], help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case(args.case, args.warm, args.quick)))
        return
    if args.quick:
        result = run_case("fp8", True, True)
        print(f"quick: warmup and {len(result['first_call_ms'])} first calls ran; no files written")
        return
    from common import header, markdown_table, update_summary, write_results

    rows = []
    for fmt in ("bf16", "fp8"):
        for warm in (False, True):
            result = run_case(fmt, warm, False)
            row = {"layer": f"Qwen3-30B-A3B {fmt}", "process": "warmup(4096) first" if warm else "first call at T=64",
                   "setup s": result["setup_s"]}
            row.update({f"T={t} ms": ms for t, ms in result["first_call_ms"].items()})
            rows.append(row)
            print(row, flush=True)
    text = header("The first call at a new token count, with and without MoEFFN.warmup")
    text += (__doc__.split("\n\n", 2)[2].strip() + "\n\n" + markdown_table(rows) + "\n\n## What the numbers say\n\n"
             "<!-- EXPLANATION: written after reading this run's numbers. bench/bench_warmup.py regenerates "
             "everything else. -->\n\n")
    write_results("warmup", text)
    warm = [ms for r in rows if r["process"].startswith("warmup") for key, ms in r.items() if key.startswith("T=")]
    update_summary([dict(name="first_call_new_tokens_ms", value=max(warm),
                         peer="none: the slowest first call at a new T after MoEFFN.warmup(4096), Qwen3-30B-A3B bf16 "
                              "and FP8, fresh process and Triton cache (a time: lower is better)")])


if __name__ == "__main__":
    main()
