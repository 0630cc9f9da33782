"""What a PyTorch user calling onegemm eagerly sees: host time per call, eager and GPU-time
ratios at small and mid shapes, and the first call's wait at a new shape.

    python bench/bench_overhead.py           # on the H200: bench/results/overhead.md
    python bench/bench_overhead.py --quick   # CPU interpreter: every call's code path, no numbers

1. Host time per call: 2000 back-to-back calls of each public op on a tiny problem and one
   sync at the end (best of 7 rounds, alternating with its torch counterpart on the same inputs).
2. Eager and GPU time at small and mid shapes: do_bench of Python calls (host included) and
   CUDA-graph replays (GPU only), each as a ratio to torch in the same run.
3. First call at a new shape, each in a fresh process: Triton's on-disk cache empty ("cold"),
   then filled by the previous process ("warm"); in-process, the first call at each new M
   bucket once the kernel is compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import onegemm  # first: it picks Triton's interpreter when there is no GPU
import torch
import torch.nn.functional as F
from common import header, kept_sections, markdown_table, require_gpu, update_summary, write_results
from onegemm import testing

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def torch_quantize(x):
    """1x128 per-token-block fp8 quantisation in plain torch (the quantiser's peer)."""
    M, K = x.shape
    xb = x.view(M, K // 128, 128).float()
    scale = xb.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (xb / scale).clamp(-448.0, 448.0).to(E4M3).view(M, K), scale.squeeze(-1)


def torch_route(logits, k):
    w, ids = torch.topk(torch.softmax(logits.float(), -1), k, -1)
    return w / w.sum(-1, keepdim=True), ids


def scaled_mm_blockwise(qa, sa, qw, sw):
    """torch._scaled_mm's DeepSeek recipe: scale_a [M, K/128] outer-dim-major, scale_b a
    transposed view of a contiguous [N/128, K/128]."""
    return torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sw.t(), out_dtype=BF16)


def tiny_ops(device, quick=False):
    """(name, onegemm call, torch counterpart or None) on tiny problems: host-bound by design."""
    a = torch.randn(64, 256, device=device, dtype=BF16)
    w = torch.randn(512, 256, device=device, dtype=BF16)
    bias = torch.randn(512, device=device, dtype=BF16)
    ga = torch.randn(256, 256, device=device, dtype=BF16)
    gb = torch.randn(4, 512, 256, device=device, dtype=BF16).transpose(1, 2)
    offs = torch.tensor([64, 128, 192, 256], device=device, dtype=torch.int32)
    qa, sa = onegemm.quantize_fp8(a)
    qw, sw = onegemm.quantize_fp8(w, (128, 128))
    lin = torch.nn.Linear(256, 512, device=device, dtype=BF16)
    fp8_lin = onegemm.Fp8Linear.from_linear(lin)
    E, T, H, I, k = 8, 64, 256, 512, 2
    x = torch.randn(T, H, device=device, dtype=BF16)
    w_gu = torch.randn(E, 2 * I, H, device=device, dtype=BF16) * H**-0.5
    w_dn = torch.randn(E, H, I, device=device, dtype=BF16) * I**-0.5
    logits = torch.randn(T, E, device=device)
    weights, ids = onegemm.route(logits, k)
    q_gu, s_gu, q_dn, s_dn = onegemm.quantize_experts(w_gu, w_dn)
    a_grad, ga_grad = a.detach().clone().requires_grad_(), ga.detach().clone().requires_grad_()
    peer = (lambda f: None) if quick else (lambda f: f)
    return [
        ("matmul", lambda: onegemm.matmul(a, w.t()), peer(lambda: torch.matmul(a, w.t()))),
        ("linear", lambda: onegemm.linear(a, w, bias), peer(lambda: F.linear(a, w, bias))),
        ("persistent_matmul", lambda: onegemm.persistent_matmul(a, w.t()), peer(lambda: torch.matmul(a, w.t()))),
        ("grouped_matmul", lambda: onegemm.grouped_matmul(ga, gb, offs),
         peer(lambda: torch._grouped_mm(ga, gb, offs=offs))),
        ("blockscaled_matmul", lambda: onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t()),
         peer(lambda: scaled_mm_blockwise(qa, sa, qw, sw))),
        ("quantize_fp8", lambda: onegemm.quantize_fp8(a), peer(lambda: torch_quantize(a))),
        ("Fp8Linear forward", lambda: fp8_lin(a), peer(lambda: lin(a))),
        ("route", lambda: onegemm.route(logits, k), peer(lambda: torch_route(logits, k))),
        ("moe_ffn", lambda: onegemm.moe_ffn(x, w_gu, w_dn, weights, ids),
         peer(lambda: testing.moe_ffn_torch(x, w_gu, w_dn, weights, ids, use_grouped_mm=True))),
        ("moe_ffn fp8", lambda: onegemm.moe_ffn(x, q_gu, q_dn, weights, ids, w_gate_up_scale=s_gu, w_down_scale=s_dn),
         None),
        # The same calls recording gradients (an input that requires grad; no backward is run).
        ("matmul, a requires grad", lambda: onegemm.matmul(a_grad, w.t()), peer(lambda: torch.matmul(a_grad, w.t()))),
        ("linear, x requires grad", lambda: onegemm.linear(a_grad, w, bias), peer(lambda: F.linear(a_grad, w, bias))),
        ("grouped_matmul, a requires grad", lambda: onegemm.grouped_matmul(ga_grad, gb, offs),
         peer(lambda: torch._grouped_mm(ga_grad, gb, offs=offs))),
    ]


