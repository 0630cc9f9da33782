"""python -m onegemm and the benchmark scripts: argument errors are clear, --help works anywhere, and the main
job's DeepSeek-V3-shaped layer matches transformers."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import onegemm
from onegemm.__main__ import DEEPSEEK_TINY, TRUNCATION_NOTE, bf16_errors, deepseek_section, main, w4_section
from onegemm.grouped import STORED_LAYER

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,fragment", [
    (["--tokens", "0"], "--tokens: must be at least 1, got 0"),
    (["--tokens", "-5"], "--tokens: must be at least 1, got -5"),
    (["--tokens", "many"], "--tokens: must be a whole number"),
    (["--seed", "x"], "--seed"),
])
def test_main_job_bad_arguments(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


def test_main_job_help_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--tokens" in out and "--seed" in out and "seed of the random" in out and "--fp8" in out and "--mxfp4" in out \
        and "--int4" in out


def test_main_job_help_names_every_part(capsys):
    """Each part of the job, not only the first (the stored layer)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    description = " ".join(capsys.readouterr().out.split("options:")[0].split())
    for part in ("mixtral_tiny.safetensors", "with --fp8, the layer's FP8 twin", "with --mxfp4, the layer's MXFP4 twin",
                 "with --int4, the layer's INT4 twin",
                 "gpt-oss-120b-shaped layer", "Qwen3-30B-A3B",
                 "DeepSeek-V3-shaped layer", "DeepseekV3MoE", "the core GEMM, onegemm.matmul"):
        assert part in description, part


def test_main_job_says_why_interpreted_bf16_errors_are_twice_torchs():
    """Under the interpreter the error lines say that its truncating bf16 stores (not onegemm's
    arithmetic) double the error; on a GPU they are the two errors alone."""
    rows = ("onegemm.matmul", 3.30e-3), ("torch.matmul", 1.66e-3)
    assert bf16_errors(*rows, gpu=True) == "  onegemm.matmul: 3.30e-03\n  torch.matmul: 1.66e-03"
    assert bf16_errors(*rows, gpu=False) == bf16_errors(*rows, gpu=True) + "\n" + TRUNCATION_NOTE
    assert "twice torch's" in TRUNCATION_NOTE and "interpreter truncates fp32 -> bf16" in TRUNCATION_NOTE
    assert "docs/interpreter.md" in TRUNCATION_NOTE


def test_bench_scripts_help_without_a_gpu():
    """Every benchmark script answers --help on any machine (none touches the GPU at import).
    The scripts start side by side: each is a fresh Python importing torch."""
    scripts = sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name != "common.py")
    procs = {s: subprocess.Popen([sys.executable, str(REPO / "bench" / s), "--help"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=REPO) for s in scripts}
    failed = {}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        if proc.returncode != 0 or "usage" not in out.lower():
            failed[script] = err[-300:] or out[-300:]
    assert len(scripts) >= 10 and not failed, failed


def test_main_job_deepseek_layer_matches_transformers(device, capsys):
    """python -m onegemm's DeepSeek-V3-shaped layer at its interpreter size: onegemm and the
    transformers block agree with the float64 layer (fp32), and the routing with its experts."""
    pytest.importorskip("transformers")
    with torch.inference_mode():
        ok = deepseek_section(16, device, torch.float32, DEEPSEEK_TINY)
    out = capsys.readouterr().out
    assert ok, out
    assert "100.00% of tokens pick the float64 router's experts (transformers: 100.00%)" in out
    assert "32 experts, hidden 64" in out and "top-8 within the best 4 of 8 expert groups" in out


def test_a_partial_benchmark_run_keeps_the_sections_it_did_not_measure(tmp_path):
    """bench/common.py kept_sections: a run of some sections (bench_overhead.py --sections host)
    keeps the others from the previous file, each with the run it came from, and never drops a
    provenance line a kept section already has."""
    old = ("# T\n\n- date: D0\n- commit: abc1234\n- timing: t\n\n## A one\n\nold a\n\n"
           "## B two\n\n_Kept from the run at e1 (d1): not re-measured by the run above._\n\nold b\n\n"
           "## C three\n\nold c\n")
    script = (f"import onegemm, common, pathlib\ncommon.RESULTS = pathlib.Path({str(tmp_path)!r})\n"
              f"(common.RESULTS / 'x.md').write_text({old!r})\n"
              "print(common.kept_sections('x', ['## A', '## B']), end='')\n"
              "print(repr(common.kept_sections('missing', ['## A'])), end='')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO / "bench", capture_output=True, text=True,
                         check=True).stdout
    assert out == ("## A one\n\n_Kept from the run at abc1234 (D0): not re-measured by the run above._\n\nold a\n\n"
                   "## B two\n\n_Kept from the run at e1 (d1): not re-measured by the run above._\n\nold b\n\n''")


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_main_job_w4_section(fmt, device, capsys):
    """--mxfp4's and --int4's part: the stored layer's 4-bit twin within the bf16 bound of
    float64 on the same 4-bit values, and the format's calc_diff printed."""
    layer = onegemm.MoEFFN.from_safetensors(STORED_LAYER, top_k=2, device=device)
    x = torch.randn(16, layer.gate_weight.shape[1], device=device).to(layer.w_gate_up.dtype)
    weights, ids = onegemm.route(layer.router_logits(x), 2)
    with torch.inference_mode():
        assert w4_section(fmt, x, weights, ids, layer, gpu=False)  # (gpu=True adds only timings)
    out = capsys.readouterr().out
    assert f"relative error against float64 of the same {fmt.upper()} values" in out and "calc_diff" in out

