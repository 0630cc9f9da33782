"""Exercise: bias + GELU in the GEMM's epilogue, one kernel instead of three.

    PYTHONPATH=<folder above onegemm> python examples/bias_gelu_epilogue.py

``onegemm.matmul(a, b, bias=bias, activation="gelu")`` adds the bias and applies GELU to each
fp32 accumulator tile before the cast and the store (core/tiles.py ``epilogue``): the
pre-activation never goes to memory. In plain PyTorch the same result is a GEMM, an add and a
GELU, each reading and writing the [M, N] output. The script checks the fused result against a
float64 reference and, on a GPU, times both ways (GPU time, CUDA-graph replays). Without a GPU
it runs a small problem on Triton's CPU interpreter: the check, no timing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import onegemm
from onegemm import testing


def main() -> None:
    gpu = torch.cuda.is_available() and not onegemm.INTERPRET
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    M, N, K = (4096, 4096, 4096) if gpu else (96, 80, 64)
    a = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype) * K**-0.5  # an nn.Linear weight [N, K]
    bias = torch.randn(N, device=device, dtype=dtype)

    fused = onegemm.matmul(a, w.t(), bias=bias, activation="gelu")
    unfused = F.gelu(a @ w.t() + bias)  # what the epilogue replaces: GEMM, add, GELU
    ref = testing.matmul_ref(a, w.t(), bias, "gelu")  # float64
    print(f"[{M}, {N}, {K}] {dtype}: fused relative error {testing.rel_err(fused, ref):.2e}, "
          f"torch (three ops) {testing.rel_err(unfused, ref):.2e}")
    testing.assert_close(fused, ref, testing.TOL[dtype])

    if gpu:
        t_fused = testing.gpu_ms(lambda: onegemm.matmul(a, w.t(), bias=bias, activation="gelu"))
        t_torch = testing.gpu_ms(lambda: F.gelu(a @ w.t() + bias))
        t_gemm = testing.gpu_ms(lambda: a @ w.t())
        print(f"GPU time: fused {t_fused:.3f} ms, torch GEMM + add + GELU {t_torch:.3f} ms "
              f"(its GEMM alone {t_gemm:.3f} ms): the epilogue saves {t_torch / t_fused:.2f}x")


if __name__ == "__main__":
    main()
