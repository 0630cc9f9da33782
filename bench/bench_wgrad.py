"""The weight-gradient mode (grouped_matmul 2D x 2D, groups along K) in every layout, against torch._grouped_mm.

    python bench/bench_wgrad.py           # H200: bench/results/grouped_wgrad.md and summary.json
    python bench/bench_wgrad.py --quick   # CPU interpreter: tiny shapes, checked, no files

G = 4 groups along K (5120, 7680, 4352, 5120: an MoE's tokens per expert), M = N = 4096, bf16:
a [M, sum_K] and b [sum_K, N], each either K-major (K contiguous) or M- / N-major. A token-major
training step gives a = x.t() and b = dy (neither K-major); the others come from stored
transposes or another framework's layout. The same four layouts again with group sizes that are
not multiples of 8 (5117, 7683, 4351, 5121), where a K-major operand's groups start at single
elements (torch._grouped_mm asserts on the device there, so it is not run; onegemm is checked
against float64 instead). Per case: GPU time (CUDA-graph replay) of onegemm and torch._grouped_mm on the same
tensors, onegemm's eager time and first call.
"""

from __future__ import annotations

import argparse
import time

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import bench_ms, config_of, geomean, header, markdown_table, run_or_reason, tflops, update_summary, write_results
from onegemm.testing import assert_close, eager_ms, grouped_mm_ref

SIZES = {"aligned": [5120, 7680, 4352, 5120], "odd": [5117, 7683, 4351, 5121]}
QUICK_SIZES = {"aligned": [40, 0, 48], "odd": [37, 0, 50]}
M = N = 4096
QUICK_MN = 24
# (a K-major, b K-major) by name
LAYOUTS = {"a M-major, b N-major": (False, False), "a K-major, b N-major": (True, False),
           "a K-major, b K-major": (True, True), "a M-major, b K-major": (False, True)}


def operands(m, n, sizes, k_major_a, k_major_b, device):
    """a [m, sum_K], b [sum_K, n] in the layout asked for (K rounded up to 16-byte rows) and offs."""
    k = (sum(sizes) + 7) // 8 * 8
    a = torch.randn(m, k, device=device) if k_major_a else torch.randn(k, m, device=device).t()
    b = torch.randn(n, k, device=device).t() if k_major_b else torch.randn(k, n, device=device)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    return a.to(torch.bfloat16), b.to(torch.bfloat16), offs


def measure(layout, kind, sizes, m, n, device, quick):
    a, b, offs = operands(m, n, sizes, *LAYOUTS[layout], device)
    one = lambda: onegemm.grouped_matmul(a, b, offs)  # noqa: E731
    peer = lambda: torch._grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
    start = time.perf_counter()
    out = one()
    if device == "cuda":
        torch.cuda.synchronize()
    row = dict(layout=layout, groups=kind, first_call_ms=(time.perf_counter() - start) * 1e3)
    if quick:
        assert_close(out, grouped_mm_ref(a, b, offs), 2e-2, f"{layout} {kind}")
        return row
    # torch._grouped_mm asserts on the device (ending the process) where a K-major operand's
    # groups are not 16-byte multiples: it runs on aligned groups and the all-MN-major layout only.
    if kind == "aligned" or not any(LAYOUTS[layout]):
        reference, reason = run_or_reason(peer)
    else:
        reference, reason = None, "torch._grouped_mm needs 16-byte multiples along a K-major operand"
    assert_close(out, grouped_mm_ref(a, b, offs) if reference is None else reference.float(), 2e-2, f"{layout} {kind}")
    flop = 2 * m * n * sum(sizes)
    t1 = bench_ms(one)
    row.update(tile=config_of(one), onegemm_tflops=tflops(flop, t1), onegemm_eager_ms=eager_ms(one))
    if reference is None:
        row.update(torch_tflops=float("nan"), vs_grouped_mm=float("nan"))
    else:
        t2 = bench_ms(peer)
        row.update(torch_tflops=tflops(flop, t2), vs_grouped_mm=t2 / t1)
    row["torch"] = reason[:80] if reason else "ran"
    print(row, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU interpreter: tiny shapes, checked, no files")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"
    m = n = QUICK_MN if args.quick else M
    sizes = QUICK_SIZES if args.quick else SIZES
    rows = [measure(layout, kind, sizes[kind], m, n, device, args.quick) for kind in sizes for layout in LAYOUTS]
    if args.quick:
        print(f"quick: {len(rows)} cases matched the float64 reference; no files written")
        return
    aligned = [r["vs_grouped_mm"] for r in rows if r["groups"] == "aligned"]
    text = header("grouped_matmul 2D x 2D (the weight gradient) in every layout vs torch._grouped_mm")
    text += (f"{__doc__.split(chr(10) + chr(10), 2)[2].strip()}\n\nTarget (issue 46): >= 1.0x torch._grouped_mm in every "
             f"layout.\n\n" + markdown_table(rows) + f"\n\nAligned groups vs torch._grouped_mm: geomean {geomean(aligned):.3f}, "
             f"minimum {min(aligned):.3f}.\n")
    write_results("grouped_wgrad", text)
    update_summary([dict(name="grouped_wgrad_vs_grouped_mm", value=geomean(aligned),
                         peer="torch._grouped_mm, bf16 2D x 2D, G = 4, M = N = 4096, the four layouts (geomean; "
                              "the minimum is in grouped_wgrad.md)")])


if __name__ == "__main__":
    main()
