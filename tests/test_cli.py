"""python -m onegemm and the benchmark scripts: argument errors are clear, --help works anywhere."""

import subprocess
import sys
from pathlib import Path

import pytest

from onegemm.__main__ import main

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
    assert "--tokens" in out and "--seed" in out and "seed of the random" in out and "--fp8" in out


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name != "common.py"))
def test_bench_scripts_help_without_a_gpu(script):
    """Every benchmark script answers --help on any machine (none touches the GPU at import)."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-500:]
    assert "usage" in proc.stdout.lower()
