"""What every benchmark in bench/ shares: timing, the results header, markdown and plots.

Benchmarks compare onegemm with its peer measured in the same run, and report ratios.
Timing (bench_ms) is the GPU time of one call replayed from a CUDA graph, median over
triton.testing.do_bench's runs, after a first call (which compiles) that is kept out of the
numbers; bench_overhead.py times eager calls and the host. Inputs are random, never zeros: an
H200 ran a bf16 GEMM 13% faster on zeros than on random data.

The float64 references and timing helpers are onegemm.testing's, shared with the tests.
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import triton

from onegemm import testing

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100, graph: bool = True) -> float:
    """Median milliseconds of fn() on the GPU: GPU time (CUDA-graph replays, the default) or
    eager calls (graph=False; the host's launch time counts where it exceeds the GPU's)."""
    timer = testing.gpu_ms if graph else testing.eager_ms
    return timer(fn, warmup_ms, rep_ms)


def config_of(fn) -> str:
    """The config(s) fn() runs, as the results tables print them ('+' between launches)."""
    return " + ".join(dict.fromkeys(f"{x['config']}" for x in testing.launched(fn)))


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def copy_tb_s(device="cuda") -> float:
    """The copy speed that weight rates compare with, measured in the same run: a 1 GiB bf16
    copy_ into a tensor made beforehand, read + write bytes / time, the faster of a CUDA-graph
    replay and eager calls (one kernel, so no host time in either). Not a graph-replayed
    clone: it read well under what the experts' reads reached (bench/results/moe_fp8.md)."""
    src = torch.ones(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = min(bench_ms(lambda: dst.copy_(src), graph=graph) for graph in (True, False))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e12


def geomean(xs) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def header(title: str, gpu: str | None = None) -> str:
    """Markdown preamble: what ran, where, when, and the command that reproduces it. ``gpu``:
    where the figures came from, for a file rendered from stored rows (default this machine's)."""
    versions = f"torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}"
    if gpu is None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
        gpu = f"{torch.cuda.get_device_name()} ({sms} SMs)" if torch.cuda.is_available() else "no GPU"
    else:  # rendered: the versions that measured are the runs', which the file names
        versions = f"rendered with {versions}; the runs' versions are in the text below"
    cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    return (
        f"# {title}\n\n"
        f"- GPU: {gpu}\n"
        f"- {versions}\n"
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}\n"
        f"- command: `python {cmd}`\n"
        f"- commit: {commit()}\n"
        f"- timing: GPU time, median of triton.testing.do_bench over CUDA-graph replays of one call (L2 flushed "
        f"between runs; the first call, which compiles, kept out). Host time per eager call: bench/results/overhead.md\n\n"
    )


