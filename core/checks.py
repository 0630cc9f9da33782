"""Input checks of every public op, and the only place onegemm words an error.

The convention (README "Errors"): bad input raises before any kernel runs,
* TypeError when an argument has the wrong type: not a tensor, a Python value of the wrong
  type (a str or bool where an int is needed), or a tensor of the wrong dtype;
* ValueError when the type is right but the value is not: a shape, rank, size, device or
  range that does not fit;
and the message starts with the public argument's name: "<name> must be <what>, got <what>".
Never a silent wrong answer, never an illegal memory access on the GPU.

Ops raise through the helpers below (``bad_type``, ``bad_value``, ``bad_shape`` build the
exception; ``check_*`` test and raise), so the whole API speaks one language. Every public
call runs these checks: a passing check is a few attribute reads, messages are built only on
failure.
"""

from __future__ import annotations

import os

import torch
import triton

from .runtime import INTERPRET

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GEMM_DTYPES = FLOAT_DTYPES + FP8_DTYPES
OUT_DTYPES = FLOAT_DTYPES

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


# ---- the messages ----


def bad_type(name: str, expected: str, value) -> TypeError:
    """TypeError: '<name> must be <expected>, got <the value's type>'."""
    return TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def bad_dtype(name: str, expected: str, dtype) -> TypeError:
    """TypeError: '<name> must be <expected>, got <dtype>'."""
    return TypeError(f"{name} must be {expected}, got {dtype}")


def bad_value(name: str, expected: str, got, why: str = "") -> ValueError:
    """ValueError: '<name> must be <expected>, got <got>[: <why>]'."""
    return ValueError(f"{name} must be {expected}, got {got}" + (f": {why}" if why else ""))


def bad_shape(name: str, expected: str, shape, why: str = "") -> ValueError:
    """ValueError: '<name> must be <expected>, got shape <shape>[: <why>]'."""
    return bad_value(name, expected, f"shape {tuple(shape)}", why)


def in_file(path, what: str) -> ValueError:
    """ValueError '<path>: <what>' for a file that cannot be read or whose contents do not fit."""
    return ValueError(f"{path}: {what}")


# ---- tensors ----


def check_tensor(name: str, t, *, ndim=None, dtypes=None, any_device=False) -> None:
    """TypeError for a non-tensor or a wrong dtype, ValueError for a wrong rank or device
    (``any_device``: the caller runs torch ops only, so every device serves)."""
    if not isinstance(t, torch.Tensor):
        raise bad_type(name, "a torch.Tensor", t)
    if ndim is not None and (t.dim() != ndim if isinstance(ndim, int) else t.dim() not in ndim):
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        raise bad_shape(name, " or ".join(f"{d}-D" for d in allowed), t.shape)
    if dtypes is not None and t.dtype not in dtypes:
        raise bad_dtype(name, f"of dtype in ({dtype_names(dtypes)})", t.dtype)
    if not any_device:
        check_device(name, t)


def check_optional_tensors(**values) -> None:
    """TypeError for any value that is neither a tensor nor None: the type check that comes
    before anything reads a tensor attribute (requires_grad, dtype), with gradients or without."""
    for name, t in values.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise bad_type(name, "a torch.Tensor", t)


def check_device(name: str, t: torch.Tensor) -> None:
    # Under the interpreter kernels read host memory; on a GPU they read device memory.
    if INTERPRET:
        if not t.is_cpu:
            raise bad_value(name, "a CPU tensor under Triton's interpreter (TRITON_INTERPRET=1)", f"device {t.device}")
    elif not t.is_cuda:
        raise bad_value(name, "a CUDA tensor", f"device {t.device}")


def check_same_device(**tensors) -> None:
    """Every tensor given (None skipped) on the first one's device."""
    first_name = first = None
    for n, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first_name, first, index = n, t, t.get_device()
        elif t.get_device() != index:
            raise bad_value(n, f"on {first_name}'s device {first.device}", f"device {t.device}")


def check_shape(name: str, t: torch.Tensor, shape: tuple, what: str = "") -> None:
    """t.shape == shape, else ValueError '<name> must be <what or [shape]>, got shape ...'."""
    if tuple(t.shape) != tuple(shape):
        raise bad_shape(name, what or str(list(shape)), t.shape)