# Host-time targets: (what onegemm's us are compared with, the bound). "peer": this row's torch
# op; "F.linear": torch's F.linear row; "no grad": the same call without gradients (+ us).
HOST_TARGETS = {"matmul": ("peer", 1.3), "linear": ("peer", 1.3), "persistent_matmul": ("peer", 1.3),
                "grouped_matmul": ("peer", 1.3), "blockscaled_matmul": ("peer", 1.3),
                "Fp8Linear forward": ("F.linear", 2.5), "moe_ffn": ("F.linear", 3.0), "moe_ffn fp8": ("F.linear", 4.0),
                "matmul, a requires grad": ("no grad", 10), "linear, x requires grad": ("no grad", 10),
                "grouped_matmul, a requires grad": ("no grad", 10)}


def target_met(row):
    """(target text, 'yes'/'no'/'-') of a host-table row against HOST_TARGETS (its base_us: what
    the target compares with, timed in the same rounds)."""
    if row["op"] not in HOST_TARGETS:
        return "-", "-"
    against, bound = HOST_TARGETS[row["op"]]
    if against == "no grad":
        return f"<= no-grad + {bound} us", "yes" if row["onegemm_us"] <= row["base_us"] + bound else "no"
    return f"<= {bound}x {'torch' if against == 'peer' else 'F.linear'}", "yes" if row["onegemm_us"] <= bound * row["base_us"] else "no"


def target_base(name, ops):
    """The call a row's target compares with: its torch op, F.linear, or onegemm's same call
    without gradients."""
    if name not in HOST_TARGETS:
        return None
    against = HOST_TARGETS[name][0]
    if against == "peer":
        return ops[name][1]
    return ops["linear"][1] if against == "F.linear" else ops[name.split(",")[0]][0]


# summary.json names of the host table: (name, op, peer)
HOST_SUMMARY = [("host_matmul_vs_torch", "matmul", "torch.matmul, host us per eager call (tiny shapes)"),
                ("host_grouped_vs_torch", "grouped_matmul", "torch._grouped_mm, host us per eager call (tiny shapes)"),
                ("host_blockscaled_vs_torch", "blockscaled_matmul",
                 "torch._scaled_mm blockwise, host us per eager call (tiny shapes)")]
