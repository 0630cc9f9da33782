"""Test harness shared by every test module.

* ``import onegemm`` arranges Triton's CPU interpreter when there is no GPU, so tests run on
  CPU tensors there and on CUDA tensors on the H200: the ``device`` fixture picks.
* ``@pytest.mark.gpu`` tests need a real GPU (bf16 tensor cores, autotune, TMA, in-kernel fp8
  casts); without one they are reported as SKIPPED with the reason, never as passed.
  ``@pytest.mark.sm90`` (with ``gpu``) marks tests of the Gluon body, which runs on sm_90 only.
* Every test draws fresh random inputs (a new seed per test, printed on failure;
  ONEGEMM_TEST_SEED=<seed> draws that failure's inputs again) and runs with
  onegemm's output poisoning on, so an unwritten tile shows as NaN.
* The checkout's root is the package itself, and may be named anything (``onegemm-main``
  from a zip): pytest collects it as a plain directory, so it never imports the root
  ``__init__.py`` under the folder's name. Tests import the installed ``onegemm`` (or the one
  on PYTHONPATH) and their shared helpers from tests/helpers.py (``from helpers import ...``;
  pytest puts tests/ on sys.path because it has no ``__init__.py``).
"""

import os
import random
from pathlib import Path

import pytest
import torch

os.environ["ONEGEMM_POISON"] = "1"  # read once, when onegemm is imported
import onegemm  # noqa: E402
from onegemm.core import launch, runtime  # noqa: E402
from onegemm.grouped import ops as grouped_ops  # noqa: E402

assert runtime.POISON, "onegemm was imported before tests/conftest.py could switch its output poisoning on"

HAS_GPU = torch.cuda.is_available() and not onegemm.INTERPRET
ROOT = Path(__file__).resolve().parent.parent


class _RootIsAPlainDirectory:
    """pytest makes a directory holding ``__init__.py`` a Package and imports that file as a
    module named after the folder, which fails with "attempted relative import" unless the
    folder is called onegemm. Collected as a Dir, the root is only walked to reach tests/."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if path.resolve() == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    # A plugin, not a hook in this file: a conftest's collection hooks only see paths below it.
    config.pluginmanager.register(_RootIsAPlainDirectory(), "onegemm-root-is-a-plain-directory")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        if torch.cuda.get_device_capability() != (9, 0):
            other = pytest.mark.skip(reason="needs an sm_90 GPU: core's Gluon body (core/hopper_fp8.py) is Hopper's")
            for item in items:
                if "sm90" in item.keywords:
                    item.add_marker(other)
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU: Triton's CPU interpreter cannot run this (bf16 MMA, autotune, "
        "TMA or fp8 casts); run `pytest -m gpu` on the H200"
    )
    sm90 = pytest.mark.skip(
        reason="needs an sm_90 GPU: this is core's Gluon body (core/hopper_fp8.py), and Gluon kernels have no "
        "CPU interpreter; run `pytest -m gpu` on the H200"
    )
    for item in items:
        if "sm90" in item.keywords:
            item.add_marker(sm90)
        elif "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    mode = f"GPU {torch.cuda.get_device_name()}" if HAS_GPU else "Triton CPU interpreter"
    return f"onegemm: {mode}; torch {torch.__version__}"


@pytest.fixture(autouse=True)
def _fresh_seed():
    seed = int(os.environ.get("ONEGEMM_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed = {seed} (ONEGEMM_TEST_SEED={seed} draws the same inputs)")  # shown when the test fails
    torch.manual_seed(seed)
    random.seed(seed)
    yield


@pytest.fixture
def device():
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture(params=["pointers", "tma"])
def w4_flavour(request, monkeypatch):
    """moe_ffn's 4-bit GEMMs with their weight bytes read one way, forced (grouped/w4.py
    w4_flavour; moe_ffn has no tma argument). The interpreter runs descriptors too."""
    real = grouped_ops.w4_flavour
    monkeypatch.setattr(grouped_ops, "w4_flavour", lambda tma, b, strides: real(request.param == "tma", b, strides))
    launch.clear_plans()  # records built under the other flavour
    yield request.param
    launch.clear_plans()
