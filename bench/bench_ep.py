"""Expert parallelism over NCCL: a DeepSeek-V3-shaped MoE layer on 1 to 8 GPUs of one host.

    torchrun --standalone --nproc_per_node 8 bench/bench_ep.py          # EP8: bench/results/ep_w8.json, ep.md
    torchrun --standalone --nproc_per_node 1 bench/bench_ep.py          # EP1: the layer against plain MoEFFN
    torchrun --standalone --nproc_per_node 1 bench/bench_ep.py --quick  # smoke test: small layer, a few sizes

One run measures one world size W and stores it in bench/results/ep_w{W}.json; ep.md is then
rebuilt from every ep_w*.json present (so runs at 1, 2, 4 and 8 GPUs give the scaling table),
and the three ratios of the issue go into bench/results/summary.json.

The layer: 256 experts of H 7168, I 2048, top-8 (DeepSeek-V3's routed experts), E / W on each
rank, bf16 and FP8 (e4m3 experts with 128x128 scales, FP8 dispatch). The router is
onegemm's (softmax top-8 over a random [256, 7168] gate: near-uniform load), not DeepSeek's
grouped sigmoid router with its trained bias. Per rank and per size T (tokens per rank):
- the layer at decode (T = 1..256): "allgather" replayed from a CUDA graph, and "alltoall";
- the layer at prefill (T = 4K..16K): "alltoall" (and "allgather" at 4K);
- dispatch and combine alone (onegemm.ep.dispatch / combine) next to one bare
  torch.distributed.all_to_all_single of the same bytes with the same split sizes, and the
  local experts' compute on the rows dispatch delivered;
- at W >= 2, NCCL's send/recv bandwidth between ranks 0 and 1.
Times are CUDA-event means over a fixed number of calls (every rank runs the same calls;
do_bench's adaptive counts would let ranks disagree), the slowest rank's. Bandwidths count the
bytes a rank sends, its own share included. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and
friends are set before NCCL starts).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# NVLink multicast off in every rank (on shared hosts it can take the GPUs out of service).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import onegemm  # noqa: E402 - first of the project: it picks Triton's mode
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import RESULTS, header, markdown_table, require_gpu, update_summary  # noqa: E402
from onegemm.ep import combine, dispatch  # noqa: E402
from onegemm.testing import free_port  # noqa: E402

FULL = dict(E=256, H=7168, I=2048, k=8, decode=[1, 16, 64, 256], prefill=[4096, 8192, 16384], allgather_prefill=4096)
QUICK = dict(E=16, H=1024, I=512, k=4, decode=[1, 64], prefill=[2048], allgather_prefill=2048)
DEVICE = "cuda"


def timed(fn, iters: int, graph: bool = False) -> float:
    """Mean ms per call of fn() over ``iters`` calls (replays of one captured call when
    ``graph``), the slowest rank's; every rank must make the same calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
        run()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor(start.elapsed_time(end) / iters, device=DEVICE)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def make_layers(shape, world, rank):
    """The bf16 layer (this rank's experts only, drawn on the GPU) and its FP8 twin."""
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["k"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gate = torch.randn(E, H, device=DEVICE, generator=g).bfloat16()  # the same router on every rank
    g.manual_seed(1 + rank)
    local = E // world
    w13 = (torch.randn(local, 2 * I, H, device=DEVICE, generator=g) * H**-0.5).bfloat16()
    w2 = (torch.randn(local, H, I, device=DEVICE, generator=g) * I**-0.5).bfloat16()
    bf16 = onegemm.EPMoEFFN(gate, w13, w2, top_k=k)
    q13, s13, q2, s2 = onegemm.quantize_experts(w13, w2)
    fp8 = onegemm.EPMoEFFN(gate, q13, q2, top_k=k, w_gate_up_scale=s13, w_down_scale=s2)
    return bf16, fp8


def comm_rows(layer, x):
    """The routing of x and dispatch's result (what the bare all-to-all is given to carry)."""
    weights, ids = onegemm.route(layer.router_logits(x), layer.top_k)
    local = layer.w_gate_up.shape[0]
    if layer.w_gate_up_scale is None:
        return weights, ids, None, dispatch(x, weights, ids, local)
    xq, xs = onegemm.quantize_fp8(x)
    return weights, ids, (xq, xs), dispatch(xq, weights, ids, local, x_scale=xs)


def bare_all_to_all(d, row_bytes: int):
    """One all_to_all_single of uint8 rows of ``row_bytes`` with dispatch's split sizes, and back."""
    send = torch.randint(0, 255, (sum(d.send_sizes), row_bytes), dtype=torch.uint8, device=DEVICE)
    recv = torch.empty(sum(d.recv_sizes), row_bytes, dtype=torch.uint8, device=DEVICE)
    there = lambda: dist.all_to_all_single(recv, send, d.recv_sizes, d.send_sizes)  # noqa: E731
    back = lambda: dist.all_to_all_single(send, recv, d.send_sizes, d.recv_sizes)  # noqa: E731
    return there, back


def measure(shape, world, rank, iters, quick):
    bf16, fp8 = make_layers(shape, world, rank)
    H, k = shape["H"], shape["k"]
    rows = []
    for name, layer in (("bf16", bf16), ("fp8", fp8)):
        elem = 1 if name == "fp8" else 2
        with torch.no_grad():
            for phase, sizes in (("decode", shape["decode"]), ("prefill", shape["prefill"])):
                for T in sizes:
                    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
                    r = dict(dtype=name, phase=phase, T=T)
                    if phase == "decode" or T <= shape["allgather_prefill"]:
                        r["allgather_ms"] = timed(lambda: layer(x, strategy="allgather"), iters, graph=True)
                    r["alltoall_ms"] = timed(lambda: layer(x, strategy="alltoall"), iters)
                    if phase == "prefill":
                        weights, ids, q, d = comm_rows(layer, x)
                        xin, xs = (x, None) if q is None else q
                        # What dispatch sends per row: x, the k weights (fp32) and ids (int32), the fp8 scales.
                        row_bytes = H * elem + 8 * k + (0 if xs is None else 4 * xs.shape[1])
                        there, back = bare_all_to_all(d, row_bytes)
                        local = layer.w_gate_up.shape[0]
                        r["dispatch_ms"] = timed(lambda: dispatch(xin, weights, ids, local, x_scale=xs), iters)
                        y = torch.randn(sum(d.recv_sizes), H, device=DEVICE, dtype=torch.bfloat16)
                        r["combine_ms"] = timed(lambda: combine(y, d), iters)
                        r["bare_dispatch_ms"] = timed(there, iters)
                        there()
                        r["bare_combine_ms"] = timed(back, iters)
                        scales = {} if xs is None else dict(w_gate_up_scale=layer.w_gate_up_scale,
                                                            w_down_scale=layer.w_down_scale, x_scale=d.x_scale)
                        r["experts_ms"] = timed(lambda: onegemm.moe_ffn(d.x, layer.w_gate_up, layer.w_down,
                                                                        d.topk_weights, d.topk_ids, **scales), iters)
                        sent = torch.tensor(float(sum(d.send_sizes)), device=DEVICE)
                        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
                        r["dispatch_GBps"] = sent.item() * row_bytes / r["dispatch_ms"] / 1e6
                        r["bare_GBps"] = sent.item() * row_bytes / r["bare_dispatch_ms"] / 1e6
                        r["combine_GBps"] = sent.item() * H * 2 / r["combine_ms"] / 1e6
                    if world == 1:  # the collectives copy: the layer against plain MoEFFN
                        plain = onegemm.MoEFFN(layer.gate_weight.detach(), layer.w_gate_up.detach(),
                                               layer.w_down.detach(), top_k=k, w_gate_up_scale=layer.w_gate_up_scale,
                                               w_down_scale=layer.w_down_scale)
                        r["moeffn_ms"] = timed(lambda: plain(x), iters, graph=True)
                        del plain
                    rows.append(r)
                    if rank == 0:
                        print(r, flush=True)
                    del x
    result = dict(world=world, shape={k: v for k, v in shape.items()}, rows=rows, quick=quick,
                  gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, torch=torch.__version__)
    if world >= 2:
        result["p2p_GBps"] = p2p_bandwidth(rank, iters)
    return result


def p2p_bandwidth(rank, iters, nbytes=256 << 20) -> float:
    """NCCL send/recv, rank 0 to rank 1, one way, GB/s (the other ranks wait)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)

    def once():
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)

    ms = timed(once, iters)
    return nbytes / ms / 1e6


def ratio(a, b):
    return a / b if a and b else float("nan")


def write_markdown(results: dict[int, dict]) -> str:
    text = header("Expert parallelism (onegemm.ep) over NCCL")
    text += ("A DeepSeek-V3-shaped layer (256 experts, H 7168, I 2048, top-8; onegemm's softmax router over a random "
             "gate) sharded over W GPUs; T = tokens per rank; times in ms per layer call, the slowest rank's "
             "(bench/bench_ep.py says how each is taken).\n\n")
    for world, res in sorted(results.items()):
        text += f"## EP{world} ({res['gpu']}, torch {res['torch']}{', --quick shapes' if res['quick'] else ''})\n\n"
        if "p2p_GBps" in res:
            text += f"NCCL send/recv rank 0 -> 1: {res['p2p_GBps']:.1f} GB/s\n\n"
        layer_cols = ["dtype", "phase", "T", "allgather_ms", "alltoall_ms"] + (["moeffn_ms"] if world == 1 else [])
        rows = [dict(r) for r in res["rows"]]
        if world == 1:
            for r in rows:
                best = min(v for v in (r.get("allgather_ms"), r.get("alltoall_ms")) if v)
                r["best / moeffn"] = ratio(best, r.get("moeffn_ms"))
            layer_cols.append("best / moeffn")
        text += "### The layer\n\n" + markdown_table(rows, layer_cols) + "\n"
        pre = [r for r in rows if r["phase"] == "prefill"]
        for r in pre:
            r["dispatch / bare"] = ratio(r["bare_dispatch_ms"], r["dispatch_ms"])
            r["combine / bare"] = ratio(r["bare_combine_ms"], r["combine_ms"])
            r["layer / (experts + bare a2a)"] = ratio(r["alltoall_ms"], r["experts_ms"] + r["bare_dispatch_ms"]
                                                      + r["bare_combine_ms"])
        text += ("### Prefill: dispatch and combine against a bare all_to_all_single of the same bytes\n\n"
                 "`dispatch / bare` is the bare all-to-all's time over dispatch's (1.0: as fast as the bare one).\n\n"
                 + markdown_table(pre, ["dtype", "T", "dispatch_ms", "bare_dispatch_ms", "dispatch / bare", "combine_ms",
                                        "bare_combine_ms", "combine / bare", "dispatch_GBps", "bare_GBps", "combine_GBps",
                                        "experts_ms", "layer / (experts + bare a2a)"]) + "\n")
    scaling = []
    for world, res in sorted(results.items()):
        for r in res["rows"]:
            if r["phase"] == "prefill":
                scaling.append(dict(W=world, dtype=r["dtype"], T=r["T"], alltoall_ms=r["alltoall_ms"],
                                    tokens_per_ms=world * r["T"] / r["alltoall_ms"]))
    if scaling:
        text += "## Scaling (prefill, all-to-all; tokens of all ranks per ms)\n\n" + markdown_table(scaling) + "\n"
    return text


def summary(results: dict[int, dict]) -> list[dict]:
    """summary.json entries (peer time / onegemm time) at the largest world size measured:
    with one rank, the layer against plain MoEFFN (the worst size; the all-gather strategy is
    replayed from a CUDA graph, as MoEFFN is); with several, the multi-GPU issue's ratios."""
    res = results[max(results)]
    world = res["world"]
    pre = [r for r in res["rows"] if r["phase"] == "prefill"]
    out = []
    if world == 1:
        rows = [r for r in res["rows"] if "allgather_ms" in r and "moeffn_ms" in r]
        out.append(dict(name="ep1_layer_vs_moe_ffn", value=min(ratio(r["moeffn_ms"], r["allgather_ms"]) for r in rows),
                        peer="onegemm.MoEFFN on the same experts, GPU time (CUDA-graph replay), worst of decode and "
                             "4K prefill, bf16 and fp8; EP layer with one NCCL rank, all-gather strategy"))
        return out
    bf16 = [r for r in pre if r["dtype"] == "bf16"]
    fp8 = {r["T"]: r for r in pre if r["dtype"] == "fp8"}
    big = max(bf16, key=lambda r: r["T"])
    worst = lambda a, b: min(ratio(r[b], r[a]) for r in pre)  # noqa: E731
    out.append(dict(name=f"ep{world}_dispatch_vs_bare_all_to_all", peer="one bare all_to_all_single of the same bytes",
                    value=min(worst("dispatch_ms", "bare_dispatch_ms"), worst("combine_ms", "bare_combine_ms"))))
    if world == 8:
        out.append(dict(name="ep8_prefill_vs_compute_plus_a2a", peer="local experts' compute + two bare all-to-alls",
                        value=ratio(big["alltoall_ms"], big["experts_ms"] + big["bare_dispatch_ms"] + big["bare_combine_ms"])))
    if big["T"] in fp8:
        out.append(dict(name=f"ep{world}_fp8_dispatch_vs_bf16", peer="bf16 dispatch of the same tokens",
                        value=ratio(big["dispatch_ms"], fp8[big["T"]]["dispatch_ms"])))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="a small layer and a few sizes (a smoke test); "
                        "writes ep_w{W}_quick.json and no ep.md / summary.json")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (default 20)")
    args = parser.parse_args(argv)
    require_gpu()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if "MASTER_ADDR" not in os.environ:  # started without torchrun: one rank
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local_rank))
    try:
        shape = QUICK if args.quick else FULL
        result = measure(shape, world, rank, args.iters, args.quick)
        if rank == 0:
            RESULTS.mkdir(parents=True, exist_ok=True)
            suffix = "_quick" if args.quick else ""
            (RESULTS / f"ep_w{world}{suffix}.json").write_text(json.dumps(result, indent=1))
            if args.quick:
                print(write_markdown({world: result}))
            else:
                results = {json.loads(p.read_text())["world"]: json.loads(p.read_text())
                           for p in sorted(RESULTS.glob("ep_w*.json")) if not p.stem.endswith("_quick")}
                (RESULTS / "ep.md").write_text(write_markdown(results))
                update_summary(summary(results))
                print((RESULTS / "ep.md").read_text())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
