"""onegemm.grouped: grouped GEMMs (torch._grouped_mm semantics, list mode) and the MoE expert FFN.

See README.md in this folder. Kernels: kernels.py; the public ops: ops.py (grouped_matmul) and
moe.py (route, sort_by_expert, moe_ffn, MoEFFN); the stored test layer: data/, made by
make_layer.py.
"""

from pathlib import Path

from .moe import MoEFFN, moe_ffn, route, sort_by_expert
from .ops import grouped_matmul

# A small Mixtral-style layer shipped with the package (8 experts, hidden 256, intermediate 512).
STORED_LAYER = Path(__file__).resolve().parent / "data" / "mixtral_tiny.safetensors"

# The top-level API; sort_by_expert and STORED_LAYER stay under onegemm.grouped.
__all__ = ["grouped_matmul", "route", "moe_ffn", "MoEFFN"]
