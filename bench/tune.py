"""Tune the shipped config table for this GPU: core/tuned/<GPU name>.json.

    python bench/tune.py                 # every family, then merge into core/tuned/<GPU>.json
    python bench/tune.py matmul ragged   # some families only
    python bench/tune.py --list          # print the shape matrix (no GPU needed)
    python bench/tune.py --merge FILE    # merge another tuning cache (e.g. a benchmark's) into the table

Each shape of the matrix is called once with onegemm.autotune() on and a tuning cache of its
own (ONEGEMM_CACHE_DIR set to a fresh folder, the shipped table set aside): every candidate
config of the call's key (core/configs.py) is compiled in parallel threads, timed in GPU time
(CUDA-graph replays) and the fastest stored. The new entries are then merged into the shipped
table, replacing those with the same key. A key is per M bucket (next power of two), so the
matrix walks M over powers of two.

For a new GPU: run this on it (and any benchmark with ONEGEMM_AUTOTUNE=1, then --merge its
cache), commit the JSON it writes. Without a table, every call there runs the heuristic's
config, and users can still tune their own shapes with onegemm.autotune().
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from onegemm.core import launch, tables
from onegemm.core.runtime import cdiv

BF16, FP16 = torch.bfloat16, torch.float16
M_BUCKETS = [1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# (N, K) of the linears people run: the benchmarks' set, Qwen3-30B-A3B attention (qkv, o),
# Mixtral attention (qkv), DeepSeek-V3 (q_a, o).
LINEAR_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (5120, 2048), (2048, 4096), (6144, 4096), (1536, 7168),
             (7168, 16384)]
SQUARES = [512, 1024, 2048, 4096, 8192]
FP8_NK = [(4096, 4096), (7168, 2048), (2112, 7168), (14336, 4096)]
FP8_M = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# name: (E, H, I, top_k)
MOE_MODELS = {"Qwen3-30B-A3B": (128, 2048, 768, 8), "Mixtral-8x7B": (8, 4096, 14336, 2), "DeepSeek-V3-EP8": (32, 7168, 2048, 8)}
MOE_TOKENS = [1, 16, 64, 256, 512, 4096, 8192]
GROUPED_ROWS = [64, 512, 4096, 32768]


def matmul_cases():
    for dtype in (BF16, FP16):
        nks = LINEAR_NK if dtype == BF16 else LINEAR_NK[:3]
        ms = M_BUCKETS if dtype == BF16 else [16, 128, 4096, 16384]
        for n, k in nks:
            for m in ms:
                yield f"matmul {dtype} {m}x{n}x{k}", _matmul(m, n, k, dtype)
        for s in SQUARES:
            yield f"matmul {dtype} {s}^3", _matmul(s, s, s, dtype)


def _matmul(m, n, k, dtype):
    def run():
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        onegemm.matmul(a, w.t())
    return run


def blockscaled_cases():
    shapes = [(m, n, k) for n, k in FP8_NK for m in FP8_M] + [(s, s, s) for s in SQUARES[1:]]
    for m, n, k in shapes:
        def run(m=m, n=n, k=k):
            qa, sa = onegemm.quantize_fp8(torch.randn(m, k, device="cuda"))
            qw, sw = onegemm.quantize_fp8(torch.randn(n, k, device="cuda"), (128, 128))
            onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t())
        yield f"blockscaled {m}x{n}x{k}", run


def ragged_cases():
    for name, (E, H, I, k) in MOE_MODELS.items():
        for which, (N, K) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            for rows in GROUPED_ROWS:
                def run(E=E, N=N, K=K, rows=rows):
                    sizes = torch.full((E,), rows // E, dtype=torch.int64)
                    sizes[: rows % E] += 1
                    a = torch.randn(rows, K, device="cuda", dtype=BF16)
                    b = torch.randn(E, N, K, device="cuda", dtype=BF16).transpose(1, 2)
                    onegemm.grouped_matmul(a, b, sizes.cumsum(0).to(torch.int32).cuda())
                yield f"grouped {name} {which} rows={rows}", run
        for T in MOE_TOKENS:
            def run(E=E, H=H, I=I, k=k, T=T):
                x = torch.randn(T, H, device="cuda", dtype=BF16)
                w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=BF16) * H**-0.5
                w_dn = torch.randn(E, H, I, device="cuda", dtype=BF16) * I**-0.5
                weights, ids = onegemm.route(torch.randn(T, E, device="cuda"), k)
                onegemm.moe_ffn(x, w_gu, w_dn, weights, ids)
            yield f"moe_ffn {name} T={T}", run
        for T in MOE_TOKENS:
            def run(E=E, H=H, I=I, k=k, T=T):
                x = torch.randn(T, H, device="cuda", dtype=BF16)
                experts = onegemm.quantize_experts(torch.randn(E, 2 * I, H, device="cuda", dtype=BF16) * H**-0.5,
                                                   torch.randn(E, H, I, device="cuda", dtype=BF16) * I**-0.5)
                weights, ids = onegemm.route(torch.randn(T, E, device="cuda"), k)
                onegemm.moe_ffn(x, experts[0], experts[2], weights, ids, w_gate_up_scale=experts[1],
                                w_down_scale=experts[3])
            yield f"moe_ffn fp8 {name} T={T}", run
        for which, (N, K) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            for rows in GROUPED_ROWS[-2:]:
                def run(E=E, N=N, K=K, rows=rows):
                    offs = (torch.arange(1, E + 1, device="cuda") * (rows // E)).to(torch.int32)
                    qa, sa = onegemm.quantize_fp8(torch.randn(rows, K, device="cuda"))
                    qr, sr = onegemm.quantize_fp8(torch.randn(rows, K, device="cuda"), "row")
                    qb = torch.randn(E, N, K, device="cuda").to(torch.float8_e4m3fn).transpose(1, 2)
                    onegemm.grouped_matmul(qa, qb, offs, scale_a=sa, scale_b=torch.ones(E, cdiv(K, 128), cdiv(N, 128),
                                                                                        device="cuda"))
                    onegemm.grouped_matmul(qr, qb, offs, scale_a=sr, scale_b=torch.ones(E, 1, N, device="cuda"))
                yield f"grouped fp8 {name} {which} rows={rows}", run


def training_cases():
    """Forward + backward of the training benchmark's calls (bench/bench_autograd.py): their
    backward GEMMs read transposed operands and use grouped_matmul's weight-gradient mode,
    keys the inference matrix above never meets."""
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(BF16).requires_grad_()

    for m in (4096, 8192):
        for n, k in LINEAR_NK[:3]:
            def run(m=m, n=n, k=k):
                onegemm.linear(leaf(m, k), leaf(n, k, scale=k**-0.5), leaf(n)).sum().backward()
            yield f"training linear {m}x{n}x{k}", run
    for name, T in (("Qwen3-30B-A3B", 8192), ("Mixtral-8x7B", 4096)):
        E, H, I, k = MOE_MODELS[name]

        def run(E=E, H=H, I=I, k=k, T=T):
            weights, ids = onegemm.route(torch.randn(T, E, device="cuda"), k)
            y = onegemm.moe_ffn(leaf(T, H), leaf(E, 2 * I, H, scale=H**-0.5), leaf(E, H, I, scale=I**-0.5),
                                weights.requires_grad_(), ids)
            y.float().sum().backward()
            P = T * k
            offs = (torch.arange(1, E + 1, device="cuda") * (P // E)).to(torch.int32)
            onegemm.grouped_matmul(leaf(P, H), leaf(E, 2 * I, H).transpose(1, 2), offs).sum().backward()
        yield f"training moe_ffn {name} T={T}", run

        def run_fp8(E=E, H=H, I=I, k=k, T=T):  # the FP8 expert GEMMs (Gluon body), quantisers and transposes
            weights, ids = onegemm.route(torch.randn(T, E, device="cuda"), k)
            y = onegemm.moe_ffn(leaf(T, H), leaf(E, 2 * I, H, scale=H**-0.5), leaf(E, H, I, scale=I**-0.5),
                                weights.requires_grad_(), ids, fp8_training=True)
            y.float().sum().backward()
        yield f"training moe_ffn fp8 {name} T={T}", run_fp8
    for tokens in (8192, 16384):  # the FP8 MLP benchmark's two token counts
        for d_in, d_out in ((4096, 16384), (16384, 4096)):
            def run(d_in=d_in, d_out=d_out, tokens=tokens):
                layer = onegemm.Fp8Linear(d_in, d_out, device="cuda", dtype=BF16, trainable=True)
                layer(leaf(tokens, d_in)).float().sum().backward()
            yield f"training Fp8Linear {tokens}x{d_out}x{d_in}", run


FAMILIES = {"matmul": matmul_cases, "blockscaled": blockscaled_cases, "ragged": ragged_cases, "training": training_cases}


def merge(cache_file: Path, table_file: Path) -> int:
    """Merge a tuning cache's entries into the table file; returns how many were merged."""
    new = json.loads(cache_file.read_text())
    try:
        table = json.loads(table_file.read_text())
    except FileNotFoundError:
        table = {"configs": {}}
    table.update(gpu=new.get("gpu", table.get("gpu")), triton=new.get("triton", table.get("triton")),
                 torch=torch.__version__, made_by="bench/tune.py", date=time.strftime("%Y-%m-%d"))
    count = 0
    for family, entries in new["configs"].items():
        table["configs"].setdefault(family, {}).update(entries)
        count += len(entries)
    table_file.parent.mkdir(parents=True, exist_ok=True)
    table_file.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("families", nargs="*", help=f"families to tune, of {list(FAMILIES)} (default: all)")
    p.add_argument("--list", action="store_true", help="print the shape matrix and exit")
    p.add_argument("--merge", type=Path, help="merge this tuning cache file into the table and exit")
    p.add_argument("--only", help="tune only the cases whose name matches this regular expression")
    p.add_argument("--cache", type=Path, help="keep the tuning cache in this folder (default: a temporary one); "
                   "it is written after every key, so an interrupted run can still be merged")
    args = p.parse_args()
    families = args.families or list(FAMILIES)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {list(FAMILIES)}")
    if args.list:
        for f in families:
            for name, _ in FAMILIES[f]():
                if not args.only or re.search(args.only, name):
                    print(name)
        return
    if not torch.cuda.is_available() or onegemm.INTERPRET:
        sys.exit("tuning needs a CUDA GPU (use --list to see the matrix)")
    table_file = tables.TABLE_DIR / f"{tables.gpu_slug(torch.cuda.get_device_name())}.json"
    if args.merge:
        print(f"merged {merge(args.merge, table_file)} entries into {table_file}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.cache:
            tmp = str(args.cache)
        os.environ["ONEGEMM_CACHE_DIR"] = tmp
        launch.reload_tables(shipped=False)  # tune every key, whatever the shipped table holds
        start = time.perf_counter()
        with onegemm.autotune():
            for f in families:
                for name, run in FAMILIES[f]():
                    if args.only and not re.search(args.only, name):
                        continue
                    t = time.perf_counter()
                    run()
                    torch.cuda.synchronize()
                    print(f"{time.perf_counter() - start:7.1f} s  {name}: {time.perf_counter() - t:.1f} s", flush=True)
        (cache,) = Path(tmp).glob("*.json")
        print(f"merged {merge(cache, table_file)} entries into {table_file}")


if __name__ == "__main__":
    main()