# summary.json names of the ratio table: (name, case, column, peer)
RATIO_SUMMARY = [("eager_2048_cube_vs_cublas", "matmul bf16 2048x2048x2048", "eager_ratio", "torch.matmul (cuBLAS), eager"),
                 ("eager_m16_vs_cublas", "matmul bf16 16x4096x4096", "eager_ratio", "torch.matmul (cuBLAS), eager"),
                 ("graph_1024_cube_vs_cublas", "matmul bf16 1024x1024x1024", "gpu_ratio",
                  "torch.matmul (cuBLAS), GPU time (CUDA-graph replay)")]


HOST_ROUNDS = 7


def host_table():
    rows = []
    calls = tiny_ops("cuda")
    ops = {name: (ours, theirs) for name, ours, theirs in calls}
    for name, ours, theirs in calls:
        # onegemm, torch and what the target compares with in alternating rounds, the best of
        # each: this host's speed drifts by tens of percent within a run, and a ratio of two
        # times taken apart would carry it.
        base = target_base(name, ops)
        us = {"ours": float("inf"), "theirs": float("inf"), "base": float("inf")}
        for _ in range(HOST_ROUNDS):
            for k, fn in (("ours", ours), ("theirs", theirs), ("base", None if base is theirs else base)):
                if fn is not None:
                    us[k] = min(us[k], testing.host_us(fn, repeats=1))
        h1, h2 = us["ours"], us["theirs"] if theirs else float("nan")
        base_us = h2 if base is theirs else us["base"] if base is not None else float("nan")
        rows.append(dict(op=name, onegemm_us=h1, torch_us=h2, onegemm_over_torch=h1 / h2, base_us=base_us))
        rows[-1]["target"], rows[-1]["met"] = target_met(rows[-1])
        print(rows[-1], flush=True)
    return rows


