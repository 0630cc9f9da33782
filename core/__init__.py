"""The one GEMM: tile helpers (tiles.py), the launcher (launch.py), the tuning policy
(configs.py), input checks, and matmul."""

from .launch import autotune
from .matmul import linear, matmul
from .runtime import INTERPRET

__all__ = ["INTERPRET", "matmul", "linear", "autotune"]
