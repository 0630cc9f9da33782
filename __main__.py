"""python -m onegemm: onegemm's main job, its MoE layers and GEMMs next to torch.

It loads the Mixtral-style layer shipped in grouped/data/ (8 experts, hidden 256,
intermediate 512, bf16), routes a batch of random tokens (top-2), runs the expert FFN through
onegemm's grouped kernels (gather + SwiGLU GEMM, routing-weighted down GEMM, fixed-order
combine) and compares it with plain torch: errors against a float64 reference of the same
routing, and timings against torch's bf16 implementation. On a GPU it then runs the expert FFN
at a real model's size (Qwen3-30B-A3B's experts, random weights) and the core GEMM at an LLM
linear's shape, each timed next to torch as a user calls them (eager) and in GPU time.

Then a DeepSeek-V3-shaped MoE layer (random weights; 256 experts, hidden 7168, moe_intermediate
2048 in bf16 on a GPU; tiny and fp32 under the interpreter) with the real router (sigmoid scores, a correction
bias, top-8 within the best 4 of 8 expert groups, routed_scaling_factor 2.5) and its shared
expert, next to transformers' DeepseekV3MoE holding the same tensors: both against a float64
reference, and timed (needs transformers; skipped without it).

Without a GPU the kernels run under Triton's CPU interpreter: correct, but slow, so the batch is
small there and the timings only say that it ran (they are not performance numbers).

    python -m onegemm                 # 4096 tokens on a GPU, 128 under the interpreter
    python -m onegemm --tokens 16384
    python -m onegemm --fp8           # also the FP8 twin of the stored layer (DeepSeek-V3 format)
    python -m onegemm --mxfp4         # also its MXFP4 twin (gpt-oss's format), and on a GPU gpt-oss-120b's size
    python -m onegemm --int4          # also its INT4 twin (compressed-tensors' pack-quantized, group 32)
"""

from __future__ import annotations

import argparse
import textwrap
import time

import torch

import onegemm
from onegemm.grouped import STORED_FP8_LAYER, STORED_LAYER
from onegemm.testing import calc_diff, int4_dequantize_ref, moe_ffn_torch, mxfp4_dequantize_ref


# The job's parts in the order it runs them: what --help lists.
PARTS = (
    "the stored MoE layer (grouped/data/mixtral_tiny.safetensors, Mixtral-style, bf16) through onegemm's grouped "
    "kernels: its error against float64 next to torch bf16's, its time next to torch's",
    "with --fp8, the layer's FP8 twin (DeepSeek-V3's format): calc_diff against the float64 layer",
    "with --mxfp4, the layer's MXFP4 twin (gpt-oss's format, weight-only): its error against float64 of the "
    "same 4-bit values and calc_diff against the unquantised layer; on a GPU also a gpt-oss-120b-shaped layer "
    "(random MXFP4 weights) timed next to the same shape in bf16",
    "with --int4, the layer's INT4 twin (compressed-tensors' symmetric pack-quantized format, group 32, "
    "weight-only): the same two errors, and on a GPU its time next to bf16",
    "on a GPU only, the expert FFN at Qwen3-30B-A3B's size (random weights), timed next to torch",
    "a DeepSeek-V3-shaped layer (random weights, the real router, a shared expert) next to transformers' "
    "DeepseekV3MoE holding the same tensors (skipped without transformers)",
    "the core GEMM, onegemm.matmul, at an LLM linear's shape: error and time next to torch.matmul",
)
DESCRIPTION = "\n".join(
    ["python -m onegemm: onegemm's main job, in parts:"]
    + [textwrap.fill(part, 100, initial_indent=f"  {i}. ", subsequent_indent="     ", break_on_hyphens=False)
       for i, part in enumerate(PARTS, 1)]
    + [textwrap.fill("Without a GPU the kernels run under Triton's CPU interpreter: small sizes, and the timings only "
                     "say that it ran.", 100)])