def shape_cases():
    """(name, onegemm call, torch call) at small and mid shapes."""
    out = []
    for M, N, K in [(1024, 1024, 1024), (2048, 2048, 2048), (16, 4096, 4096), (128, 14336, 4096), (128, 4096, 4096),
                    (4096, 4096, 4096)]:
        a = torch.randn(M, K, device="cuda", dtype=BF16)
        w = torch.randn(N, K, device="cuda", dtype=BF16)
        out.append((f"matmul bf16 {M}x{N}x{K}", lambda a=a, w=w: onegemm.matmul(a, w.t()), lambda a=a, w=w: torch.matmul(a, w.t())))
    for M, N, K in [(128, 7168, 2048), (2048, 7168, 2048)]:
        qa, sa = onegemm.quantize_fp8(torch.randn(M, K, device="cuda", dtype=BF16))
        qw, sw = onegemm.quantize_fp8(torch.randn(N, K, device="cuda", dtype=BF16), (128, 128))
        out.append((f"blockscaled {M}x{N}x{K}", lambda qa=qa, sa=sa, qw=qw, sw=sw: onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t()),
                    lambda qa=qa, sa=sa, qw=qw, sw=sw: scaled_mm_blockwise(qa, sa, qw, sw)))
    # Qwen3-30B-A3B experts at decode (512 rows over 128 experts): gate_up GEMM and the whole FFN.
    E, H, I, k = 128, 2048, 768, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T in (64, 512):
        x = torch.randn(T, H, device="cuda", dtype=BF16)
        w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=BF16) * H**-0.5
        w_dn = torch.randn(E, H, I, device="cuda", dtype=BF16) * I**-0.5
        weights, ids = onegemm.route(torch.randn(T, E, device="cuda", generator=gen), k)
        out.append((f"moe_ffn Qwen3-30B-A3B T={T}", lambda x=x, a=w_gu, b=w_dn, w=weights, i=ids: onegemm.moe_ffn(x, a, b, w, i),
                    lambda x=x, a=w_gu, b=w_dn, w=weights, i=ids: testing.moe_ffn_torch(x, a, b, w, i, use_grouped_mm=True)))
    sizes = torch.full((E,), 512 // E * k, dtype=torch.int32)
    ga = torch.randn(int(sizes.sum()), H, device="cuda", dtype=BF16)
    gb = (torch.randn(E, 2 * I, H, device="cuda", dtype=BF16) * H**-0.5).transpose(1, 2)
    offs = sizes.cumsum(0).to(torch.int32).cuda()
    out.append(("grouped gate_up Qwen3 T=512", lambda: onegemm.grouped_matmul(ga, gb, offs),
                lambda: torch._grouped_mm(ga, gb, offs=offs)))
    return out


def ratio_table():
    rows = []
    for name, ours, theirs in shape_cases():
        e1, e2 = testing.eager_ms(ours), testing.eager_ms(theirs)
        g1, g2 = testing.gpu_ms(ours), testing.gpu_ms(theirs)
        rows.append(dict(case=name, eager_ms=e1, torch_eager_ms=e2, eager_ratio=e2 / e1,
                         gpu_ms=g1, torch_gpu_ms=g2, gpu_ratio=g2 / g1,
                         config=" + ".join(dict.fromkeys(x["config"] + f" ({x['source']})" for x in testing.launched(ours)))))
        print(rows[-1], flush=True)
    return rows


# ---- first call at a new shape, in a fresh process ----

FIRST_CALLS = {
    "matmul 4096^3": "a = torch.randn(4096, 4096, device='cuda', dtype=BF16); w = torch.randn(4096, 4096, device='cuda', dtype=BF16)\n"
                     "run = lambda: onegemm.matmul(a, w.t())",
    "matmul 128x4096x4096": "a = torch.randn(128, 4096, device='cuda', dtype=BF16); w = torch.randn(4096, 4096, device='cuda', dtype=BF16)\n"
                            "run = lambda: onegemm.matmul(a, w.t())",
    "matmul 3000x5000x1000 (no table entry)": "a = torch.randn(3000, 1000, device='cuda', dtype=BF16); w = torch.randn(5000, 1000, device='cuda', dtype=BF16)\n"
                                              "run = lambda: onegemm.matmul(a, w.t())",
    "persistent_matmul 64x4096x4096": "a = torch.randn(64, 4096, device='cuda', dtype=BF16); w = torch.randn(4096, 4096, device='cuda', dtype=BF16)\n"
                                      "run = lambda: onegemm.persistent_matmul(a, w.t())",
    "blockscaled 128x7168x2048": "qa, sa = onegemm.quantize_fp8(torch.randn(128, 2048, device='cuda'))\n"
                                 "qw, sw = onegemm.quantize_fp8(torch.randn(7168, 2048, device='cuda'), (128, 128))\n"
                                 "torch.cuda.synchronize()\n"
                                 "run = lambda: onegemm.blockscaled_matmul(qa, qw.t(), sa, sw.t())",
    "moe_ffn Qwen3-30B-A3B T=512": "E, H, I = 128, 2048, 768\n"
                                   "x = torch.randn(512, H, device='cuda', dtype=BF16)\n"
                                   "wg = torch.randn(E, 2 * I, H, device='cuda', dtype=BF16); wd = torch.randn(E, H, I, device='cuda', dtype=BF16)\n"
                                   "w, i = torch.softmax(torch.randn(512, E, device='cuda'), -1).topk(8, -1); i = i.int()\n"
                                   "run = lambda: onegemm.moe_ffn(x, wg, wd, w, i)",
}

CHILD = """
import time
t0 = time.perf_counter()
import torch, onegemm
BF16 = torch.bfloat16
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
{setup}
torch.cuda.synchronize()
t2 = time.perf_counter()
run(); torch.cuda.synchronize()
t3 = time.perf_counter()
run(); torch.cuda.synchronize()
t4 = time.perf_counter()
import json; print("RESULT" + json.dumps(dict(startup=t1 - t0, first=t3 - t2, second=t4 - t3)))
"""


def first_call_table():
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        for name, setup in FIRST_CALLS.items():
            row = dict(case=name)
            for phase in ("cold", "warm"):
                proc = subprocess.run([sys.executable, "-c", CHILD.format(setup=setup)], env=env, capture_output=True, text=True)
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
                if proc.returncode or not line:
                    row[f"{phase}_first_call_s"] = "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
                    continue
                r = json.loads(line[0][len("RESULT"):])
                row[f"{phase}_first_call_s"] = r["first"]
                row[f"{phase}_startup_s"] = r["startup"]
            row["second_call_ms"] = r["second"] * 1e3 if line else float("nan")
            rows.append(row)
            print(row, flush=True)
    return rows


def new_bucket_table():
    """In one warm process: the first call at each new M bucket of a 4096 x 4096 bf16 linear
    (a plan to make; the kernel may be compiled already), after a first call at M = 4096."""
    w = torch.randn(4096, 4096, device="cuda", dtype=BF16)
    onegemm.matmul(torch.randn(4096, 4096, device="cuda", dtype=BF16), w.t())
    torch.cuda.synchronize()
    rows = []
    for M in (1, 3, 8, 24, 48, 100, 200, 300, 700, 1500, 3000, 6000, 12000, 20000):
        a = torch.randn(M, 4096, device="cuda", dtype=BF16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        onegemm.matmul(a, w.t())
        torch.cuda.synchronize()
        first = time.perf_counter() - t
        rows.append(dict(M=M, first_call_ms=first * 1e3,
                         config=testing.launched(lambda: onegemm.matmul(a, w.t()))[0]["config"]))
    return rows


def run_quick():
    for name, ours, _ in tiny_ops("cpu", quick=True):
        ours()
    print(f"quick: {len(tiny_ops('cpu', quick=True))} ops ran under the interpreter; no numbers, no files")


SECTIONS = ("host", "ratios", "buckets", "first")
SECTION_HEADINGS = {
    "host": "## Host time per eager call (tiny shapes; 2000 calls, one sync, best of 7 rounds alternating onegemm and torch)",
    "ratios": "## Eager (do_bench of Python calls) and GPU time (CUDA-graph replay), ratio = torch time / onegemm time",
    "first": "## First call at a new shape, fresh process",
    "buckets": "## First call at each new M bucket, warm process (4096 x 4096 bf16 weight)",
}


def run_full(sections=SECTIONS, name="overhead"):
    require_gpu()
    text = header("What an eager PyTorch user sees: host time per call, eager and GPU ratios, first calls")
    summary = []
    if "host" in sections:
        text += f"{SECTION_HEADINGS['host']}\n\n"
        rows = host_table()
        text += markdown_table(rows) + "\n"
        by_op = {r["op"]: r for r in rows}
        summary += [dict(name=n, value=by_op[op]["torch_us"] / by_op[op]["onegemm_us"], peer=peer) for n, op, peer in HOST_SUMMARY]
    if "ratios" in sections:
        text += (f"{SECTION_HEADINGS['ratios']}\n\n"
                 "config: what onegemm ran and where it came from (table: the shipped tuned table; heuristic: chosen from "
                 "the shape, no timing).\n\n")
        rows = ratio_table()
        text += markdown_table(rows) + "\n"
        by_case = {r["case"]: r for r in rows}
        summary += [dict(name=n, value=by_case[case][col], peer=peer) for n, case, col, peer in RATIO_SUMMARY]
    if "first" in sections:
        text += (f"{SECTION_HEADINGS['first']}\n\n"
                 "first_call_s: from the call to its synced result. startup_s: import torch + onegemm and CUDA's "
                 "initialisation, before it. cold: Triton's on-disk cache empty (a new machine); warm: filled by the "
                 "process before (the same machine, a second process).\n\n")
        text += markdown_table(first_call_table()) + "\n"
    if "buckets" in sections:
        text += f"{SECTION_HEADINGS['buckets']}\n\n"
        text += markdown_table(new_bucket_table()) + "\n"
    text += kept_sections(name, [SECTION_HEADINGS[s] for s in SECTIONS if s not in sections])
    write_results(name, text)
    if summary:
        update_summary(summary)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="run every op once under the CPU interpreter, no timing")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--name", default="overhead", help="results file name (bench/results/NAME.md)")
    args = p.parse_args()
    if args.quick:
        run_quick()
    else:
        run_full(tuple(args.sections.split(",")), args.name)
