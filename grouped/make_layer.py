"""Make the stored expert layers: grouped/data/mixtral_tiny.safetensors and its FP8 twin.

    python -m onegemm.grouped.make_layer        # rewrites both files (same bytes: fixed seed)

A small Mixtral-style sparse MoE block with the Hugging Face key names (prefix ""):
"gate.weight" [E, H] and "experts.{e}.w1/w3.weight" [I, H], "experts.{e}.w2.weight" [H, I];
8 experts, hidden 256, intermediate 512, bfloat16 (about 6.3 MB).

The FP8 twin (tiny_fp8.safetensors, about 3.2 MB) is the same layer as DeepSeek-V3 and
Qwen3-FP8 checkpoints store it: "experts.{e}.gate_proj/up_proj/down_proj.weight" in
float8_e4m3fn, each with its fp32 "...weight_scale_inv" [ceil(rows/128), ceil(cols/128)] (one
scale per 128x128 block, by onegemm.quantize_fp8), and the router kept in bf16.

Scaled like trained weights: std 1/sqrt(fan_in), so activations keep their size through the
layer. Trained LLM weights also carry a few large outliers per matrix, and those are what make
FP8 scaling hard (one outlier sets a whole block's scale), so each matrix gets OUTLIERS entries
of magnitude std * (6 + 4|t|), t drawn from a Student-t (3 degrees of freedom): heavy-tailed,
in random places.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 20250101
E, H, I = 8, 256, 512
OUTLIERS = 8
PATH = Path(__file__).resolve().parent / "data" / "mixtral_tiny.safetensors"
FP8_PATH = PATH.with_name("tiny_fp8.safetensors")
FP8_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _matrix(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    std = cols ** -0.5  # fan_in = cols for an nn.Linear weight [out, in]
    w = torch.randn(rows, cols, generator=gen) * std
    # Student-t with 3 degrees of freedom, z / sqrt(chi2_3 / 3), drawn from our generator.
    t = torch.randn(OUTLIERS, generator=gen) / (torch.randn(OUTLIERS, 3, generator=gen).pow(2).sum(1) / 3).sqrt()
    where = torch.randperm(rows * cols, generator=gen)[:OUTLIERS]
    # At least 6 std (an outlier, not noise), with the t's heavy tail on top.
    w.view(-1)[where] = std * t.sign() * (6 + 4 * t.abs())
    return w.to(torch.bfloat16)


def make() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    tensors = {"gate.weight": _matrix(gen, E, H)}
    for e in range(E):
        tensors[f"experts.{e}.w1.weight"] = _matrix(gen, I, H)
        tensors[f"experts.{e}.w3.weight"] = _matrix(gen, I, H)
        tensors[f"experts.{e}.w2.weight"] = _matrix(gen, H, I)
    return tensors


def make_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's experts in FP8 (128x128 blocks) under DeepSeek-V3's names; router as it is."""
    from ..blockscaled.quantize import quantize_fp8

    out = {"gate.weight": tensors["gate.weight"]}
    for key, w in tensors.items():
        if key.startswith("experts."):
            _, e, name, _ = key.split(".")
            q, scale = quantize_fp8(w, (128, 128))
            out[f"experts.{e}.{FP8_NAMES[name]}.weight"] = q
            out[f"experts.{e}.{FP8_NAMES[name]}.weight_scale_inv"] = scale.contiguous()
    return out


if __name__ == "__main__":
    PATH.parent.mkdir(parents=True, exist_ok=True)
    layer = make()
    meta = {"made_by": "onegemm/grouped/make_layer.py", "seed": str(SEED)}
    save_file(layer, str(PATH), metadata=meta)
    save_file(make_fp8(layer), str(FP8_PATH), metadata={**meta, "from": PATH.name})
    for p in (PATH, FP8_PATH):
        print(f"wrote {p} ({p.stat().st_size / 1e6:.1f} MB)")