def markdown_table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = ".3g") -> str:
    """Rows as a markdown table: ``columns``, else every key of any row in order of first use
    (a row without one gets an empty cell)."""
    columns = columns or list(dict.fromkeys(key for r in rows for key in r))
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(format(v, floatfmt) if isinstance(v, float) else str(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write_results(name: str, text: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return path


def kept_sections(name: str, headings: list[str]) -> str:
    """The sections of bench/results/NAME.md whose heading starts with one of ``headings``
    (a run that re-measures only some sections keeps the others), each followed by where it
    came from: its own provenance line if it has one, else the old file's commit and date."""
    path = RESULTS / f"{name}.md"
    if not path.exists():
        return ""
    old = path.read_text()
    field = lambda key: next((line.split(":", 1)[1].strip() for line in old.splitlines()  # noqa: E731
                              if line.startswith(f"- {key}:")), "unknown")
    origin = f"_Kept from the run at {field('commit')} ({field('date')}): not re-measured by the run above._"
    out = ""
    for block in re.split(r"(?m)^(?=## )", old):
        heading, _, body = block.partition("\n")
        if any(heading.startswith(h) for h in headings):
            body = body.lstrip("\n")
            if not body.startswith("_Kept from"):
                body = origin + "\n\n" + body
            out += f"{heading}\n\n{body.rstrip()}\n\n"
    return out


def commit() -> str:
    """The measured checkout's commit: $ONEGEMM_COMMIT (a copy without .git), else git's."""
    if os.environ.get("ONEGEMM_COMMIT"):
        return os.environ["ONEGEMM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def update_summary(entries: list[dict], overrides: dict | None = None) -> Path:
    """Put this run's headline figures into bench/results/summary.json, replacing entries of
    the same name: each {name, value (geomean of peer time / onegemm time), peer} gets the
    command, commit, GPU and date of this run (``overrides`` replaces them: figures rendered
    from stored rows carry the rows' commit, GPU and date)."""
    path = RESULTS / "summary.json"
    data = json.loads(path.read_text()) if path.exists() else []
    cmd = " ".join(shlex.quote(a) for a in ["python", os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])
    stamp = dict(command=cmd, commit=commit(), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                 date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}") | (overrides or {})
    names = {e["name"] for e in entries}
    data = [e for e in data if e["name"] not in names] + [
        dict(name=e["name"], value=round(float(e["value"]), 4), peer=e["peer"], **stamp) for e in entries]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def plot_ratios(name: str, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> Path:
    """Grouped bar chart of ratios (1.0 = parity with the peer), saved as bench/results/NAME.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(labels) * max(1, len(series))), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (label, ys) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, ys, width=width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- peers: other projects' kernels, found in the environment, never imported by the library ----

DEEPGEMM_HOW = ("build it on the GPU machine with $ONEGEMM_PEERS/deepgemm/build.sh (copied to the checkout's ignored "
                ".peers/deepgemm) and source the dg_env.sh it writes; this script's docstring gives the commands")


def import_peer(module: str, label: str, how: str):
    """The peer's module (an installed package or one on PYTHONPATH), or None after one line
    saying why its columns stay empty: it does not import, or there is no GPU to run it on."""
    try:
        peer = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to load a peer only blanks its columns
        first = (str(e).strip().splitlines() or [""])[0][:200]
        print(f"{label}: not importable ({type(e).__name__}: {first}); {how}. Its columns stay empty (nan / n/a).",
              flush=True)
        return None
    if not torch.cuda.is_available():
        print(f"{label}: imported, but there is no CUDA device to run it on. Its columns stay empty (nan / n/a).",
              flush=True)
        return None
    return peer


VLLM_HOW = ("copy $ONEGEMM_PEERS/vllm into the checkout's ignored .peers/vllm on the GPU machine and run with "
            "ONEGEMM_PEERS=.peers")


def import_vllm_moe():
    """vLLM's Triton fused_moe kernels (the peers folder's vllm/vllm_fused_moe.py under
    $ONEGEMM_PEERS), or None after saying why (see import_peer)."""
    root = os.environ.get("ONEGEMM_PEERS")
    if root and str(Path(root, "vllm")) not in sys.path:
        sys.path.insert(0, str(Path(root, "vllm")))
    return import_peer("vllm_fused_moe", "vLLM fused_moe", VLLM_HOW)


def import_deepgemm():
    """deep_gemm (DeepGEMM), or None after saying why (see import_peer)."""
    return import_peer("deep_gemm", "DeepGEMM", DEEPGEMM_HOW)


def run_or_reason(fn, check=None):
    """(output, None), or (None, reason) when a peer refuses the shape: it raises (e.g. cuBLAS
    blockwise at small M, a DeepGEMM host assertion), or check(output) returns a reason (see
    differs). Only peers go through here; onegemm's errors propagate."""
    try:
        out = fn()
        why = check(out) if check is not None else None
    except Exception as e:  # noqa: BLE001 - a peer's failure blanks its cell, with the reason printed
        return None, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
    return (out, None) if why is None else (None, why)


def differs(out, like, tol: float = 1e-3):
    """None when a peer's ``out`` is the product onegemm's ``like`` computed from the same fp8
    values and scales (calc_diff < tol: the two differ only in summation order and bf16
    rounding, 1e-5 or less), else the reason: a peer fed a wrong layout gets no timing."""
    d = testing.calc_diff(out, like)
    return None if d < tol else f"its output differs from onegemm's on the same inputs (calc_diff {d:.2e} >= {tol:g})"


def require_gpu():
    if not torch.cuda.is_available():
        sys.exit("benchmarks need a CUDA GPU; run with --quick for the CPU interpreter check of the same code path")