# Triton's CPU interpreter truncates fp32 -> bf16 where a GPU, like torch, rounds to nearest
# (docs/interpreter.md): that alone makes onegemm's bf16 error there about twice torch's.
TRUNCATION_NOTE = ("  (onegemm's about twice torch's: Triton's CPU interpreter truncates fp32 -> bf16 where torch and "
                   "a GPU round to nearest; docs/interpreter.md)")


def bf16_errors(ours: tuple, theirs: tuple, gpu: bool) -> str:
    """onegemm's and torch's bf16 errors, (label, error) each, one line each; under the
    interpreter a third line says why onegemm's is about twice torch's."""
    lines = [f"  {label}: {err:.2e}" for label, err in (ours, theirs)]
    return "\n".join(lines if gpu else [*lines, TRUNCATION_NOTE])


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def timed(fn):
    """(fn(), its wall time in ms): one call."""
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def wall_ms(fn) -> float:
    return timed(fn)[1]


def timing_line(label: str, ours, theirs, flop: float | None = None, peer: str = "torch") -> str:
    """'label: eager a ms vs b ms (r x); GPU c ms vs d ms (s x)' on a GPU (testing's timers)."""
    from onegemm import testing

    e1, e2 = testing.eager_ms(ours), testing.eager_ms(theirs)
    g1, g2 = testing.gpu_ms(ours), testing.gpu_ms(theirs)
    rate = f", {flop / g1 / 1e9:.0f} TFLOP/s" if flop else ""
    return (f"  {label}: eager {e1:.3f} ms vs {peer} {e2:.3f} ms -> {e2 / e1:.2f}x; "
            f"GPU time {g1:.3f} ms vs {g2:.3f} ms -> {g2 / g1:.2f}x{rate}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def fp8_section(x, weights, ids, layer, gpu: bool) -> bool:
    """The FP8 twin of the stored layer on the same tokens and routing: its error against the
    unquantised float64 layer (DeepSeek's calc_diff) and its time next to the bf16 layer."""
    fp8 = onegemm.MoEFFN.from_safetensors(STORED_FP8_LAYER, top_k=layer.top_k, device=x.device)
    scales = dict(w_gate_up_scale=fp8.w_gate_up_scale, w_down_scale=fp8.w_down_scale)
    y8 = onegemm.moe_ffn(x, fp8.w_gate_up, fp8.w_down, weights, ids, **scales)
    ref = moe_ffn_torch(x.double(), layer.w_gate_up.double(), layer.w_down.double(), weights, ids)
    diff = calc_diff(y8, ref)
    print(f"FP8 layer: {STORED_FP8_LAYER.name} (float8_e4m3fn experts, 128x128 weight_scale_inv; activations "
          "quantised per token in 1x128 blocks)")
    print(f"  calc_diff against the unquantised float64 layer: {diff:.2e} (bound 5e-3)")
    if gpu:
        print(timing_line("FP8 vs bf16 moe_ffn", lambda: onegemm.moe_ffn(x, fp8.w_gate_up, fp8.w_down, weights, ids, **scales),
                          lambda: onegemm.moe_ffn(x, layer.w_gate_up, layer.w_down, weights, ids)).replace("torch", "bf16"))
    print()
    return diff < 5e-3


# what each 4-bit format is, as the job prints it, and its float64 decode
W4_FORMATS = {
    "mxfp4": ("MXFP4 layer: the stored layer's experts in gpt-oss's format (e2m1 values, an e8m0 scale per 32; "
              "weight-only, x stays bf16)",
              lambda q, s: mxfp4_dequantize_ref(q.view(torch.uint8).unflatten(-1, (-1, 16)), s.view(torch.uint8))),
    "int4": ("INT4 layer: the stored layer's experts in compressed-tensors' symmetric pack-quantized format (eight "
             "values per int32, a bf16 scale per 32; weight-only, x stays bf16)", int4_dequantize_ref),
}


def w4_section(fmt, x, weights, ids, layer, gpu: bool) -> bool:
    """The stored layer's experts in a 4-bit format (quantize_experts(format=fmt)) on the same
    tokens and routing: the error against float64 of the same 4-bit values (the kernels'
    own; True when within the bf16 bound 2e-2) and calc_diff against the unquantised layer
    (the format's); on a GPU its time next to bf16 (MXFP4: also prepacked, its error and time,
    then a gpt-oss-120b-shaped layer's)."""
    q13, s13, q2, s2 = onegemm.quantize_experts(layer.w_gate_up, layer.w_down, format=fmt)
    scales = dict(w_gate_up_scale=s13, w_down_scale=s2)
    y4 = onegemm.moe_ffn(x, q13, q2, weights, ids, **scales)
    title, decode = W4_FORMATS[fmt]
    err = rel_err(y4, moe_ffn_torch(x.double(), decode(q13, s13), decode(q2, s2), weights, ids))
    ref = moe_ffn_torch(x.double(), layer.w_gate_up.double(), layer.w_down.double(), weights, ids)
    print(title)
    print(f"  relative error against float64 of the same {fmt.upper()} values: {err:.2e} (bound 2e-2)")
    print(f"  calc_diff against the unquantised float64 layer: {calc_diff(y4, ref):.2e} (the format's own error)")
    prepacked = None
    if fmt == "mxfp4" and gpu:  # the same experts in fragment order (tests/test_prepack.py checks them on the CPU)
        prepacked = onegemm.prepack_mxfp4(q13, s13, gate_up=True), onegemm.prepack_mxfp4(q2, s2)
        y4p = onegemm.moe_ffn(x, *prepacked, weights, ids)
        err = max(err, rel_err(y4p, moe_ffn_torch(x.double(), decode(q13, s13), decode(q2, s2), weights, ids)))
        print(f"  prepacked (fragment order): relative error {rel_err(y4p, y4.double()):.2e} against the stored layout's")
    if gpu:
        bf16 = lambda: onegemm.moe_ffn(x, layer.w_gate_up, layer.w_down, weights, ids)  # noqa: E731
        print(timing_line(f"{fmt.upper()} vs bf16 moe_ffn", lambda: onegemm.moe_ffn(x, q13, q2, weights, ids, **scales),
                          bf16).replace("torch", "bf16"))
        if prepacked is not None:
            print(timing_line("MXFP4 prepacked vs bf16 moe_ffn", lambda: onegemm.moe_ffn(x, *prepacked, weights, ids),
                              bf16).replace("torch", "bf16"))
            gpt_oss_120b_timing(x.shape[0], x.device)
    print()
    return err < 2e-2


def gpt_oss_120b_timing(T, device):
    """gpt-oss-120b's experts (128 x [5760, 2880] / [2880, 2880], top-4): random MXFP4 bytes
    (e8m0 scales near the weights' scale) against bf16 weights of the same shape, T tokens."""
    E, H, I, k = 128, 2880, 2880, 4
    blocks = [torch.randint(0, 256, (E, n, m // 2), dtype=torch.uint8, device=device) for n, m in ((2 * I, H), (H, I))]
    q13, q2 = (b.view(torch.float4_e2m1fn_x2) for b in blocks)
    s13, s2 = (torch.full((E, n, m // 32), 119, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
               for n, m in ((2 * I, H), (H, I)))
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, I, device=device, dtype=torch.bfloat16) * I**-0.5
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
    weights, ids = onegemm.route(torch.randn(T, E, device=device), k)
    bf16 = lambda: onegemm.moe_ffn(x, w13, w2, weights, ids)  # noqa: E731
    print(timing_line(f"gpt-oss-120b experts, {T} tokens, MXFP4 vs bf16",
                      lambda: onegemm.moe_ffn(x, q13, q2, weights, ids, w_gate_up_scale=s13, w_down_scale=s2),
                      bf16).replace("torch", "bf16"))
    p13, p2 = onegemm.prepack_mxfp4(q13, s13, gate_up=True), onegemm.prepack_mxfp4(q2, s2)
    print(timing_line(f"gpt-oss-120b experts, {T} tokens, MXFP4 prepacked vs bf16",
                      lambda: onegemm.moe_ffn(x, p13, p2, weights, ids), bf16).replace("torch", "bf16"))


# DeepSeek-V3's MoE layer (transformers' DeepseekV3Config fields); under the interpreter the same
# router on 32 experts (8 groups of 4) at a tiny width.
DEEPSEEK_V3 = dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                   n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1)
DEEPSEEK_TINY = {**DEEPSEEK_V3, "hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 32}


def same_experts(ids, ids_ref) -> float:
    """The fraction of tokens whose k experts are those of the reference (in any order)."""
    ids, ids_ref = ids.long().sort(-1).values, ids_ref.long().to(ids.device).sort(-1).values
    return (ids == ids_ref).all(-1).float().mean().item()


def deepseek_section(T: int, device: str, dtype: torch.dtype, sizes: dict) -> bool:
    """A DeepSeek-V3-shaped layer (random weights, the real router, one shared expert) as
    MoEFFN and as transformers' DeepseekV3MoE holding the same tensors (MoEFFN.from_state_dict
    of the block): routing and output against the float64 layer, and on CUDA their times.
    True when both errors are within testing.TOL of ``dtype`` (transformers': the float64
    layer is built from MoEFFN's tensors, so this checks the conversion) and, in bf16,
    onegemm's is within 1.5x of transformers' own. The interpreter runs fp32: its bf16 stores
    truncate (docs/interpreter.md)."""
    try:
        import transformers
    except ImportError:
        print("DeepSeek-V3-shaped layer: skipped (transformers is not installed: pip install transformers)\n")
        return True
    from onegemm.testing import TOL, hf_forward, hf_moe_block, hf_moe_config, moe_layer_ref

    cfg = hf_moe_config("deepseek_v3", **sizes)
    if cfg is None:
        print(f"DeepSeek-V3-shaped layer: skipped (transformers {transformers.__version__} has no DeepseekV3)\n")
        return True
    block = hf_moe_block(cfg, dtype=dtype, device=device)
    layer = onegemm.MoEFFN.from_state_dict(block.state_dict(), cfg)  # the block's tensors, not copies
    E, H, I = sizes["n_routed_experts"], sizes["hidden_size"], sizes["moe_intermediate_size"]
    print(f"DeepSeek-V3-shaped layer (random weights) next to transformers {transformers.__version__} DeepseekV3MoE "
          f"holding the same tensors: {E} experts, hidden {H}, moe_intermediate {I}, {dtype}, {T} tokens")
    print(f"  router: sigmoid scores + e_score_correction_bias, top-{sizes['num_experts_per_tok']} within the best "
          f"{sizes['topk_group']} of {sizes['n_group']} expert groups, renormalised, x "
          f"{sizes['routed_scaling_factor']}; {sizes['n_shared_experts']} shared expert")
    x = torch.randn(T, H, device=device).to(dtype)
    (y, ms_ours), (theirs, ms_theirs) = timed(lambda: layer(x)), timed(lambda: hf_forward(block, x))
    ref, (_, ids_ref) = moe_layer_ref(layer, x)
    ours_ids, their_ids = layer.route(x)[1], block.gate(x)[2]
    e_ours, e_theirs = rel_err(y, ref), rel_err(theirs, ref)
    print(f"  routing: {100 * same_experts(ours_ids, ids_ref):.2f}% of tokens pick the float64 router's experts "
          f"(transformers: {100 * same_experts(their_ids, ids_ref):.2f}%)")
    print(f"  relative error against the float64 layer: onegemm MoEFFN {e_ours:.2e}, transformers {e_theirs:.2e}; "
          f"onegemm vs transformers {rel_err(y, theirs):.2e}")
    if device == "cuda":
        print(timing_line("layer", lambda: layer(x), lambda: hf_forward(block, x), peer="transformers"))
    else:
        print(f"  time: onegemm MoEFFN {ms_ours:.1f} ms (interpreted), transformers {ms_theirs:.1f} ms")
    print()
    return e_ours < TOL[dtype] and e_theirs < TOL[dtype] and (dtype == torch.float32 or e_ours <= 1.5 * e_theirs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onegemm", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="batch size T for the stored layer (default: 4096 on a GPU, 128 interpreted)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens and weights (default: 0)")
    parser.add_argument("--fp8", action="store_true",
                        help="also run the stored layer's FP8 twin (e4m3 experts + 128x128 weight_scale_inv)")
    parser.add_argument("--mxfp4", action="store_true",
                        help="also run its MXFP4 twin (gpt-oss's format; on a GPU also gpt-oss-120b's size)")
    parser.add_argument("--int4", action="store_true",
                        help="also run its INT4 twin (compressed-tensors' pack-quantized format, group 32)")
    args = parser.parse_args(argv)
    # An inference job: no autograd recording (MoEFFN's parameters are trainable).
    with torch.inference_mode():
        return run(args)


def qwen3_section(T, device):
    """A real model's experts on a GPU: Qwen3-30B-A3B (128 experts, hidden 2048, intermediate
    768, top-8), random weights scaled like trained ones, against torch."""
    E2, H2, I2, k2 = 128, 2048, 768, 8
    x2 = torch.randn(T, H2, device=device, dtype=torch.bfloat16)
    gu2 = torch.randn(E2, 2 * I2, H2, device=device, dtype=torch.bfloat16) * H2**-0.5
    dn2 = torch.randn(E2, H2, I2, device=device, dtype=torch.bfloat16) * I2**-0.5
    w2, i2 = onegemm.route(torch.randn(T, E2, device=device), k2)
    y2, p2 = onegemm.moe_ffn(x2, gu2, dn2, w2, i2), moe_ffn_torch(x2, gu2, dn2, w2, i2, use_grouped_mm=True)
    print(f"  Qwen3-30B-A3B experts ({E2} x [{2 * I2}, {H2}] / [{H2}, {I2}], top-{k2}), {T} tokens: "
          f"onegemm vs torch relative difference {rel_err(y2, p2):.2e}")
    print(timing_line("Qwen3-30B-A3B experts", lambda: onegemm.moe_ffn(x2, gu2, dn2, w2, i2),
                      lambda: moe_ffn_torch(x2, gu2, dn2, w2, i2, use_grouped_mm=True),
                      2 * T * k2 * 3 * H2 * I2))


def core_gemm_section(T, device, gpu) -> float:
    """The core GEMM everything is built on, at an LLM linear's shape on a GPU (the down
    projection of a 14336-wide MLP: Llama-3-8B, Mixtral's experts) over the batch; returns
    onegemm's relative error against float64."""
    M, N, K = (T, 4096, 14336) if gpu else (128, 256, 256)
    a = torch.randn(M, K, device=device).to(torch.bfloat16)
    w = (torch.randn(N, K, device=device) * K**-0.5).to(torch.bfloat16)
    c = onegemm.matmul(a, w.t())
    c_ref = a.double() @ w.double().t()
    print(f"\ncore GEMM [{M}, {K}] @ [{K}, {N}] bf16 (weight as W.t()), relative error against float64:")
    print(bf16_errors(("onegemm.matmul", rel_err(c, c_ref)), ("torch.matmul", rel_err(a @ w.t(), c_ref)), gpu))
    if gpu:
        print(timing_line("onegemm.matmul vs torch.matmul", lambda: onegemm.matmul(a, w.t()), lambda: a @ w.t(), 2 * M * N * K))
    else:
        t_c, t_t = wall_ms(lambda: onegemm.matmul(a, w.t())), wall_ms(lambda: a @ w.t())
        print(f"  time: onegemm.matmul {t_c:.1f} ms (interpreted), torch.matmul {t_t:.1f} ms")
    return rel_err(c, c_ref)


def run(args) -> int:
    gpu = not onegemm.INTERPRET
    device = "cuda" if gpu else "cpu"
    where = f"GPU {torch.cuda.get_device_name()}" if gpu else "Triton CPU interpreter (no GPU: slow, timings are not performance)"
    T = args.tokens or (4096 if gpu else 128)
    torch.manual_seed(args.seed)

    layer = onegemm.MoEFFN.from_safetensors(STORED_LAYER, top_k=2, device=device)
    E, H = layer.gate_weight.shape
    I = layer.w_down.shape[2]
    print(f"onegemm {onegemm.__version__}: {where}; torch {torch.__version__}")
    print(f"layer: {STORED_LAYER.name}: {E} experts, hidden {H}, intermediate {I}, {layer.w_gate_up.dtype}, top-{layer.top_k}")
    print(f"batch: {T} tokens\n")

    x = torch.randn(T, H, device=device).to(layer.w_gate_up.dtype)
    weights, ids = onegemm.route(layer.router_logits(x), layer.top_k)
    loads = torch.bincount(ids.reshape(-1).long(), minlength=E).tolist()
    print(f"rows per expert (sorted on the device into grouped_matmul's offs): {loads}")

    y = layer(x)
    # Errors: the same routing, in float64 (the reference) and in torch bf16 (the peer).
    w_gu, w_dn = layer.w_gate_up, layer.w_down
    ref = moe_ffn_torch(x.double(), w_gu.double(), w_dn.double(), weights, ids)
    torch_bf16 = moe_ffn_torch(x, w_gu, w_dn, weights, ids, use_grouped_mm=gpu)
    logits64 = x.double() @ layer.gate_weight.double().t()
    _, ids64 = torch.topk(logits64, layer.top_k, dim=-1)
    same_experts = (ids.long().sort(-1).values == ids64.sort(-1).values).all(-1).float().mean().item()
    print(f"routing: {100 * same_experts:.2f}% of tokens pick the same experts as float64 logits")
    print("expert FFN, relative Frobenius error against float64 torch on the same routing:")
    print(bf16_errors(("onegemm MoEFFN (grouped_matmul kernels)", rel_err(y, ref)),
                      (f"torch {x.dtype} ({'torch._grouped_mm' if gpu else 'torch.mm per expert'})",
                       rel_err(torch_bf16, ref)), gpu))
    print(f"  bitwise identical on a rerun: {torch.equal(layer(x), y)}")

    ok_fp8 = fp8_section(x, weights, ids, layer, gpu) if args.fp8 else True
    ok_w4 = all(w4_section(fmt, x, weights, ids, layer, gpu) for fmt in ("mxfp4", "int4") if getattr(args, fmt))

    one = lambda: onegemm.moe_ffn(x, w_gu, w_dn, weights, ids)  # noqa: E731
    peer = lambda: moe_ffn_torch(x, w_gu, w_dn, weights, ids, use_grouped_mm=gpu)  # noqa: E731
    print("expert FFN time (routing excluded):")
    if gpu:
        print(timing_line(f"stored layer, {T} tokens", one, peer))
    else:
        print(f"  onegemm.moe_ffn: {wall_ms(one):9.1f} ms, torch: {wall_ms(peer):9.1f} ms (interpreted)")

    if gpu:
        qwen3_section(T, device)

    ok_deepseek = (deepseek_section(T, device, torch.bfloat16, DEEPSEEK_V3) if gpu
                   else deepseek_section(min(T, 16), device, torch.float32, DEEPSEEK_TINY))

    c_err = core_gemm_section(T, device, gpu)
    ok = rel_err(y, ref) < 2e-2 and c_err < 1e-2
    print("\nOK" if ok and ok_fp8 and ok_w4 and ok_deepseek else "\nFAILED: error above the bf16 bound (2e-2)"
          if not ok else "\nFAILED: FP8 layer's calc_diff above 5e-3" if not ok_fp8
          else "\nFAILED: a 4-bit layer's error above 2e-2" if not ok_w4
          else "\nFAILED: the DeepSeek-V3-shaped layer's error above the bound (or 1.5x transformers' on a GPU)")
    return 0 if ok and ok_fp8 and ok_w4 and ok_deepseek else 1


if __name__ == "__main__":
    raise SystemExit(main())
