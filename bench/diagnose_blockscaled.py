"""Which K-loop schedule suits block-scaled FP8 (and bf16) on Hopper? Forced-config sweeps.

    python bench/diagnose_blockscaled.py [fp8] [bf16]   # on the H200; prints tables (no files written)

blockscaled_matmul's promotion (acc += dot(a, b) * scale, once per 128-wide K block) makes
each warpgroup wait for its MMA before it can scale the result (bench/results/blockscaled.md).
This tool times the schedules that could hide that wait, each config forced, against cuBLAS
in the same run:
1. block-scaled 1x128 x 128x128 (DeepSeek-V3): the tuned configs, 128x128 with core's
   warp-specialised K loop (WARP_SPECIALIZE, TMA only: a producer and two consumer
   warpgroups), the persistent schedule (PERSISTENT, one program per SM) with and without it,
   and the autotuned call; ratios to torch._scaled_mm blockwise.
2. bf16: launch-per-tile and persistent matmul with and without WARP_SPECIALIZE; ratios to
   torch.matmul.
Every forced config's output is checked against the peer's before it is timed. A config the
compiler rejects is reported as such and the sweep goes on.
"""

from __future__ import annotations

import argparse

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from bench_blockscaled import make_gemms
from common import bench_ms, config_of, markdown_table, require_gpu, tflops
from onegemm.blockscaled.configs import BLOCKSCALED_LARGE_M as LARGE_M_CONFIGS
from onegemm.blockscaled.configs import blockscaled_cfg as fp8_cfg
from onegemm.core.configs import cfg as _cfg
from onegemm.core.configs import label as config_label
from onegemm.core.configs import warp_specialized

FP8_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 7168, 2048), (8192, 14336, 4096), (2048, 2112, 7168)]
BF16_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096)]
# Triton's Hopper warp specialisation splits a 4-warp program's tile between two consumer
# warpgroups (sm_90 compile: 8 warps gave no partitions), so its configs use 4 warps. 256x128
# and 128x256 (2 stages, all that fits) ran at 0.22-0.39x cuBLAS blockwise, so only 128x128
# is swept (the tuned list has its 4-stage form).
FP8_WS_CONFIGS = [fp8_cfg(128, 128, 4, 3), fp8_cfg(128, 128, 4, 4)]
# The persistent schedule (one program per SM) on 128x128 tiles: with 3-4 stages one CTA
# fills an SM's shared memory, so one program per SM loses no occupancy. GROUP_M and stages
# are varied around the tuned pair.
FP8_PERSISTENT_CONFIGS = [
    fp8_cfg(128, 128, 8, 3, PERSISTENT=True),
    warp_specialized(fp8_cfg(128, 128, 4, 3), PERSISTENT=True),
    warp_specialized(fp8_cfg(128, 128, 4, 4, group_m=16), PERSISTENT=True),
    warp_specialized(fp8_cfg(128, 128, 4, 4, group_m=4), PERSISTENT=True),
]
BF16_CONFIGS = [_cfg(128, 256, 64, 8, 3), _cfg(128, 128, 64, 8, 4)]
BF16_WS_CONFIGS = [_cfg(128, 256, 64, 4, 3), _cfg(128, 128, 64, 4, 4), _cfg(256, 128, 64, 4, 3)]


def timed_ratio(fn, peer_out, peer_ms):
    """peer time / fn time, after checking fn's output against the peer's; or why not."""
    try:
        out = fn()
    except Exception as e:  # out of shared memory, a compiler assertion: report, keep sweeping
        return f"fail: {type(e).__name__}: {str(e).splitlines()[-1][:60] if str(e) else ''}"
    err = (out.float() - peer_out.float()).abs().max() / peer_out.float().abs().max()
    if not err < 2e-2:
        return f"wrong: rel err {float(err):.2g}"
    return peer_ms / bench_ms(fn, warmup_ms=10, rep_ms=50)


def sweep_fp8():
    rows = []
    for M, N, K in FP8_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        gemms, (qx, sx, qw, sw) = make_gemms(x, w)
        peer = gemms["cuBLAS-block"]
        peer_out, peer_ms = peer(), bench_ms(peer, warmup_ms=10, rep_ms=50)
        base = dict(M=M, N=N, K=K, cuBLAS_TFLOPs=tflops(2.0 * M * N * K, peer_ms))
        ratio = timed_ratio(gemms["onegemm"], peer_out, peer_ms)
        rows.append(dict(base, config=f"unforced ({config_of(gemms['onegemm'])})", vs_cuBLAS_block=ratio))
        extra = [warp_specialized(c) for c in FP8_WS_CONFIGS] + FP8_PERSISTENT_CONFIGS
        for cfg in LARGE_M_CONFIGS + [c for c in extra if c not in LARGE_M_CONFIGS]:
            fn = lambda: onegemm.blockscaled_matmul(qx, qw.t(), sx, sw.t(), config=cfg, tma=True)  # noqa: E731
            rows.append(dict(base, config=config_label(cfg) + f" g{cfg.kwargs['GROUP_M']}", vs_cuBLAS_block=timed_ratio(fn, peer_out, peer_ms)))
            print(rows[-1], flush=True)
    print("\nblock-scaled fp8, ratio = cuBLAS blockwise time / onegemm time (TMA loads)")
    print(markdown_table(rows))


def sweep_bf16():
    rows = []
    for M, N, K in BF16_SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
        peer = lambda: torch.matmul(a, b)  # noqa: E731
        peer_out, peer_ms = peer(), bench_ms(peer, warmup_ms=10, rep_ms=50)
        base = dict(M=M, N=N, K=K, cuBLAS_TFLOPs=tflops(2.0 * M * N * K, peer_ms))
        for cfg in BF16_CONFIGS + [warp_specialized(c) for c in BF16_WS_CONFIGS]:
            row = dict(base, config=config_label(cfg))
            for name, op in (("launch_per_tile", onegemm.matmul), ("persistent", onegemm.persistent_matmul)):
                row[name] = timed_ratio(lambda: op(a, b, config=cfg, tma=True), peer_out, peer_ms)
            rows.append(row)
            print(row, flush=True)
    print("\nbf16, ratio = cuBLAS time / onegemm time (TMA loads)")
    print(markdown_table(rows))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="*", default=["fp8", "bf16"], help="fp8 and/or bf16 (default: both)")
    which = p.parse_args().sweeps
    require_gpu()
    if "fp8" in which:
        sweep_fp8()
    if "bf16" in which:
        sweep_bf16()


if __name__ == "__main__":
    main()
