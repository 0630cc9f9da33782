"""onegemm: Triton GEMMs for Mixture-of-Experts and FP8 work, built on one core GEMM.

Without a CUDA GPU, every kernel runs under Triton's CPU interpreter: this module sets
TRITON_INTERPRET=1 before any kernel is defined (Triton reads it when a kernel is decorated),
unless the variable is already set. Inputs are then CPU tensors.
"""

import os as _os
import sys as _sys

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    if "triton" in _sys.modules:
        # triton.language's own @jit helpers (tl.cdiv, tl.sigmoid, ...) were already compiled
        # for a GPU; under the interpreter they would fail inside every kernel.
        raise ImportError(
            "onegemm needs Triton's CPU interpreter on this machine (no CUDA GPU), but triton was "
            "imported before onegemm. Import onegemm first, or set TRITON_INTERPRET=1 before "
            "starting Python."
        )
    _os.environ["TRITON_INTERPRET"] = "1"

# Each subpackage's __all__ is what it exports at the top level.
from .core import *  # noqa: E402,F401,F403
from .grouped import *  # noqa: E402,F401,F403
from .persistent import *  # noqa: E402,F401,F403
from .blockscaled import *  # noqa: E402,F401,F403
from .ep import *  # noqa: E402,F401,F403
from . import testing  # noqa: E402,F401  (onegemm.testing works after a plain `import onegemm`)

from .core.launch import start_prewarm as _start_prewarm  # noqa: E402

_start_prewarm()

__version__ = "0.1.0"
