"""Make the stored expert layer: grouped/data/mixtral_tiny.safetensors.

    python -m onegemm.grouped.make_layer        # rewrites the file (same bytes: fixed seed)

A small Mixtral-style sparse MoE block with the Hugging Face key names (prefix ""):
"gate.weight" [E, H] and "experts.{e}.w1/w3.weight" [I, H], "experts.{e}.w2.weight" [H, I];
8 experts, hidden 256, intermediate 512, bfloat16 (about 6.3 MB).

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


if __name__ == "__main__":
    PATH.parent.mkdir(parents=True, exist_ok=True)
    save_file(make(), str(PATH), metadata={"made_by": "onegemm/grouped/make_layer.py", "seed": str(SEED)})
    print(f"wrote {PATH} ({PATH.stat().st_size / 1e6:.1f} MB)")
