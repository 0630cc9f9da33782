"""Compile onegemm's GEMM kernels for sm_90 on any machine (no GPU) and fingerprint them.

A refactor of the tile body that should not change the math should not change the compiled
code either. This tool compiles every config of the shipped H200 table (plus bias/activation
and MoE variants) through the ops themselves, exactly as a GPU run would specialise them, and
writes one line per kernel: the SASS opcode counts, registers, spills and shared memory.
Two snapshots (before and after a change) compare with ``--diff``:

    python tools/ptx_snapshot.py --out /tmp/before.json            # at the old commit
    python tools/ptx_snapshot.py --out /tmp/after.json             # at the new one
    python tools/ptx_snapshot.py --diff /tmp/before.json /tmp/after.json

SASS opcode counts rather than PTX text: PTX carries source line numbers and parameter names,
which any edit moves. This is a maintainer's tool: it reaches into the launcher (compile only,
nothing is launched) and fakes a CUDA driver for an sm_90 target.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")  # compile for the GPU even without one


def _fake_sm90_driver():
    import torch
    import triton.runtime.driver as drv
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Sm90(CudaDriver):
        def __init__(self):
            self.utils = None

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

    drv.set_active(Sm90())
    import contextlib

    torch._C._cuda_getDevice = lambda: None  # the launcher's device check; plans are on the CPU
    torch.cuda.device = lambda index: contextlib.nullcontext()
    from onegemm.core import checks, launch, tables, tma

    tables.tuned_config = lambda family, key, device: None  # unforced calls take the heuristic

    checks.check_device = lambda name, t: None  # CPU tensors stand in for CUDA ones
    tma.tma_hardware = lambda device: True  # as on the H200: the TMA flavour is available
    from onegemm.grouped import w4

    w4.tma_hardware = tma.tma_hardware  # (w4 holds its own name for it)


BIN = None


def fingerprint(kernel) -> dict:
    """Registers, spills, shared memory and SASS opcode counts of a compiled kernel."""
    from triton.backends.nvidia import compiler as nv

    bin_dir = Path(nv.__file__).parent / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1)] += 1
    res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return {"regs": int(res.get("REG", -1)), "spills": int(res.get("LOCAL", 0)) + int(res.get("STACK", 0)),
            "shared": kernel.metadata.shared, "sass": sum(ops.values()), "ops": dict(sorted(ops.items()))}


def cases():
    """(name, thunk) for every kernel to compile: the H200 table's configs and variants."""
    import torch
    import triton

    import onegemm
    from onegemm.core import configs
    from onegemm.core.scaling import BLOCKS, COL, COL_BLOCKS, ROW, ROW_BLOCKS, TENSOR, Scaling
    from onegemm.grouped.ops import ragged_launch

    def launch_ragged(a, b, c, offs, **kwargs):  # one launch of ragged_kernel
        ragged_launch(a, b, c, offs, **kwargs).run(c)

    table = json.loads((Path(onegemm.__file__).parent / "core" / "tuned" / "NVIDIA_H200.json").read_text())["configs"]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

    def operand(rows, cols, dtype, contiguous_rows, extra=()):
        """[rows, cols] with unit stride along cols if contiguous_rows, else along rows."""
        if contiguous_rows:
            return torch.empty(*extra, rows, cols, dtype=dtype)
        return torch.empty(*extra, cols, rows, dtype=dtype).transpose(-1, -2)

    def parse(key):
        return dict(re.findall(r"(\w+)=(\S+)", key)), key.split()[0]

    for key, raw in table.get("matmul", {}).items():
        f, dt = parse(key)
        config = configs.from_json(raw)
        M, N, K = int(f["m"]), int(f["n"]), int(f["k"])
        dtype = dtypes[dt]
        a = operand(M, K, dtype, f["a_k"] == "1")
        b = operand(K, N, dtype, f["b_k"] == "0")
        tma = bool(config.kwargs.get("USE_TMA", False))
        yield f"matmul {key}", lambda a=a, b=b, c=config, t=tma: onegemm.matmul(a, b, config=c, tma=t)
        if dt == "bf16" and M >= 1024:
            bias = torch.empty(N, dtype=dtype)
            yield f"matmul+bias,gelu {key}", lambda a=a, b=b, c=config, t=tma, bias=bias: onegemm.matmul(
                a, b, bias=bias, activation="gelu", config=c, tma=t)

    for key, raw in table.get("blockscaled", {}).items():
        f, _ = parse(key)
        config = configs.from_json(raw)
        M, N, K = int(f["m"]), int(f["n"]), int(f["k"])
        scaling = Scaling.parse(key.split()[-1])
        a = operand(M, K, torch.float8_e4m3fn, f["a_k"] == "1")
        b = operand(K, N, torch.float8_e4m3fn, f["b_k"] == "0")
        kb, mb, nb = triton.cdiv(K, 128), triton.cdiv(M, 128), triton.cdiv(N, 128)
        sa = {TENSOR: torch.ones(()), ROW: torch.ones(M, 1), ROW_BLOCKS: torch.ones(M, kb),
              BLOCKS: torch.ones(mb, kb)}[scaling.a]
        sb = {TENSOR: torch.ones(()), COL: torch.ones(1, N), COL_BLOCKS: torch.ones(kb, N),
              BLOCKS: torch.ones(kb, nb)}[scaling.b]
        tma = bool(config.kwargs.get("USE_TMA", False))
        yield f"blockscaled {key}", lambda a=a, b=b, sa=sa, sb=sb, c=config, t=tma: onegemm.blockscaled_matmul(
            a, b, sa, sb, config=c, tma=t)

    G = 8
    for key, raw in table.get("ragged", {}).items():
        f, dt = parse(key)
        config = configs.from_json(raw)
        dtype = dtypes["e4m3" if dt == "fp8" else dt]
        rows, N, K = int(f["m"]), int(f["n"]), int(f["k"])
        tma = bool(config.kwargs.get("USE_TMA", False))
        if f["ragged"] != "M":
            continue  # the tables hold MoE-shaped keys only
        M = rows * G
        offs = torch.arange(1, G + 1, dtype=torch.int32) * rows
        swiglu, gather = f["swiglu"] == "1", f["gather"] == "1"
        b = operand(K, 2 * N if swiglu else N, dtype, f["b_k"] == "0", extra=(G,))
        scaling = Scaling.parse(f["scaling"]) if "scaling" in f else None
        c = torch.empty(M, N, dtype=dtype if scaling is not None and scaling.fp8_out else
                        torch.bfloat16 if dtype.itemsize == 1 else dtype)
        common = dict(ragged="M", G=G, M=M, N=N, K=K, strides_b=tuple(b.stride()), strides_c=(0, *c.stride()),
                      rows_per_group=rows, config=config, tma=tma)
        if scaling is not None:
            common.update(scales=_ragged_scales(scaling, G, M, N, K, swiglu), scaling=scaling)
        if gather:
            x = torch.empty(M // 2, K, dtype=dtype)
            idx = torch.zeros(M, dtype=torch.int32)
            yield f"ragged {key}", lambda x=x, b=b, c=c, idx=idx, kw=common: launch_ragged(
                x, b, c, offs, strides_a=(0, *x.stride()), a_rows=idx, swiglu=True, **kw)
        else:
            a = operand(M, K, dtype, f["a_k"] == "1")
            yield f"ragged {key}", lambda a=a, b=b, c=c, kw=common: launch_ragged(
                a, b, c, offs, strides_a=(0, *a.stride()), **kw)
            if not swiglu:
                idx = torch.zeros(M, dtype=torch.int32)
                w = torch.empty(M, dtype=torch.float32)
                kw = {**common, "tma": False, "config": configs.with_meta(config, USE_TMA=False)}
                yield f"ragged+scatter {key}", lambda a=a, b=b, c=c, idx=idx, w=w, kw=kw: launch_ragged(
                    a, b, c, offs, strides_a=(0, *a.stride()), c_rows=idx, weight=w, **kw)

    # 4-bit experts (gpt-oss-shaped, 4 experts): MXFP4 as stored and prepacked, and INT4, each
    # at the same forced tiles (decode to prefill heights) and with the packed bytes read both
    # ways (through pointers and through a descriptor), so that their counts compare
    E, N, K = 4, 2880, 2880
    kp = -(-K // 128) * 128
    mxfp4 = torch.empty(E, N, K // 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    e8m0 = torch.empty(E, N, K // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    int4, int4_scale = torch.empty(E, N, K // 8, dtype=torch.int32), torch.empty(E, N, K // 32, dtype=torch.bfloat16)
    prepacked = onegemm.grouped.PrepackedMxfp4(torch.empty(E, N, kp // 2, dtype=torch.uint8),
                                                torch.empty(E, N, kp // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu), K)
    weights = {"mxfp4": (mxfp4.transpose(1, 2), e8m0.transpose(1, 2)), "int4": (int4.transpose(1, 2), int4_scale.transpose(1, 2)),
               "mxfp4-prepacked": (prepacked, None)}
    for tile in (configs.cfg(16, 128, 128, 4, 3), configs.cfg(64, 128, 128, 4, 3), configs.cfg(128, 128, 128, 8, 3)):
        rows = tile.kwargs["BLOCK_M"]
        a = torch.empty(E * rows, K, dtype=torch.bfloat16)
        offs = torch.arange(1, E + 1, dtype=torch.int32) * rows
        for fmt, (b, sb) in weights.items():
            for tma in (True, False):
                name = f"w4 {fmt} {rows}x128x128 w{tile.num_warps} {'tma' if tma else 'ptr'}"
                yield name, lambda a=a, b=b, sb=sb, offs=offs, c=tile, t=tma: onegemm.grouped_matmul(
                    a, b, offs, scale_b=sb, tma=t, config=c)

    for dt in ("bf16", "fp32"):
        dtype = dtypes[dt]
        xs = [torch.empty(m, 64, dtype=dtype) for m in (17, 300)]
        ws = [torch.empty(64, n, dtype=dtype) for n in (33, 128)]
        yield f"list {dt}", lambda xs=xs, ws=ws: onegemm.grouped_matmul(xs, ws)


def _ragged_scales(scaling, G, M, N, K, swiglu):
    """grouped_scales of an FP8 grouped key's Scaling, fp32 ones of the right shapes."""
    import torch

    from onegemm.grouped.kernels import grouped_scales

    kb, nb = -(-K // 128), -(-N // 128)
    return grouped_scales(
        a=torch.ones(kb, M).t() if scaling.a_per_k_block else None,
        m=None if scaling.a_per_k_block else torch.ones(M),
        b=torch.ones(G, kb, nb * (2 if swiglu else 1)) if scaling.b_per_k_block else None,
        n=None if scaling.b_per_k_block else torch.ones(G, N),
        out=torch.ones(nb, M).t() if scaling.fp8_out else None)


def snapshot(out: Path, only: str | None) -> None:
    _fake_sm90_driver()
    from onegemm.core import launch

    compiled = []
    # One wrapper per kernel: two launchers (matmul's and blockscaled's) share matmul_kernel.
    for fn in {id(x.fn): x.fn for x in launch.launchers()}.values():
        run = fn.run

        def recording(*args, _run=run, **kwargs):
            kernel = _run(*args, **kwargs)
            compiled.append(kernel)
            return kernel

        fn.run = recording
    launch._WARMUP.on = True  # compile only: _first_launch passes warmup=True
    result = {}
    for name, thunk in cases():
        if only and not re.search(only, name):
            continue
        compiled.clear()
        try:
            thunk()
        except Exception as e:  # noqa: BLE001 - recorded: a config that stops compiling is a finding
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{name}: {result[name]['error']}", file=sys.stderr)
            continue
        result[name] = [fingerprint(k) for k in compiled]
        print(name, [(r["regs"], r["sass"]) for r in result[name]], flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


def diff(before: Path, after: Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    same = changed = 0
    for name in sorted(set(old) | set(new)):
        o, n = old.get(name), new.get(name)
        if o == n:
            same += 1
            continue
        changed += 1
        print(f"== {name}")
        if not isinstance(o, list) or not isinstance(n, list) or len(o) != len(n):
            print(f"   before: {str(o)[:300]}\n   after:  {str(n)[:300]}")
            continue
        for ko, kn in zip(o, n):
            for field in ("regs", "spills", "shared", "sass"):
                if ko[field] != kn[field]:
                    print(f"   {field}: {ko[field]} -> {kn[field]}")
            ops = sorted(set(ko["ops"]) | set(kn["ops"]))
            delta = {op: kn["ops"].get(op, 0) - ko["ops"].get(op, 0) for op in ops}
            print("   ops:", {op: d for op, d in delta.items() if d})
    print(f"{same} identical, {changed} different")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write a snapshot here")
    parser.add_argument("--only", help="regex over case names")
    parser.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.diff:
        return diff(*args.diff)
    if not args.out:
        parser.error("--out or --diff")
    snapshot(args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
