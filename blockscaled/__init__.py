"""onegemm.blockscaled: FP8 quantisation, the block-scaled GEMM and Fp8Linear (see README.md)."""

from .linear import Fp8Linear, fp8_training
from .matmul import blockscaled_matmul
from .quantize import pack_int4_zeros, quantize_fp8, quantize_int4, unpack_int4_zeros

__all__ = ["quantize_fp8", "quantize_int4", "pack_int4_zeros", "unpack_int4_zeros", "blockscaled_matmul", "Fp8Linear",
           "fp8_training"]