# ---- GEMM arguments ----


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
        raise bad_dtype(f"{a_name} and {b_name}", "of the same dtype", f"{a.dtype} and {b.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        # Hopper's fp8 MMA (and torch._scaled_mm) take e5m2 only against e4m3.
        raise bad_dtype(b_name, f"float8_e4m3fn when {a_name} is float8_e5m2 (e5m2 x e5m2 has no fp8 MMA)", b.dtype)


def check_fp8(name: str, t, ndim=2) -> None:
    """An fp8 tensor (the block-scaled GEMMs' operands), 2-D unless ``ndim`` says otherwise."""
    check_tensor(name, t, ndim=ndim)
    if t.dtype not in FP8_DTYPES:
        raise bad_dtype(name, "float8_e4m3fn or float8_e5m2 (quantize it with onegemm.quantize_fp8)", t.dtype)


def check_bias(bias, shape: tuple, out_like: str = "the output") -> None:
    if bias is None:
        return
    check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
    if tuple(bias.shape) != tuple(shape):
        raise bad_shape("bias", f"of shape {tuple(shape)} (one value per column of {out_like})", bias.shape)


def check_activation(activation) -> None:
    if activation is not None and not isinstance(activation, str):
        raise bad_type("activation", f"one of {ACTIVATIONS}", activation)
    if activation not in ACTIVATIONS:
        raise bad_value("activation", f"one of {ACTIVATIONS}", repr(activation))


def resolve_out_dtype(out_dtype, in_dtype: torch.dtype) -> torch.dtype:
    """Default: the input dtype; fp8 inputs default to bfloat16 (fp8 outputs are not offered)."""
    if out_dtype is None:
        return torch.bfloat16 if in_dtype in FP8_DTYPES else in_dtype
    if out_dtype not in OUT_DTYPES:
        raise bad_dtype("out_dtype", f"one of ({dtype_names(OUT_DTYPES)})", out_dtype)
    return out_dtype


def check_config(config) -> None:
    """``config=``: None or a triton.Config (what benchmarks and tests force)."""
    if config is not None and not isinstance(config, triton.Config):
        raise bad_type("config", "a triton.Config or None", config)


def check_option(name: str, value) -> None:
    """A three-way option (``tma``, ``persistent``): None (automatic), True or False; 1 or 1.0
    equal True but are not a bool."""
    if value is not None and value is not True and value is not False:
        raise bad_type(name, "None (automatic), True or False", value)


def check_tma(tma) -> None:
    check_option("tma", tma)


def check_inner(a: torch.Tensor, b: torch.Tensor, a_name: str = "a", b_name: str = "b") -> None:
    """b [K, N] against a [M, K]: ValueError '<b_name> must be [K, N] with K = ...' otherwise."""
    if a.shape[1] != b.shape[0]:
        raise bad_shape(b_name, f"[K, N] with K = {a.shape[1]} ({a_name} is [M, K] = {tuple(a.shape)})", b.shape)


# ---- plain Python arguments ----


def check_bool(name: str, value) -> None:
    if value is not True and value is not False:
        raise bad_type(name, "a bool", value)


def check_int(name: str, value, low: int | None = None, high: int | None = None, what: str = "") -> None:
    """An int (not a bool) in [low, high]: TypeError for another type, ValueError out of range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_type(name, f"an int{' ' + what if what else ''}", value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise bad_value(name, f"an int {bounds}{' ' + what if what else ''}", value)


def check_path(name: str, value, what: str) -> None:
    """A str or os.PathLike (``what``: the file or folder it names). Anything else would reach
    the file system and come back as an unreadable file named by its repr ("None: ...")."""
    if not isinstance(value, (str, os.PathLike)):
        raise bad_type(name, f"a str or os.PathLike ({what})", value)


def resolve_device(name: str, device) -> torch.device:
    """A device where onegemm's kernels run (None: the default one): CUDA, or the CPU under the
    interpreter. Checked here because torch's own errors for a device the machine lacks
    (an AssertionError, "Torch not compiled with CUDA enabled") name neither the argument
    nor what to pass."""
    if device is None:
        return torch.device("cpu" if INTERPRET else "cuda")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise bad_type(name, "None, a str, an int (a CUDA ordinal) or a torch.device", device)
    try:
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:
        raise bad_value(name, "a device such as 'cuda', 'cuda:1' or 'cpu'", repr(device)) from e
    if INTERPRET:
        if d.type != "cpu":
            raise bad_value(name, "'cpu' or None under Triton's interpreter (TRITON_INTERPRET=1: the kernels read "
                            "host memory)", repr(device))
        return d
    if d.type != "cuda":
        raise bad_value(name, "a CUDA device or None (the kernels run on the GPU)", repr(device))
    n = torch.cuda.device_count()
    if d.index is not None and d.index >= n:
        raise bad_value(name, f"a CUDA device this machine has (cuda:0 to cuda:{n - 1})", repr(device))
    return d


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise bad_value(name, f"one of {tuple(choices)}", repr(value))


# ---- what the kernels are compiled for ----


def upcast_flag(dtype: torch.dtype) -> bool:
    """True where tiles must be converted to fp32 before tl.dot: bf16 under the interpreter."""
    return INTERPRET and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's own setting, so onegemm.matmul matches torch.matmul:
    'highest' (torch's default) -> exact fp32 products; 'high'/'medium' -> tf32 tensor cores."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def check_differentiable(**tensors) -> None:
    """Gradients are not offered through fp8 operands (they are quantised values): an fp8 input
    that requires grad is an error, never a silently dropped gradient."""
    check_optional_tensors(**tensors)
    for name, t in tensors.items():
        if t is not None and t.requires_grad and t.dtype in FP8_DTYPES:
            raise bad_value(name, "free of requires_grad for a float8 tensor (onegemm differentiates 16- and 32-bit "
                            "operands; Fp8Linear(trainable=True) trains through FP8 GEMMs)", f"{t.dtype} with requires_grad")


def check_not_differentiable(op: str, **tensors) -> None:
    """An op without a gradient refuses inputs that require one (never a silently dropped
    gradient); detach them or call under torch.no_grad()."""
    check_optional_tensors(**tensors)
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise bad_value(name, f"free of requires_grad: {op} has no gradient (detach it, or call under torch.no_grad())",
                            "a tensor that requires grad")
