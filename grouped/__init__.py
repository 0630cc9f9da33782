"""onegemm.grouped: grouped GEMMs (torch._grouped_mm semantics, list mode) and the MoE expert FFN.

Kernels: kernels.py; the public ops: ops.py (grouped_matmul), w4.py (4-bit weights' checks), linear4.py (linear_4bit),
moe.py (moe_ffn, quantize_experts), prepack.py (prepack_mxfp4: MXFP4 in fragment order),
moe_steps.py (sort_by_expert, and the steps moe.py, moe_train.py and ep/ share), routing.py
(route), layer.py (MoEFFN) and loading.py (MoEFFN's checkpoint reading; loading_int4.py its INT4
readers); the stored test layers
(bf16 and its FP8 twin): data/, made by make_layer.py.
"""

from pathlib import Path

from .layer import MoEFFN
from .moe import moe_ffn, quantize_experts
from .moe_steps import sort_by_expert
from .routing import route
from .ops import grouped_matmul
from .linear4 import linear_4bit
from .prepack import PrepackedMxfp4, prepack_mxfp4

# A small Mixtral-style layer shipped with the package (8 experts, hidden 256, intermediate 512).
STORED_LAYER = Path(__file__).resolve().parent / "data" / "mixtral_tiny.safetensors"
# The same layer with FP8 experts in the DeepSeek-V3 format (gate_proj/up_proj/down_proj,
# float8_e4m3fn + weight_scale_inv per 128x128 block).
STORED_FP8_LAYER = STORED_LAYER.with_name("tiny_fp8.safetensors")

# The top-level API; sort_by_expert and the STORED_* layers stay under onegemm.grouped.
__all__ = ["grouped_matmul", "route", "moe_ffn", "quantize_experts", "MoEFFN", "linear_4bit", "prepack_mxfp4"]
