"""Where does matmul's time go? Host overhead per call, GPU time, and forced-config sweeps.

    python bench/diagnose_matmul.py     # on the H200; prints tables (no files written)

1. Host overhead: wall time per call of onegemm.matmul / persistent_matmul / torch.matmul on
   a small problem (host-bound by construction), next to the GPU time of the same call
   replayed from a CUDA graph (no host work at all).
2. Config sweep: the big Hopper tile shapes forced on launch-per-tile and persistent kernels,
   TMA and pointer flavours, at 4096^3 and 8192^3 bf16.
3. cProfile of the host path, top entries.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import onegemm  # noqa: E402,I001
import torch  # noqa: E402
import triton  # noqa: E402
from common import bench_ms, config_label, markdown_table, tflops  # noqa: E402
from onegemm.core.matmul import _cfg  # noqa: E402


def host_us(fn, n=2000):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_us(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def main():
    rows = []
    for M, N, K in [(512, 512, 512), (16, 4096, 4096), (2048, 2048, 2048)]:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
        for name, fn in [
            ("matmul tma", lambda: onegemm.matmul(a, b)),
            ("matmul ptr", lambda: onegemm.matmul(a, b, tma=False)),
            ("persistent tma", lambda: onegemm.persistent_matmul(a, b)),
            ("torch.matmul", lambda: torch.matmul(a, b)),
        ]:
            rows.append(dict(shape=f"{M}x{N}x{K}", op=name, host_us_per_call=host_us(fn),
                             graph_gpu_us=graph_us(fn), do_bench_us=bench_ms(fn) * 1e3))
    print(markdown_table(rows))

    a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16).t()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        onegemm.matmul(a, b)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
    print(s.getvalue()[:6000])

    cfgs = [_cfg(128, 256, 64, 8, 3), _cfg(256, 128, 64, 8, 3), _cfg(128, 256, 64, 8, 4),
            _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 4, 4), _cfg(128, 256, 64, 8, 3, group_m=16)]
    rows = []
    for S in (4096, 8192):
        a = torch.randn(S, S, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(S, S, device="cuda", dtype=torch.bfloat16).t()
        flop = 2.0 * S**3
        t_cublas = bench_ms(lambda: torch.matmul(a, b))
        for cfg in cfgs:
            label = config_label(cfg, group_m=True)
            row = dict(S=S, config=label)
            for name, fn in [
                ("lpt_tma", lambda: onegemm.matmul(a, b, config=cfg, tma=True)),
                ("lpt_ptr", lambda: onegemm.matmul(a, b, config=cfg, tma=False)),
                ("pers_tma", lambda: onegemm.persistent_matmul(a, b, config=cfg, tma=True)),
            ]:
                try:
                    row[name] = t_cublas / bench_ms(fn)
                except Exception as e:  # an out-of-resources config: report, keep sweeping
                    row[name] = f"fail: {type(e).__name__}"
            rows.append(row)
            print(row, flush=True)
        rows.append(dict(S=S, config="cuBLAS TFLOP/s", lpt_tma=tflops(flop, t_cublas)))
    print("ratios = cuBLAS time / onegemm time")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
