"""ptxas figures of core's Gluon FP8 body (core/hopper_fp8.py), compiled for sm_90 on any machine.

Every config the body is tuned over (core/hopper_configs.py wgmma_candidates), per scale granularity
and output dtype, compiled offline and run through ``ptxas -v --warn-on-spills``: registers,
spill bytes, shared memory, wgmma count and any ptxas warning (C7515 says ptxas serialised
the wgmmas). A change to the K loop should keep every row at 0 spills and no warning:

    python tools/wgmma_ptxas.py                 # markdown table on stdout
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRITON_INTERPRET", "0")  # compile for the GPU even without one

import ptx_snapshot  # noqa: E402 - after the interpreter switch

ptx_snapshot._fake_sm90_driver()

import torch  # noqa: E402
from triton.backends.nvidia import compiler as nv  # noqa: E402

from onegemm.core import configs, hopper_configs  # noqa: E402
from onegemm.core.hopper_fp8 import Groups, blockscaled_wgmma_kernel, k_loop_meta  # noqa: E402
from onegemm.core.scaling import BLOCKS, BLOCKWISE, COL_BLOCKS, ROW_BLOCKS, ROWWISE, Scaling  # noqa: E402
from onegemm.core.tiles import NO_OPERAND, NO_VECTOR, Operand, Scales, Vector  # noqa: E402

OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compile_config(cfg, scaling: Scaling, out: str, M=4096, N=4096, K=4096, mode="dense", fast_accum=False):
    """Compile the body for ``cfg``: dense (block scales, or epilogue scales with or without
    fast_accum), or a grouped mode over G = 16 groups ("grouped" / "decode": bf16 out
    scattered with routing weights, as MoE GEMM2; "swiglu" / "decode_swiglu": fp8 out, as GEMM1)."""
    a = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    meta = k_loop_meta(scaling, fast_accum)
    if mode == "dense":
        b = torch.empty(N, K, dtype=torch.float8_e4m3fn).t()
        c = torch.empty(M, N, dtype=OUT_DTYPES[out])
        if scaling.a_per_k_block:
            sa = torch.empty(M // scaling.sa_rows, K // 128)
            sb = torch.empty(K // 128, N // scaling.sb_cols)
            scales = Scales(a=Operand(sa, *sa.stride()), b=Operand(sb, *sb.stride()))
        else:
            sa, sb = torch.empty(M, 1), torch.empty(1, N)
            scales = Scales(m=Vector(sa, sa.stride(0)), n=Vector(sb, sb.stride(1)))
        return blockscaled_wgmma_kernel.warmup(
            Operand(a, *a.stride()), Operand(b, *b.stride()), Operand(c, *c.stride()), M, N, K,
            scales, NO_VECTOR, Groups(None, None, 1, N, 0, 0), ACTIVATION=None, **meta, **cfg.kwargs,
            grid=(132,), num_warps=cfg.num_warps)
    G = 16
    swiglu = mode.endswith("swiglu")
    rows = 2 * N if swiglu else N
    w = torch.empty(G, rows, K, dtype=torch.float8_e4m3fn)
    c = torch.empty(M, N, dtype=torch.float8_e4m3fn if swiglu else OUT_DTYPES[out])
    sa = torch.empty(K // 128, M).t()
    sb = torch.empty(G, rows // 128, K // 128).transpose(1, 2)
    so = torch.empty(N // 128, M).t()
    sched, count = torch.empty(64, 4, dtype=torch.int32), torch.empty(1, dtype=torch.int32)
    scatter, weight = (None, None) if swiglu else (torch.empty(M, dtype=torch.int32), torch.empty(M))
    out_scale = Operand(so, *so.stride()) if swiglu else NO_OPERAND
    if scaling.a_per_k_block:
        scales = Scales(a=Operand(sa, *sa.stride()), b=Operand(sb, sb.stride(1), sb.stride(2)), out=out_scale)
    else:  # row-wise [M, 1] and per-column [G, 1, N], as grouped_matmul passes them
        sa, sb = torch.empty(M, 1), torch.empty(G, 1, rows)
        scales = Scales(m=Vector(sa, sa.stride(0)), n=Vector(sb, sb.stride(2)), out=out_scale)
    return blockscaled_wgmma_kernel.warmup(
        Operand(a, *a.stride()), Operand(w, 1, w.stride(1)), Operand(c, *c.stride()), M, N, K,
        scales, NO_VECTOR, Groups(sched, count, G, rows, sb.stride(0), 0, scatter, weight),
        ACTIVATION=None, **meta, GROUPED=True, SWIGLU=swiglu, SWAP=mode.startswith("decode"), **cfg.kwargs,
        grid=(132,), num_warps=cfg.num_warps)


def ptxas_log(kernel) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        run = subprocess.run([str(Path(nv.__file__).parent / "bin" / "ptxas"), "-arch=sm_90a", "-v", "--warn-on-spills",
                              f.name, "-o", os.devnull], capture_output=True, text=True)
    return run.stdout + run.stderr


def main() -> int:
    print("| scaling | out | mode | config | registers | spill bytes | shared bytes | wgmma | setmaxnreg | ptxas warnings |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    only = sys.argv[1] if len(sys.argv) > 1 else None  # e.g. "fast": the keys whose str() holds it
    dense = (BLOCKWISE, Scaling(BLOCKS, BLOCKS), Scaling(ROW_BLOCKS, COL_BLOCKS), ROWWISE)
    keys = [hopper_configs.WgmmaKey(4096, 4096, 4096, s, out) for s in dense for out in OUT_DTYPES]
    keys += [hopper_configs.WgmmaKey(4096, 4096, 4096, ROWWISE, out, fast_accum=True) for out in OUT_DTYPES]
    keys += [hopper_configs.WgmmaKey(4096, 4096, 4096, s, out, mode) for s, out, mode in (
        (BLOCKWISE, "bf16", "grouped"), (ROWWISE, "bf16", "grouped"), (BLOCKWISE, "fp8", "swiglu"),
        (BLOCKWISE, "bf16", "decode"), (BLOCKWISE, "fp8", "decode_swiglu"))]
    for key in keys:
        if only and only not in str(key):
            continue
        scaling, out, mode = key.scaling, key.out, key.mode
        for cfg in hopper_configs.wgmma_candidates(key, 132):
            kernel = compile_config(cfg, scaling, out, mode=mode, fast_accum=key.fast_accum)
            log = ptxas_log(kernel)
            fp = ptx_snapshot.fingerprint(kernel)
            spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
            warns = sorted({w.strip() for w in re.findall(r"ptxas warning\s*:(.*)", log)})
            regs = "/".join(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])[:3])
            wgmma = sum(v for op, v in fp["ops"].items() if "GMMA" in op)
            bad += bool(spill or warns)
            print(f"| {scaling} | {out} | {mode}{' fast' if key.fast_accum else ''} | {configs.label(cfg)} | {fp['regs']} | {spill} | {fp['shared']} | {wgmma} | "
                  f"{regs} | {'; '.join(warns) or '-'} |", flush=True)
    print(f"\n{bad} configs with spills or warnings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
