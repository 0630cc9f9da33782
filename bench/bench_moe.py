"""FP8 MoE on the H200: the FP8 expert FFN against bf16, and the FP8 grouped GEMM against torch and DeepGEMM.

    python bench/bench_moe.py           # H200: bench/results/moe_fp8.md
    python bench/bench_moe.py --quick   # CPU interpreter: every path once, tiny shapes, no files
    python bench/bench_moe.py --part moe --models qwen3,mixtral --tokens 1,4,16  # H200: a subset
    python bench/bench_moe.py --part moe --render  # any machine: section 1 from the stored rows
    # (each device call's bench/results/moe_fp8_rows.json comes back into this tree first)
    # DeepGEMM's columns need `import deep_gemm` to work (else one line says why, and they are
    # nan). Here, copy DeepGEMM (a checkout with its build.sh, from the peers folder named by
    # $ONEGEMM_PEERS) into the ignored .peers/, which travels with the working tree:
    mkdir -p .peers && cp -r "$ONEGEMM_PEERS/deepgemm" .peers/ && chmod -R u+w .peers/deepgemm
    # then on the GPU machine, from the checkout (build.sh writes .peers/deepgemm/dg_env.sh):
    bash .peers/deepgemm/build.sh > $OUT/dg_build.log 2>&1 && source .peers/deepgemm/dg_env.sh && python3 bench/bench_moe.py --part gemm

Part 1, the expert FFN: onegemm.moe_ffn with FP8 experts (e4m3, 128x128 weight scales, 1x128
activations quantised inside the pipeline) against moe_ffn in bf16 and the plain-torch bf16
MoE (torch._grouped_mm), on Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3's 32 experts of one of 8
expert-parallel ranks (top-8 over 256 experts; ids on other ranks contribute nothing), at
decode (T = 1..256) and prefill (T = 4K, 16K), uniform and skewed routing. GPU time (CUDA-graph
replay), eager time as a user calls it, and the first call at a new T; decode also as TB/s of
the expert weight bytes it reads. Each FP8 output is checked against bf16 (calc_diff).

Part 2, the GEMM: onegemm.grouped_matmul with fp8 e4m3 operands and its two scale conventions,
1x128 x 128x128 (DeepSeek's blocks) and row-wise x per-channel, against torch._grouped_mm in
bf16, torch._scaled_grouped_mm (row-wise x per-channel, where this torch has it), plain
torch (torch._scaled_mm per group in a Python loop) and DeepGEMM's
m_grouped_fp8_gemm_nt_contiguous (1x128 x 128x128, the same fp8 values and scales, on its
layout: each group's rows padded to a multiple of 128, m_indices naming each row's group, -1 on
padding), in GPU time on the same models' expert GEMMs at prefill, tokens spread evenly over the
experts; TFLOP/s count the real rows only. Then (section 3) decode: 8-32 groups of 16-128 rows
(each group's rows 0.7-1.3x the mean), at N = 4096, K = 7168 and at the models' expert GEMMs,
onegemm.grouped_matmul on the packed real rows against DeepGEMM's m_grouped_fp8_gemm_nt_masked
on [G, max_m, K] with masked_m the real rows per group, as TB/s of the fp8 weights and their
scales read. Each onegemm result is checked against the dequantised float64 reference first
(CPU) and each DeepGEMM output against onegemm's on the same inputs (calc_diff < 1e-3: else
its cell is blank, with the reason printed); DeepGEMM's layouts are made outside the timed calls.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
from common import (RESULTS, bench_ms, commit, copy_tb_s, differs, geomean, header, import_deepgemm, import_vllm_moe,
                    kept_sections, markdown_table, run_or_reason, update_summary, write_results)
from onegemm.testing import (
    assert_close,
    assert_moe_fp8_close,
    calc_diff,
    dequantize_ref,
    eager_ms,
    grouped_mm_ref,
    moe_ffn_torch,
)

# (name, local experts, routed experts, H, I, top-k): experts past the local ones are on other
# ranks (expert parallelism): their ids fall outside [0, E) and contribute nothing here.
MODELS = [
    ("Qwen3-30B-A3B", 128, 128, 2048, 768, 8),
    ("Mixtral-8x7B", 8, 8, 4096, 14336, 2),
    ("DeepSeek-V3 EP8", 32, 256, 7168, 2048, 8),
    ("gpt-oss-120b", 128, 128, 2880, 2880, 4),
]
DECODE = [1, 4, 16, 64, 256, 512]
PREFILL = [4096, 16384]
QUICK_MODELS = [("tiny", 4, 6, 200, 136, 2)]


def moe_routing(T, E_routed, k, skewed, device):
    """Top-k of random logits; ``skewed``: a Zipf-like bias makes a few experts hot."""
    logits = torch.randn(T, E_routed, device=device)
    if skewed:
        logits += 1.5 * torch.log(1.0 / torch.arange(1, E_routed + 1, device=device))
    return onegemm.route(logits, k)


VLLM_VERSION_NOTE = "0.33"


def bw_ratio(rows, fmt):
    """Weight TB/s / its run's copy TB/s, of the decode rows (T <= 64) that read >= 100 MB of fp8 weights."""
    return [r[f"{fmt} weight TB/s"] / r["copy TB/s"] for r in rows if r["T"] <= 64 and r.get("fp8 weight MB read", 0) >= 100]


