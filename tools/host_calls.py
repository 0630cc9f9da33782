"""Host cost of onegemm's eager path on the CPU, launches stubbed out: Python function calls
per op call (cProfile) and microseconds per call, to compare versions of the host path.

    PYTHONPATH=.. python tools/host_calls.py [--calls 2000]

The kernel launch itself (core/launch.py ``Launcher.launch``) is replaced by a no-op, so what
is measured is everything before it: the checks, the dispatch, the signature cache, plan and
argument building. Under the interpreter some GPU-only decisions (TMA eligibility, Triton's C
launcher) are skipped, so the figures compare versions on one machine, not CPU with GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import onegemm
from onegemm.core import launch
from onegemm.testing import quantize_experts_ref

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def ops():
    a = torch.randn(64, 256, dtype=BF16)
    w = torch.randn(512, 256, dtype=BF16)
    bias = torch.randn(512, dtype=BF16)
    ga = torch.randn(256, 256, dtype=BF16)
    gb = torch.randn(4, 512, 256, dtype=BF16).transpose(1, 2)
    offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    qa, sa = onegemm.quantize_fp8(a)
    qw, sw = onegemm.quantize_fp8(w, (128, 128))
    qga, sga = onegemm.quantize_fp8(ga)
    qgb, sgb = quantize_experts_ref(gb.transpose(1, 2).contiguous())
    lin = torch.nn.Linear(256, 512, dtype=BF16)
    fp8_lin = onegemm.Fp8Linear.from_linear(lin)
    fp8_train = onegemm.Fp8Linear.from_linear(lin, trainable=True)
    E, T, H, I, k = 8, 64, 256, 512, 2
    x = torch.randn(T, H, dtype=BF16)
    w_gu = torch.randn(E, 2 * I, H, dtype=BF16) * H**-0.5
    w_dn = torch.randn(E, H, I, dtype=BF16) * I**-0.5
    logits = torch.randn(T, E)
    weights, ids = onegemm.route(logits, k)
    q13, s13, q2, s2 = onegemm.quantize_experts(w_gu, w_dn)
    ag = a.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    return [
        ("matmul", lambda: onegemm.matmul(a, w.t())),
        ("linear", lambda: onegemm.linear(a, w, bias)),
        ("persistent_matmul", lambda: onegemm.persistent_matmul(a, w.t())),
        ("grouped_matmul", lambda: onegemm.grouped_matmul(ga, gb, offs, check_offs=False)),
        ("grouped_matmul fp8", lambda: onegemm.grouped_matmul(qga, qgb.transpose(1, 2), offs, scale_a=sga,
                                                              scale_b=sgb.transpose(1, 2), check_offs=False)),
        ("blockscaled_matmul", lambda: onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t())),
        ("quantize_fp8", lambda: onegemm.quantize_fp8(a)),
        ("Fp8Linear", lambda: fp8_lin(a)),
        ("route (CPU: torch path)", lambda: onegemm.route(logits, k)),
        ("moe_ffn", lambda: onegemm.moe_ffn(x, w_gu, w_dn, weights, ids)),
        ("moe_ffn fp8", lambda: onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2)),
        ("matmul, a requires grad", lambda: onegemm.matmul(ag, w.t())),
        ("linear, weight requires grad", lambda: onegemm.linear(a, wg, bias)),
        ("Fp8Linear(trainable=True), forward + backward", lambda: fp8_train(a).sum().backward()),
    ]


def measure(fn, calls: int):
    fn()
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        fn()
    prof.disable()
    ncalls = pstats.Stats(prof).total_calls / 100
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return ncalls, best * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    launch.Launcher.launch = lambda self, plan, grid, args: None  # the host path only
    print("| op | Python calls per call | host us per call (CPU, launch stubbed) |\n|---|---|---|")
    for name, fn in ops():
        try:
            n, us = measure(fn, args.calls)
            print(f"| {name} | {n:.0f} | {us:.1f} |")
        except Exception as e:  # noqa: BLE001 - a tool: say what failed and go on
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:80]} | |")


if __name__ == "__main__":
    main()
