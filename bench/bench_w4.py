"""4-bit experts on the H200: onegemm.moe_ffn with MXFP4 and INT4 experts against the same layer in bf16.

    python bench/bench_w4.py           # H200: bench/results/moe_w4.md and summary.json
    python bench/bench_w4.py --quick   # CPU interpreter: a tiny layer once, checked, no files

gpt-oss-120b's experts (E = 128, H = I = 2880, top-4) and Kimi-K2's 48 experts of one of 8
expert-parallel ranks (384 routed, H = 7168, I = 2048, top-8; ids on other ranks contribute
nothing), random 4-bit weights: MXFP4 (random e2m1 codes, e8m0 scales near the 1/sqrt(fan-in)
scale) and INT4 (random codes, bf16 scales per 32 values, compressed-tensors' format as
Kimi-K2-Thinking ships it; "int4-zp": asymmetric groups with zero points, GPTQ / AWQ style, of
128 where K allows (else 32), their scale words from pack_int4_zeros); the bf16 layer holds the same values dequantised, so the outputs
differ by h's bf16 rounding only (calc_diff). At T = 1, 16, 64, 256 and 4096 tokens, uniform routing: GPU time (CUDA-graph
replay) of both, the MXFP4 call's eager time and first call, and at T <= 256 the packed weight
bytes (values and scales of the experts a step hits) per second, against a bf16 clone's copy
rate measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import time

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import bench_ms, copy_tb_s, geomean, header, markdown_table, update_summary, write_results
from onegemm.testing import TOL, assert_close, calc_diff, eager_ms, int4_dequantize_ref, moe_ref, mxfp4_dequantize_ref

# (name, local experts, routed experts, H, I, top-k)
MODELS = [("gpt-oss-120b", 128, 128, 2880, 2880, 4), ("Kimi-K2 EP8", 48, 384, 7168, 2048, 8)]
QUICK_MODELS = [("tiny", 4, 6, 64, 96, 2)]
TOKENS = [1, 16, 64, 256, 4096]
DECODE_MAX = 64  # T of the decode figure
FORMATS = ("mxfp4", "mxfp4-prepacked", "int4", "int4-zp")
SUMMARY_FORMATS = ("mxfp4", "int4")  # the summary figures' (the issue's): zero points reported beside them
INT4_GROUP = 32  # Kimi-K2-Thinking's
INT4_ZP_GROUP = 128  # GPTQ's and AWQ's usual
MXFP4, E8M0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu


def random_mxfp4(E, rows, K, device):
    """(packed [E, rows, K/2], scales [E, rows, K/32], bf16 twin [E, rows, K]): random codes,
    scales around K^-0.5 / 4 (values up to 6x that), dequantised expert by expert."""
    blocks = torch.randint(0, 256, (E, rows, K // 32, 16), dtype=torch.uint8, device=device)
    exponent = round(math.log2(K**-0.5 / 4))
    scales = torch.randint(126 + exponent, 129 + exponent, (E, rows, K // 32), dtype=torch.uint8, device=device)
    twin = torch.stack([mxfp4_dequantize_ref(blocks[e], scales[e]).to(torch.bfloat16) for e in range(E)])
    return blocks.flatten(-2).view(MXFP4), scales.view(E8M0), twin


def random_int4(E, rows, K, device, zero_points=False):
    """(packed int32 [E, rows, K/8], bf16 scales [E, rows, K/32], bf16 twin [E, rows, K]):
    random codes, scales around K^-0.5 / 4; ``zero_points``: groups of 128 (where K allows)
    with random zero points, the scales as pack_int4_zeros words."""
    packed = torch.randint(-2**31, 2**31 - 1, (E, rows, K // 8), dtype=torch.int32, device=device)
    group = INT4_ZP_GROUP if zero_points and K % INT4_ZP_GROUP == 0 else INT4_GROUP
    scales = (torch.rand(E, rows, K // group, device=device) + 0.5).mul(K**-0.5 / 4).to(torch.bfloat16)
    if zero_points:
        scales = onegemm.pack_int4_zeros(scales, torch.randint(4, 12, scales.shape, device=device))
    twin = torch.stack([int4_dequantize_ref(packed[e], scales[e]).to(torch.bfloat16) for e in range(E)])
    return packed, scales, twin


def measure(model, T, fmt, device, quick):
    name, E, E_routed, H, I, k = model
    torch.manual_seed(T)  # the same tokens and routing for both formats (drawn before the weights)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    weights, ids = onegemm.route(torch.randn(T, E_routed, device=device), k)
    def make(E, rows, K, device):
        if fmt.startswith("mxfp4"):
            return random_mxfp4(E, rows, K, device)
        return random_int4(E, rows, K, device, zero_points=fmt == "int4-zp")

    q13, s13, w13 = make(E, 2 * I, H, device)
    q2, s2, w2 = make(E, H, I, device)
    if fmt == "mxfp4-prepacked":  # once, as MoEFFN does on construction
        p13, p2 = onegemm.prepack_mxfp4(q13, s13, gate_up=True), onegemm.prepack_mxfp4(q2, s2)
        w4 = lambda: onegemm.moe_ffn(x, p13, p2, weights, ids)  # noqa: E731
    else:
        w4 = lambda: onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2)  # noqa: E731
    bf16 = lambda: onegemm.moe_ffn(x, w13, w2, weights, ids)  # noqa: E731
    start = time.perf_counter()
    y4 = w4()
    if device == "cuda":
        torch.cuda.synchronize()
    row = dict(model=name, format=fmt, T=T, first_call_ms=(time.perf_counter() - start) * 1e3, calc_diff_vs_bf16=calc_diff(y4, bf16()))
    if row["calc_diff_vs_bf16"] > 1e-3:  # h's rounding alone is ~1e-8: a timing of wrong values is no figure
        raise AssertionError(f"{name} {fmt} T={T}: calc_diff {row['calc_diff_vs_bf16']:.3g} against the bf16 layer")
    if quick:
        assert_close(y4, moe_ref(x, w13.double(), w2.double(), weights, ids), 2 * TOL[torch.bfloat16], f"{name} {fmt}")
        return row
    t4, t16 = bench_ms(w4, 10, 50), bench_ms(bf16, 10, 50)
    row.update(w4_gpu_ms=t4, bf16_gpu_ms=t16, w4_vs_bf16=t16 / t4, w4_eager_ms=eager_ms(w4, 10, 50))
    if T <= 256:
        hit = int(torch.unique(ids[(ids >= 0) & (ids < E)]).numel())
        scale_bytes = s13[0].numel() * s13.element_size() + s2[0].numel() * s2.element_size()  # one expert's
        packed = hit * (3 * H * I // 2 + scale_bytes)  # values and scales of the experts a step reads
        row["packed MB read"] = packed / 1e6
        row["weight TB/s"] = packed / (t4 * 1e-3) / 1e12
    print(row, flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU interpreter: a tiny layer once, checked, no files")
    parser.add_argument("--formats", help="comma-separated formats to time, printed only (default: all, and the files)")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        for model in QUICK_MODELS:
            for fmt in FORMATS:
                measure(model, 3, fmt, device, True)
        print("quick: the MXFP4 and INT4 moe_ffn ran and matched the reference; no files written")
        return
    copy = copy_tb_s(device)
    if args.formats:
        for m in MODELS:
            for T in TOKENS:
                for fmt in args.formats.split(","):
                    measure(m, T, fmt, device, False)
        return
    rows = [measure(m, T, fmt, device, False) for m in MODELS for fmt in FORMATS for T in TOKENS]
    summed = [r for r in rows if r["format"] in SUMMARY_FORMATS]
    decode = [r["w4_vs_bf16"] for r in summed if r["T"] <= DECODE_MAX]
    prefill = [r["w4_vs_bf16"] for r in summed if r["T"] == max(TOKENS)]
    big = [r["weight TB/s"] / copy for r in summed if r["T"] <= DECODE_MAX and r["packed MB read"] >= 50]
    text = header("4-bit experts: MXFP4 and INT4 moe_ffn vs the same layer in bf16")
    text += (f"{__doc__.split(chr(10) + chr(10), 2)[2].strip()}\n\nbf16 clone copy rate in this run: {copy:.2f} TB/s. "
             "Targets (issue 45): decode (T <= 64) >= 3.0x bf16 geomean; >= 3.2 TB/s where a step reads >= 50 MB; "
             "prefill (T = 4096) >= 0.85x.\n\n" + markdown_table(rows) + "\n\n"
             f"Geomeans over MXFP4 and symmetric INT4, 4-bit vs bf16 (GPU time): decode {geomean(decode):.3f}, prefill {geomean(prefill):.3f}; "
             f"packed weight rate / copy rate where >= 50 MB: {geomean(big) if big else float('nan'):.3f}.\n")
    write_results("moe_w4", text)
    update_summary([
        dict(name="w4_moe_decode_vs_bf16", value=geomean(decode),
             peer="onegemm moe_ffn bf16 on the same values, GPU time, T <= 64 (gpt-oss-120b, Kimi-K2 EP8; MXFP4 and INT4)"),
        dict(name="w4_moe_prefill_vs_bf16", value=geomean(prefill),
             peer="onegemm moe_ffn bf16 on the same values, GPU time, T = 4096 (MXFP4 and INT4)")]
        + ([dict(name="w4_decode_weight_bw_vs_copy", value=geomean(big),
                 peer="a bf16 clone's copy rate in the same run; 4-bit packed bytes read per second, T <= 64, >= 50 MB")]
           if big else []))


if __name__ == "__main__":
    main()