ROWS_FILE = RESULTS / "moe_fp8_rows.json"


def merge_moe_rows(rows, models):
    """This run's expert-FFN rows, stored in ROWS_FILE, plus the stored rows of the models it did
    not run (a --models rerun of some models keeps the others' figures, from the same GPU)."""
    gpu, ran = torch.cuda.get_device_name(), {m[0] for m in models}
    stamp = dict(gpu=gpu, commit=commit(), date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")
    old = json.loads(ROWS_FILE.read_text()) if ROWS_FILE.exists() else []
    kept = [r for r in old if r["model"] not in ran and r.get("gpu") == gpu]
    rows = [{**r, **stamp} for r in rows] + kept
    ROWS_FILE.write_text(json.dumps(rows, indent=1))
    return rows


def vllm_moe(vllm, x, experts, weights, ids, E, k):
    """vLLM's fused_moe kernels on the same experts (bf16: (w13, w2); FP8: (q13, q2, s13, s2),
    whose layouts and 128x128 scales are vLLM's too), with the config vLLM picks on an H200 and
    its moe_align_block_size made here, outside the timed call. Ids outside [0, E) (experts of
    other ranks) become expert -1, whose blocks vLLM's kernel fills with zeros, as its
    expert_map does. Returns the timed call."""
    w1, w2, *scales = experts
    s1, s2 = scales or (None, None)
    local = (ids >= 0) & (ids < E)
    ids_v = torch.where(local, ids, -1).to(torch.int32)
    config = vllm.get_config(x.shape[0], w1.shape, w2.shape, k, "fp8_w8a8" if scales else None,
                             [128, 128] if scales else None)
    align = vllm.moe_align_block_size(torch.where(local, ids, E), config["BLOCK_SIZE_M"], E + 1)
    align[1].masked_fill_(align[1] == E, -1)
    return lambda: vllm.fused_moe(x, w1, w2, weights, ids_v, w1_scale=s1, w2_scale=s2, config=config, align=align)


def measure_moe(model, T, skewed, device, timer, quick, vllm=None):
    name, E, E_routed, H, I, k = model
    torch.manual_seed(T)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
    weights, ids = moe_routing(T, E_routed, k, skewed, device)
    fp8 = lambda: onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2)  # noqa: E731
    bf16 = lambda: onegemm.moe_ffn(x, w13, w2, weights, ids)  # noqa: E731
    peer = lambda: moe_ffn_torch(x, w13, w2, weights, ids, use_grouped_mm=device == "cuda")  # noqa: E731
    start = time.perf_counter()
    y8 = fp8()
    if device == "cuda":
        torch.cuda.synchronize()
    first_ms = (time.perf_counter() - start) * 1e3
    row = dict(model=name, T=T, routing="skewed" if skewed else "uniform")
    loads = torch.bincount(ids[(ids >= 0) & (ids < E)].long(), minlength=E)
    row["max/mean load"] = (loads.max() / loads.float().mean().clamp_min(1e-9)).item()
    row["calc_diff fp8 vs bf16"] = calc_diff(y8, bf16())
    if quick:
        assert_moe_fp8_close(y8, x, q13, q2, weights, ids, s13, s2, what=f"{name} FP8 moe_ffn")
        return row
    t8, t16, tp = timer(fp8), timer(bf16), timer(peer)
    e8, e16 = eager_ms(fp8, 10, 50), eager_ms(bf16, 10, 50)
    hit = int((loads > 0).sum())
    row.update({"fp8 GPU ms": t8, "bf16 GPU ms": t16, "fp8 vs bf16 (GPU)": t16 / t8, "fp8 vs torch bf16 (GPU)": tp / t8,
                "fp8 eager ms": e8, "fp8 vs bf16 (eager)": e16 / e8, "fp8 first call ms": first_ms})
    if T <= max(DECODE):
        # The bytes a decode step must read: the experts it hits, with their scales.
        row["fp8 weight TB/s"] = hit * (3 * H * I + 4 * (s13[0].numel() + s2[0].numel())) / (t8 * 1e-3) / 1e12
        row["bf16 weight TB/s"] = hit * 3 * H * I * 2 / (t16 * 1e-3) / 1e12
        row["fp8 weight MB read"] = hit * 3 * H * I / 1e6
        if vllm is not None:
            if s13.shape[1] != -(-2 * I // 128):  # gate and up quantised apart (I % 128 != 0): vLLM's own blocks
                vq13, vs13 = vllm.quant_weight_block_fp8(w13)
            else:
                vq13, vs13 = q13, s13
            y16 = bf16()
            for fmt, experts, t_ours, tol in [("fp8", (vq13, q2, vs13, s2), t8, 5e-3), ("bf16", (w13, w2), t16, 1e-3)]:
                call = vllm_moe(vllm, x, experts, weights, ids, E, k)
                _, why = run_or_reason(call, lambda out: differs(out, y16, tol))
                row[f"{fmt} vs vLLM (GPU)"] = math.nan if why else timer(call) / t_ours
                if why:
                    print(f"vLLM {fmt} {name} T={T}: {why}", flush=True)
    print(row, flush=True)
    return row

# (name, E, N, K, rows): GEMM1 (gate_up: N = 2I, K = H) and GEMM2 (down: N = H, K = I).
SHAPES = [
    ("Qwen3-30B-A3B gate_up", 128, 1536, 2048, 65536),
    ("Qwen3-30B-A3B down", 128, 2048, 768, 65536),
    ("Mixtral-8x7B gate_up", 8, 28672, 4096, 8192),
    ("Mixtral-8x7B down", 8, 4096, 14336, 8192),
    ("DeepSeek-V3 EP8 gate_up", 32, 4096, 7168, 16384),
    ("DeepSeek-V3 EP8 down", 32, 7168, 2048, 16384),
]
QUICK = [("tiny", 3, 136, 200, 90)]


def inputs(E, N, K, rows, device):
    offs = (torch.arange(1, E + 1, device=device) * (rows // E)).to(torch.int32)
    x = torch.randn(rows, K, device=device)
    w = torch.randn(E, N, K, device=device) * K**-0.5
    return x, w, offs


def quantize_blocks(x, w):
    """x [rows, K] in 1x128 blocks and each expert of w [G, N, K] in 128x128 blocks: (qa, sa, qw, sw),
    sa [rows, K/128], sw [G, N/128, K/128] contiguous."""
    qa, sa = onegemm.quantize_fp8(x)
    qw, sw = (torch.stack(t) for t in zip(*[onegemm.quantize_fp8(w[g], (128, 128)) for g in range(w.shape[0])]))
    return qa, sa, qw, sw


def check_blocked(ours, qa, sa, qw, sw, offs, what):
    """onegemm's FP8 grouped output against the dequantised float64 reference (the CPU runs)."""
    ref = grouped_mm_ref(dequantize_ref(qa, sa, 1, 128),
                         torch.stack([dequantize_ref(qw[g], sw[g], 128, 128) for g in range(qw.shape[0])]).transpose(1, 2), offs)
    assert_close(ours, ref, 1e-2, what)


def peer_ms(peer, case, prepare, like, timer):
    """A peer's GPU time on one case, or NaN with the reason printed: prepare() makes its inputs
    once, outside the timed call, and returns (call, real) where real(call()) is the output's
    real rows in onegemm's order; they must match ``like``, onegemm's output (common.differs)."""
    made, why = run_or_reason(prepare)
    if made is not None:
        call, real = made
        _, why = run_or_reason(call, lambda out: differs(real(out), like))
    if why is not None:
        print(f"  {peer} refused {case}: {why}", flush=True)
        return math.nan
    return timer(call)


def blocked_and_deepgemm(case, x, w, offs, device, timer, deepgemm=None):
    """onegemm.grouped_matmul FP8 (1x128 x 128x128 of x [rows, K] and w [G, N, K], int32 end
    offsets) checked against float64 on the CPU, then DeepGEMM on the same fp8 values and
    scales: deepgemm(qa, sa, qw, sw) makes its layout, (call, real) as peer_ms takes them (None:
    DeepGEMM absent). Returns (onegemm ms, DeepGEMM ms or NaN)."""
    qa, sa, qw, sw = quantize_blocks(x, w)
    fn = lambda: onegemm.grouped_matmul(qa, qw.transpose(1, 2), offs, scale_a=sa, scale_b=sw.transpose(1, 2))  # noqa: E731
    ours = fn()
    if device == "cpu":
        check_blocked(ours, qa, sa, qw, sw, offs, f"{case} 1x128 x 128x128")
    t_ours = timer(fn)
    if deepgemm is None:
        return t_ours, math.nan
    return t_ours, peer_ms("DeepGEMM", case, lambda: deepgemm(qa, sa, qw, sw), ours[:int(offs[-1])], timer)


def deepgemm_contiguous(dg, qa, sa, qw, sw, offs):
    """DeepGEMM's m_grouped_fp8_gemm_nt_contiguous on the rows onegemm reads unpadded, in its
    layout: each group's rows start at a multiple of get_mk_alignment_for_contiguous_layout()
    (128), padding rows zero; m_indices [M_pad] int32 holds each row's group, -1 on padding;
    A's scales [M_pad, K/128] in its TMA-aligned MN-major layout; B the [G, N, K] experts
    (K-major) with their [G, N/128, K/128] scales. Returns (call, real): call() writes and
    returns D [M_pad, N] bf16."""
    align, K = dg.get_mk_alignment_for_contiguous_layout(), qa.shape[1]
    ends = offs.tolist()
    sizes = [e - s for s, e in zip([0] + ends[:-1], ends)]
    starts = [0]
    for m in sizes:
        starts.append(starts[-1] + -(-m // align) * align)
    rows = torch.cat([torch.arange(s, s + m) for s, m in zip(starts, sizes)]).to(qa.device)
    m_indices = torch.full((starts[-1],), -1, dtype=torch.int32)
    for g, (s, m) in enumerate(zip(starts, sizes)):
        m_indices[s:s + m] = g
    a = torch.zeros(starts[-1], K, dtype=torch.uint8, device=qa.device)
    a[rows] = qa[:ends[-1]].view(torch.uint8)  # byte copies: fp8 index_put is not everywhere
    scale = torch.zeros(starts[-1], sa.shape[1], device=qa.device)
    scale[rows] = sa[:ends[-1]]
    a, scale, m_indices = a.view(qa.dtype), dg.get_mn_major_tma_aligned_tensor(scale), m_indices.to(qa.device)
    b, out = (qw, sw.contiguous()), torch.empty(starts[-1], qw.shape[1], device=qa.device, dtype=torch.bfloat16)

    def call():
        dg.m_grouped_fp8_gemm_nt_contiguous((a, scale), b, out, m_indices)
        return out
    return call, lambda d: d[rows]


def measure(name, E, N, K, rows, device, timer, dg=None):
    x, w, offs = inputs(E, N, K, rows, device)
    row = dict(gemm=name, E=E, N=N, K=K, rows=rows)
    flop = 2 * rows * N * K
    # bf16 peer
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    if device == "cuda":
        t_bf16 = timer(lambda: torch._grouped_mm(xb, wb.transpose(1, 2), offs=offs))
    else:
        t_bf16 = math.nan
    # 1x128 x 128x128, and DeepGEMM on the same fp8 values and scales in its padded layout
    t_blocked, t_dg = blocked_and_deepgemm(name, x, w, offs, device, timer,
                                           None if dg is None else lambda *q: deepgemm_contiguous(dg, *q, offs))
    # row-wise x per-channel
    qr, sr = onegemm.quantize_fp8(x, "row")
    amax = w.abs().amax(dim=2).clamp_min(1e-12)  # [E, N]
    sc = amax / 448.0
    qc = (w / sc[:, :, None]).to(torch.float8_e4m3fn)
    rowwise = lambda: onegemm.grouped_matmul(qr, qc.transpose(1, 2), offs, scale_a=sr, scale_b=sc[:, None, :])  # noqa: E731
    t_row = timer(rowwise)
    t_scaled = math.nan
    if device == "cuda" and hasattr(torch, "_scaled_grouped_mm"):
        try:
            peer = lambda: torch._scaled_grouped_mm(qr, qc.transpose(1, 2), sr.reshape(-1), sc, offs=offs,  # noqa: E731
                                                    out_dtype=torch.bfloat16)
            assert_close(peer(), rowwise(), 2e-2, f"{name} torch._scaled_grouped_mm vs onegemm")
            t_scaled = timer(peer)
        except Exception as e:  # a torch build without it, or a layout it refuses: a result too
            row["scaled_grouped_mm"] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    # Plain torch FP8: torch._scaled_mm (row-wise) per group in a Python loop over host offsets.
    t_loop = math.nan
    if device == "cuda":
        ends = offs.tolist()
        bounds = list(zip([0] + ends[:-1], ends))
        loop = lambda: [torch._scaled_mm(qr[s:e], qc[g].t(), sr[s:e], sc[g][None, :], out_dtype=torch.bfloat16)  # noqa: E731
                        for g, (s, e) in enumerate(bounds)]
        t_loop = timer(loop)
    row.update(fp8_blocked_TFLOPs=flop / (t_blocked * 1e-3) / 1e12, DeepGEMM_TFLOPs=flop / (t_dg * 1e-3) / 1e12,
               blocked_vs_DeepGEMM=t_dg / t_blocked, blocked_vs_bf16=t_bf16 / t_blocked,
               blocked_vs_scaled_grouped_mm=t_scaled / t_blocked,
               rowwise_vs_bf16=t_bf16 / t_row, rowwise_vs_scaled_grouped_mm=t_scaled / t_row,
               rowwise_vs_torch_scaled_mm_loop=t_loop / t_row)
    print(row, flush=True)
    return row


# Decode, (name, groups, mean rows per group, N, K): the FP8-decode issue's N = 4096, K = 7168 at
# 8-32 groups of 16-128 rows, then each model's expert GEMMs (SHAPES) at 16 and 128 rows over
# min(E, 32) groups (its experts a decode step hits). DeepSeek-V3 EP8's gate_up is the first.
DECODE_GEMMS = [("N4096 K7168", G, m, 4096, 7168) for G, m in ((8, 16), (8, 128), (16, 32), (16, 64), (32, 16), (32, 128))] + [
    (name, min(E, 32), m, N, K) for name, E, N, K, _ in SHAPES if (N, K) != (4096, 7168) for m in (16, 128)]
QUICK_DECODE = [("tiny", 3, 5, 136, 200)]


def deepgemm_masked(dg, qa, sa, qw, sw, sizes, expected_m):
    """DeepGEMM's m_grouped_fp8_gemm_nt_masked on the real rows onegemm reads packed, in its
    layout: A [G, max_m, K] (group g's sizes[g] rows first, zeros after; max_m the largest group
    rounded up to 128) with scales [G, max_m, K/128] in its TMA-aligned MN-major layout,
    masked_m [G] int32 = sizes; B the [G, N, K] experts (K-major) with their [G, N/128, K/128]
    scales. Returns (call, real): call() writes and returns D [G, max_m, N] bf16."""
    G, K, max_m = len(sizes), qa.shape[1], -(-max(sizes) // 128) * 128
    a = torch.zeros(G, max_m, K, dtype=torch.uint8, device=qa.device)
    scale = torch.zeros(G, max_m, sa.shape[1], device=qa.device)
    start = 0
    for g, m in enumerate(sizes):
        a[g, :m] = qa[start:start + m].view(torch.uint8)
        scale[g, :m] = sa[start:start + m]
        start += m
    a, scale = a.view(qa.dtype), dg.get_mn_major_tma_aligned_tensor(scale)
    masked_m = torch.tensor(sizes, dtype=torch.int32, device=qa.device)
    b, out = (qw, sw.contiguous()), torch.empty(G, max_m, qw.shape[1], device=qa.device, dtype=torch.bfloat16)

    def call():
        dg.m_grouped_fp8_gemm_nt_masked((a, scale), b, out, masked_m, expected_m)
        return out
    return call, lambda d: torch.cat([d[g, :m] for g, m in enumerate(sizes)])


def measure_decode(name, G, m, N, K, device, timer, dg=None):
    """onegemm's FP8 grouped GEMM at decode (1x128 x 128x128, the packed real rows, int32 end
    offsets) against DeepGEMM's masked GEMM on the same fp8 values, as TB/s of the weights."""
    rng = torch.Generator().manual_seed(1000 * G + m)
    sizes = [max(1, round(m * (0.7 + 0.6 * u))) for u in torch.rand(G, generator=rng).tolist()]
    torch.manual_seed(1000 * G + m)
    x = torch.randn(sum(sizes), K, device=device)
    w = torch.randn(G, N, K, device=device) * K**-0.5
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    # expected_m as DeepGEMM's own tests pass it: 1.2x the mean rows per group
    t_ours, t_dg = blocked_and_deepgemm(f"decode {name} G{G} m{m}", x, w, offs, device, timer,
                                        None if dg is None else lambda *q: deepgemm_masked(dg, *q, sizes, int(1.2 * m)))
    weight_bytes = G * N * K + 4 * G * -(-N // 128) * -(-K // 128)  # fp8 weights and fp32 scales: what both must read
    row = {"gemm": name, "G": G, "rows": sum(sizes), "max rows": max(sizes), "N": N, "K": K,
           "onegemm us": t_ours * 1e3, "DeepGEMM us": t_dg * 1e3,
           "onegemm weight TB/s": weight_bytes / (t_ours * 1e-3) / 1e12,
           "DeepGEMM weight TB/s": weight_bytes / (t_dg * 1e-3) / 1e12, "vs DeepGEMM": t_dg / t_ours}
    print(row, flush=True)
    return row


# T for the body sweep: decode through the medium batches where the rule's bands meet
# (Mixtral at T = 1024 has 256 pairs per expert, Qwen3 at T = 2048 128)
BODY_SWEEP = [1, 16, 64, 128, 256, 512, 1024, 2048]
# grouped_matmul alone: (name, G, N, K) over mean rows per group (each group 0.7-1.3x the mean)
GEMM_BODY_SHAPES = [("N4096 K7168", 8, 4096, 7168), ("N4096 K7168", 32, 4096, 7168),
                    ("Qwen3-30B-A3B gate_up", 32, 1536, 2048), ("Qwen3-30B-A3B down", 32, 2048, 768),
                    ("Mixtral-8x7B gate_up", 8, 28672, 4096)]
GEMM_BODY_ROWS = [16, 48, 64, 96, 128, 166, 200, 256]
# (WGMMA_MIN_GROUP_ROWS, WGMMA_DECODE_MAX_ROWS, WGMMA_GEMM_DECODE_MAX_ROWS, WGMMA_DECODE_MIN_ELEMENTS)
# that force each body
BODIES = {"triton": (10**9, -1, -1, 0), "gluon tiles": (0, -1, -1, 0), "gluon SWAP": (10**9, 10**9, 10**9, 0)}


def time_bodies(fn, row: dict) -> dict:
    """row + fn's GPU time under the dispatch rule ('rule ms') and forced onto each body, the
    fastest body and the rule's time as a fraction of the fastest."""
    from onegemm.grouped import configs
    from onegemm.core.launch import clear_plans

    names = ("WGMMA_MIN_GROUP_ROWS", "WGMMA_DECODE_MAX_ROWS", "WGMMA_GEMM_DECODE_MAX_ROWS", "WGMMA_DECODE_MIN_ELEMENTS")
    saved = [getattr(configs, n) for n in names]
    try:
        for body, values in [("rule", saved)] + list(BODIES.items()):
            for n, v in zip(names, values):
                setattr(configs, n, v)
            clear_plans()  # calls are cached with the body their first call chose
            row[f"{body} ms"] = bench_ms(fn, 10, 50)
    finally:
        for n, v in zip(names, saved):
            setattr(configs, n, v)
        clear_plans()
    row["best"] = min(BODIES, key=lambda b: row[f"{b} ms"])
    row["rule vs best"] = row[f"{row['best']} ms"] / row["rule ms"]
    return row


def decode_bodies(device):
    """The rule's evidence: FP8 moe_ffn at decode and medium batches, and grouped_matmul FP8
    over rows per group, on each body (forced through the thresholds in onegemm.grouped.configs):
    the Triton body, the Gluon body's 128/64-row tiles and its SWAP form. The file is rewritten
    after each model, so a run stopped early keeps what it finished."""
    text = header("FP8 grouped GEMMs on each body: the dispatch rule's evidence (GPU time)")
    text += ("Each body column forces one body through the dispatch thresholds (onegemm.grouped.configs "
             "WGMMA_MIN_GROUP_ROWS, WGMMA_DECODE_MAX_ROWS, WGMMA_GEMM_DECODE_MAX_ROWS, WGMMA_DECODE_MIN_ELEMENTS); "
             "'rule' is what the rule "
             "picks, 'best' the fastest body, 'rule vs best' the best time / the rule's (1: the rule picked the "
             "fastest).\n\n## 1. moe_ffn FP8\n\npairs per expert = T * top_k / routed experts; the rule sees "
             "T * top_k / local experts (DeepSeek-V3 EP8 holds 32 of 256). Skewed routing: a Zipf-like bias.\n\n")
    moe_rows, gemm_rows = [], []

    def write():
        body = text + markdown_table(moe_rows)
        if gemm_rows:
            body += ("\n\n## 2. grouped_matmul FP8 (1x128 x 128x128) over rows per group\n\nEach group holds "
                     "0.7-1.3x the mean rows; weight TB/s: the fp8 experts' bytes / the fastest body's time.\n\n"
                     + markdown_table(gemm_rows))
        write_results("moe_decode_bodies", body)

    for name, E, E_routed, H, I, k in MODELS:
        torch.manual_seed(0)
        w13 = (torch.randn(E, 2 * I, H, device=device) * H**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device=device) * I**-0.5).to(torch.bfloat16)
        q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
        for T in BODY_SWEEP:
            for skewed in (False, True):
                x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
                weights, ids = moe_routing(T, E_routed, k, skewed, device)
                row = dict(model=name, T=T, routing="skewed" if skewed else "uniform", pairs_per_expert=T * k / E_routed,
                           bf16_ms=bench_ms(lambda: onegemm.moe_ffn(x, w13, w2, weights, ids), 10, 50))
                time_bodies(lambda: onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2), row)
                row["best vs bf16"] = row["bf16_ms"] / row[f"{row['best']} ms"]
                print(row, flush=True)
                moe_rows.append(row)
        write()
    for name, G, N, K in GEMM_BODY_SHAPES:
        torch.manual_seed(0)
        w = torch.randn(G, N, K, device=device) * K**-0.5
        for m in GEMM_BODY_ROWS:
            sizes = [int(m * (0.7 + 0.6 * g / max(G - 1, 1))) for g in range(G)]
            qa, sa, qw, sw = quantize_blocks(torch.randn(sum(sizes), K, device=device), w)
            offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
            row = time_bodies(lambda: onegemm.grouped_matmul(qa, qw.transpose(1, 2), offs, scale_a=sa,
                                                             scale_b=sw.transpose(1, 2)),
                              dict(gemm=name, G=G, rows_per_group=m, N=N, K=K))
            row["best weight TB/s"] = G * N * K / (row[f"{row['best']} ms"] * 1e-3) / 1e12
            print(row, flush=True)
            gemm_rows.append(row)
        write()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU interpreter: run every path once, write nothing")
    parser.add_argument("--part", choices=["moe", "gemm", "both", "decode-bodies"], default="both",
                        help="which part to run (default both; gemm: the grouped GEMM at prefill and decode, "
                             "sections 2 and 3; decode-bodies: FP8 decode on each body)")
    parser.add_argument("--models", help="part moe: comma-separated model name fragments (default every model)")
    parser.add_argument("--tokens", help="part moe: comma-separated token counts (default decode and prefill)")
    parser.add_argument("--render", action="store_true",
                        help="part moe: no GPU; rewrite section 1 and its summary figures from the stored rows "
                             f"({ROWS_FILE.name}: rows of several --models runs, each with its GPU and commit)")
    args = parser.parse_args()
    device = "cpu" if args.quick else "cuda"

    def timer(fn):
        if args.quick:
            fn()
            return math.nan
        return bench_ms(fn, warmup_ms=10, rep_ms=50)

    if args.part == "decode-bodies":
        if args.quick:
            parser.error("--part decode-bodies times the GPU bodies: no --quick")
        decode_bodies(device)
        return
    moe_rows, rows, decode_rows = [], [], []
    vllm, copy = None, math.nan
    if args.render:
        if args.part != "moe" or args.quick:
            parser.error("--render rewrites part moe from its stored rows: --part moe, no --quick")
        moe_rows = json.loads(ROWS_FILE.read_text())
    elif args.part in ("moe", "both"):
        models, sizes = (QUICK_MODELS, [3]) if args.quick else (MODELS, DECODE + PREFILL)
        models = [m for m in models if not args.models or any(w.lower() in m[0].lower() for w in args.models.split(","))]
        sizes = [int(t) for t in args.tokens.split(",")] if args.tokens else sizes
        if not args.quick:
            vllm, copy = import_vllm_moe(), copy_tb_s(device)
        moe_rows = [measure_moe(m, T, skewed, device, timer, args.quick, vllm)
                    for m in models for T in sizes for skewed in (False, True)]
        if not args.quick:
            moe_rows = merge_moe_rows([{**r, "copy TB/s": copy} for r in moe_rows], models)
    dg = None
    if args.part in ("gemm", "both"):
        dg = import_deepgemm()
        rows = [measure(*shape, device, timer, dg) for shape in (QUICK if args.quick else SHAPES)]
        decode_rows = [measure_decode(*case, device, timer, dg) for case in (QUICK_DECODE if args.quick else DECODE_GEMMS)]
    if args.quick:
        assert all(math.isnan(r["blocked_vs_DeepGEMM"]) for r in rows) and all(math.isnan(r["vs DeepGEMM"]) for r in decode_rows)
        print("quick: every path ran; no files written")
        return
    stamp = None  # rendered figures carry their rows' provenance
    if args.render:
        stamp = {key: ", ".join(sorted({str(r.get(key, "?")) for r in moe_rows})) for key in ("gpu", "commit", "date")}
    text = header("FP8 MoE vs bf16, torch and DeepGEMM: the expert FFN and the grouped GEMM",
                  gpu=stamp and f"{stamp['gpu']} (section 1 rendered from {ROWS_FILE.name}: each row's GPU and commit)")
    # A run of one part keeps the other's sections from the last file, each saying where it came from.
    text += "" if moe_rows else kept_sections("moe_fp8", ["## 1."])
    if moe_rows:
        prefill = [r for r in moe_rows if r["T"] >= min(PREFILL)]
        decode = [r for r in moe_rows if r["T"] <= max(DECODE)]
        text += (
            "## 1. moe_ffn with FP8 experts vs bf16\n\n"
            "Ratios are the peer's time / the FP8 moe_ffn's (> 1: FP8 faster). GPU: CUDA-graph replay; eager: calls "
            "as a user makes them (host included); first call: the first FP8 call at that T in this process (new "
            "m buckets compile). Targets: FP8 >= 1.5x bf16 at prefill, >= 1.8x at decode; calc_diff of the FP8 "
            "layer < 5e-3.\n\n" + markdown_table(moe_rows) + "\n"
            f"Geomeans, FP8 vs bf16 moe_ffn (GPU): prefill {geomean([r['fp8 vs bf16 (GPU)'] for r in prefill]):.3f}, "
            f"decode {geomean([r['fp8 vs bf16 (GPU)'] for r in decode]):.3f}; eager: prefill "
            f"{geomean([r['fp8 vs bf16 (eager)'] for r in prefill]):.3f}, decode "
            f"{geomean([r['fp8 vs bf16 (eager)'] for r in decode]):.3f}.\n\n"
            "Decode against the copy speed (copy TB/s: a 1 GiB bf16 copy in the row's run, common.copy_tb_s): weight TB/s / copy, geomean "
            f"over T <= 64 where a step reads >= 100 MB of fp8 weights: FP8 {geomean(bw_ratio(decode, 'fp8')):.3f}, "
            f"bf16 {geomean(bw_ratio(decode, 'bf16')):.3f}. Rows carry the commit and GPU of their run (--models "
            f"reruns some models and keeps the others' rows). vs vLLM: vLLM {VLLM_VERSION_NOTE} fused_moe kernels' GPU "
            "time / onegemm's (its H200 config table, moe_align_block_size made outside the timed call, ids of other "
            "ranks as expert -1 blocks that it fills with zeros), geomean at T <= 512: FP8 "
            f"{geomean([r.get('fp8 vs vLLM (GPU)') for r in decode]):.3f}, bf16 "
            f"{geomean([r.get('bf16 vs vLLM (GPU)') for r in decode]):.3f}.\n\n")
    text += "" if rows else kept_sections("moe_fp8", ["## 2.", "## 3."])
    if rows:
        text += (
            "## 2. FP8 grouped GEMM (2D x 3D) vs torch and DeepGEMM, expert GEMMs at prefill\n\n"
            "GPU time; ratios are peer time / onegemm time (> 1: onegemm faster). blocked: 1x128 "
            "activations x 128x128 weights; rowwise: row-wise activations x per-channel weights, "
            "the convention of torch._scaled_grouped_mm; torch_scaled_mm_loop: plain torch, torch._scaled_mm "
            "row-wise per group in a Python loop; DeepGEMM: deep_gemm.m_grouped_fp8_gemm_nt_contiguous on the "
            "same fp8 values and scales as blocked, in its layout (groups padded to 128 rows: none here, every "
            "group has a multiple of 128), TFLOP/s on the real rows; nan where it was not importable or refused "
            "the shape (the run's log says why). Targets: >= 1.1x torch._scaled_grouped_mm "
            "row-wise and >= 1.5x bf16 torch._grouped_mm, >= 950 TFLOP/s on the Mixtral and DeepSeek-V3 shapes (issue 25).\n\n"
        )
        text += markdown_table(rows) + "\n"
        text += (f"Geomeans: blocked vs bf16 {geomean([r['blocked_vs_bf16'] for r in rows]):.3f}, blocked vs "
                 f"torch._scaled_grouped_mm {geomean([r['blocked_vs_scaled_grouped_mm'] for r in rows]):.3f}, rowwise vs bf16 "
                 f"{geomean([r['rowwise_vs_bf16'] for r in rows]):.3f}, rowwise vs torch._scaled_grouped_mm "
                 f"{geomean([r['rowwise_vs_scaled_grouped_mm'] for r in rows]):.3f}, rowwise vs the torch._scaled_mm loop "
                 f"{geomean([r['rowwise_vs_torch_scaled_mm_loop'] for r in rows]):.3f}, blocked vs DeepGEMM "
                 f"{geomean([r['blocked_vs_DeepGEMM'] for r in rows]):.3f}.\n\n")
    if decode_rows:
        text += (
            "## 3. FP8 grouped GEMM vs DeepGEMM's masked GEMM, expert GEMMs at decode\n\n"
            "GPU time; vs DeepGEMM is DeepGEMM's time / onegemm's (> 1: onegemm faster). onegemm: "
            "grouped_matmul FP8 (1x128 x 128x128) on the packed real rows with int32 end offsets; DeepGEMM: "
            "deep_gemm.m_grouped_fp8_gemm_nt_masked on [G, max_m, K] (max_m the largest group rounded up to 128) "
            "with masked_m the real rows per group and expected_m 1.2x the mean, as its tests pass it. Each group "
            "has 0.7-1.3x the mean rows. Weight TB/s: the fp8 expert weights and their fp32 scales, the bytes "
            "a decode step must read, / time; nan where DeepGEMM was not importable or refused the case.\n\n")
        text += markdown_table(decode_rows) + "\n"
        text += f"Geomean vs DeepGEMM: {geomean([r['vs DeepGEMM'] for r in decode_rows]):.3f}.\n\n"
    summary = []
    if moe_rows:
        uniform = [r for r in moe_rows if r["routing"] == "uniform"]
        summary += [
            dict(name="fp8_moe_ffn_vs_bf16_prefill", peer="onegemm moe_ffn bf16 (GPU time, T >= 4096, uniform routing)",
                 value=geomean([r["fp8 vs bf16 (GPU)"] for r in uniform if r["T"] >= min(PREFILL)])),
            dict(name="fp8_moe_ffn_vs_bf16_decode", peer="onegemm moe_ffn bf16 (GPU time, T <= 512, uniform routing)",
                 value=geomean([r["fp8 vs bf16 (GPU)"] for r in uniform if r["T"] <= max(DECODE)])),
            dict(name="fp8_moe_ffn_vs_bf16_decode_eager", peer="onegemm moe_ffn bf16 (eager, host included, T <= 512, uniform routing)",
                 value=geomean([r["fp8 vs bf16 (eager)"] for r in uniform if r["T"] <= max(DECODE)])),
            dict(name="decode_weight_bw_vs_copy",
                 peer="a 1 GiB bf16 copy in the same run: weight TB/s / copy TB/s, FP8 and bf16 moe_ffn, "
                      "T <= 64 where a step reads >= 100 MB of fp8 weights, both routings",
                 value=geomean(bw_ratio(moe_rows, "fp8") + bw_ratio(moe_rows, "bf16")))]
        versus = [r.get(f"{f} vs vLLM (GPU)") for r in moe_rows if r["T"] <= max(DECODE) for f in ("fp8", "bf16")]
        if any(v is not None and math.isfinite(v) for v in versus):
            summary.append(dict(name="moe_decode_vs_vllm_kernels", value=geomean(versus),
                                peer=f"vLLM {VLLM_VERSION_NOTE} Triton fused_moe kernels, FP8 (w8a8 block) and bf16, its "
                                     "H200 configs, alignment precomputed (GPU time, T <= 512, both routings)"))
    if rows:
        summary += [
            dict(name="fp8_grouped_vs_bf16_grouped_mm", peer="torch._grouped_mm bf16 (GPU time, prefill expert GEMMs)",
                 value=geomean([r["blocked_vs_bf16"] for r in rows])),
            dict(name="fp8_grouped_vs_scaled_grouped_mm",
                 peer="torch._scaled_grouped_mm row-wise fp8 (GPU time; onegemm's 1x128 x 128x128 blocks)",
                 value=geomean([r["blocked_vs_scaled_grouped_mm"] for r in rows])),
            dict(name="rowwise_grouped_vs_scaled_grouped_mm",
                 peer="torch._scaled_grouped_mm row-wise fp8, the same row-wise x per-channel scales (GPU time)",
                 value=geomean([r["rowwise_vs_scaled_grouped_mm"] for r in rows]))]
    if dg is not None:  # no DeepGEMM figure from a run without it, or where it refused every case
        version = getattr(dg, "__version__", "?")
        for name, ratios, peer in [
                ("grouped_fp8_vs_deepgemm_contiguous", [r["blocked_vs_DeepGEMM"] for r in rows],
                 f"DeepGEMM {version} m_grouped_fp8_gemm_nt_contiguous, 1x128 x 128x128 on its 128-row padded "
                 "layout (GPU time, prefill expert GEMMs)"),
                ("grouped_fp8_decode_vs_deepgemm_masked", [r["vs DeepGEMM"] for r in decode_rows],
                 f"DeepGEMM {version} m_grouped_fp8_gemm_nt_masked, 1x128 x 128x128 (GPU time, decode: 8-32 "
                 "groups of 16-128 rows at N 4096 K 7168 and the models' expert GEMMs)")]:
            timed = [v for v in ratios if math.isfinite(v)]
            if timed:
                summary.append(dict(name=name, value=geomean(timed), peer=peer + (
                    f" ({len(timed)} of {len(ratios)} cases; it refused the others)" if len(timed) < len(ratios) else "")))
    update_summary([e for e in summary if math.isfinite(e["value"])], stamp)  # a run of decode T alone has no prefill figure
    text += ("## What the numbers say\n\n<!-- EXPLANATION: written after reading this run's numbers. "
             "bench/bench_moe.py regenerates everything else. -->\n")
    write_results("moe_fp8", text)


if __name__ == "__main__":
    main()
