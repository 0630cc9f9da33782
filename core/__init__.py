"""The one GEMM: tile helpers (tiles.py), launch rules (runtime.py), checks, and matmul."""

from .matmul import linear, matmul
from .runtime import INTERPRET

__all__ = ["INTERPRET", "matmul", "linear"]
