"""onegemm.persistent: the core GEMM with SM-count persistent scheduling (see README.md)."""

from .matmul import persistent_matmul

__all__ = ["persistent_matmul"]
