"""Input validation shared by every public op.

Bad input must raise a ValueError or TypeError that names the argument and says what was
expected: never a silent wrong answer, never an illegal memory access on the GPU.
"""

from __future__ import annotations

import torch

from .runtime import INTERPRET

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GEMM_DTYPES = FLOAT_DTYPES + FP8_DTYPES
OUT_DTYPES = FLOAT_DTYPES

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, ndim=None, dtypes=None) -> None:
    """TypeError for a non-tensor or a wrong dtype, ValueError for a wrong rank or device.

    Every public call runs these checks, so they are written for speed: a passing check is a
    few attribute reads; the messages are built only when one fails.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and (t.dim() != ndim if ndim.__class__ is int else t.dim() not in ndim):
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        want = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in ({_dtype_names(dtypes)}), got {t.dtype}")
    check_device(name, t)


def check_device(name: str, t: torch.Tensor) -> None:
    # Under the interpreter kernels read host memory; on a GPU they read device memory.
    if INTERPRET:
        if not t.is_cpu:
            raise ValueError(
                f"{name} must be a CPU tensor under Triton's interpreter (TRITON_INTERPRET=1), "
                f"got device {t.device}"
            )
    elif not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")


def check_same_device(**tensors) -> None:
    first_name = first = None
    for n, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first, index = n, t, t.get_device()
        elif t.get_device() != index:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {first.device}")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def resolve_out_dtype(out_dtype, in_dtype: torch.dtype) -> torch.dtype:
    """Default: the input dtype; fp8 inputs default to bfloat16 (fp8 outputs are not offered)."""
    if out_dtype is None:
        return torch.bfloat16 if in_dtype in FP8_DTYPES else in_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of ({_dtype_names(OUT_DTYPES)}), got {out_dtype}")
    return out_dtype


def check_operand_dtypes(a: torch.Tensor, b: torch.Tensor, a_name="a", b_name="b") -> None:
    """a and b: GEMM dtypes, the same one or two fp8 formats (checked as tensors already)."""
    if a.dtype not in GEMM_DTYPES:
        check_tensor(a_name, a, dtypes=GEMM_DTYPES)
    if b.dtype not in GEMM_DTYPES:
        check_tensor(b_name, b, dtypes=GEMM_DTYPES)
    if a.dtype == b.dtype and a.dtype != torch.float8_e5m2:
        return
    both_fp8 = a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES
    if a.dtype != b.dtype and not both_fp8:
        raise TypeError(f"{a_name} and {b_name} must have the same dtype, got {a.dtype} and {b.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        # Hopper's fp8 MMA (and torch._scaled_mm) take e5m2 only against e4m3.
        raise TypeError(f"{a_name} and {b_name} cannot both be float8_e5m2; make one float8_e4m3fn")


def check_bias(bias, shape: tuple, out_like: str = "the output") -> None:
    if bias is None:
        return
    check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
    if tuple(bias.shape) != tuple(shape):
        raise ValueError(f"bias must have shape {tuple(shape)} (one value per column of {out_like}), got {tuple(bias.shape)}")


def upcast_flag(dtype: torch.dtype) -> bool:
    """True where tiles must be converted to fp32 before tl.dot: bf16 under the interpreter."""
    return INTERPRET and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's own setting, so onegemm.matmul matches torch.matmul:
    'highest' (torch's default) -> exact fp32 products; 'high'/'medium' -> tf32 tensor cores."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"
