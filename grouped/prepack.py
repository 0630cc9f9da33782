"""MXFP4 expert weights in fragment order: the layout the 4-bit K loop decodes in place.

With the weights as wgmma's register operand (the tile computed transposed, acc^T = W X^T;
core/tiles.py TileSpec.W4_FRAG), each thread of a warp holds, per 16 weight rows and 128 K,
rows g and g + 8 (g its lane / 4) at K 16q + 2c + (0, 1, 8, 9) (c its lane % 4, q = 0..7).
``to_fragments`` stores exactly those 64 values as 32 contiguous bytes, eight 4-bit codes per
32-bit word, coded (core/tiles.py FRAG_BITS) so that the decode is a mask, a shift and one
bf16x2 multiply per register pair, with no byte permutes and no exchange between threads.

Layout of one expert's rows, [N, ceil(K / 128) * 64] uint8 (N a multiple of 16, K padded to
the 128 block with zero codes): per 16-row group and 128-wide K block, stored row 2g + ch
(g = 0..7, ch = 0, 1) holds lanes c = 2ch and 2ch + 1 of the quad, 32 bytes each; their 8
words, one per 16-wide K chunk q, hold in byte i = 2h + j the values of row g + 8h at K
16q + 2c + j (first output) and 16q + 2c + j + 8 (second). The e8m0 scales stay [N, K / 32]
per row (padded with 1.0). SwiGLU's gate and up rows are interleaved (gate j, up j, ...).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core import checks
from ..core.runtime import cdiv
from ..core.scaling import MXFP4, MXFP4_BLOCK, MXFP4_PREPACKED, MXFP4_SCALE
from ..core.tiles import FRAG_BITS

K_BLOCK = 128  # the layout's K unit (one wgmma register set per 16-wide chunk, 8 chunks)
ROW_GROUP = 16  # the layout's row unit (wgmma's m16 rows of a warp)
_CHUNK = 8  # experts prepacked at a time: bounds the int64 temporaries


class PrepackedMxfp4(NamedTuple):
    """MXFP4 experts in fragment order (``prepack_mxfp4``): what grouped_matmul and moe_ffn
    take in place of an MXFP4 weight and its scales.

    values: uint8 [E, N, ceil(K / 128) * 64], the fragment-order codes (module docstring).
    scales: float8_e8m0fnu [E, N, ceil(K / 128) * 4], one per 32 values along K, per row.
    k: the weights' K (values and scales are padded to the 128 block).
    gate_up: rows are SwiGLU's gate and up halves interleaved (gate j, up j): moe_ffn's
        w_gate_up; False for a plain weight (grouped_matmul, the down projection).
    """

    values: torch.Tensor
    scales: torch.Tensor
    k: int
    gate_up: bool = False

    @property
    def shape(self) -> tuple:
        """(E, N, K) of the weights prepacked (N: both halves with gate_up)."""
        return (self.values.shape[0], self.values.shape[1], self.k)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as stored again: (float4_e2m1fn_x2 [E, N, K / 2], e8m0 [E, N, K / 32]),
        gate rows before up rows."""
        return from_fragments(self)


def to_fragments(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [E, N, K] (one 4-bit code per byte; N % 16 == 0, K % 128 == 0) ->
    fragment-order bytes uint8 [E, N, K / 2] (module docstring)."""
    E, N, K = codes.shape
    # n = 16 r + 8 h + g; k = 128 b + 16 q + 8 x + 4 ch + 2 cl + j
    v = codes.reshape(E, N // 16, 2, 8, K // 128, 8, 2, 2, 2, 2).long()
    #                 E  r      h  g  b         q  x  ch cl j
    v = v.permute(0, 1, 3, 7, 4, 8, 5, 6, 2, 9)  # E r g ch b cl q | x h j: a word's 8 slots, 4x + 2h + j
    v = v.reshape(*v.shape[:7], 8)
    word = torch.zeros(v.shape[:7], dtype=torch.int64, device=codes.device)
    for slot, places in enumerate(FRAG_BITS):
        for bit, place in zip((3, 2, 1, 0), places):  # (sign, e1, e0, m)
            word |= ((v[..., slot] >> bit) & 1) << place
    out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)  # little-endian bytes
    return out.to(torch.uint8).reshape(E, N, K // 2)


def _codes_of(fragments: torch.Tensor) -> torch.Tensor:
    """``to_fragments``' inverse: uint8 [E, N, K / 2] -> codes uint8 [E, N, K]."""
    E, N, half = fragments.shape
    K = 2 * half
    b = fragments.reshape(E, N // 16, 8, 2, K // 128, 2, 8, 4).long()  # E r g ch b cl q i
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    slots = []
    for places in FRAG_BITS:
        code = torch.zeros_like(word)
        for bit, place in zip((3, 2, 1, 0), places):
            code |= ((word >> place) & 1) << bit
        slots.append(code)
    v = torch.stack(slots, dim=-1).reshape(*word.shape, 2, 2, 2)  # ... x h j
    v = v.permute(0, 1, 8, 2, 4, 6, 7, 3, 5, 9)  # E r h g b q x ch cl j
    return v.reshape(E, N, K).to(torch.uint8)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[E, 2n, ...] gate rows then up rows -> gate j, up j interleaved."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def prepack_mxfp4(w: torch.Tensor, scale: torch.Tensor, *, gate_up: bool = False) -> PrepackedMxfp4:
    """MXFP4 experts as stored -> fragment order, once, for the fast 4-bit K loop.

    w: float4_e2m1fn_x2 [E, N, K / 2] (gpt-oss's ``*_blocks`` flattened to two values per
    element along K, the first in the lower nibble); scale: float8_e8m0fnu [E, N, K / 32].
    N a multiple of 16 (of 32 with gate_up), K of 32. gate_up: w's rows are SwiGLU's gate half
    then its up half (moe_ffn's w_gate_up). The result holds the same values, losslessly
    (``PrepackedMxfp4.unpack``), on w's device.
    """
    checks.check_tensor("w", w, ndim=3, dtypes=(MXFP4,))
    checks.check_tensor("scale", scale, ndim=3, dtypes=(MXFP4_SCALE,))
    checks.check_bool("gate_up", gate_up)
    checks.check_same_device(w=w, scale=scale)
    E, N, half = w.shape
    K = 2 * half
    rows = 2 * ROW_GROUP if gate_up else ROW_GROUP
    if N % rows:
        raise checks.bad_shape("w", f"[E, N, K / 2] with N a multiple of {rows} (the layout's {ROW_GROUP}-row groups"
                               f"{', of both halves' if gate_up else ''})", w.shape)
    if K % MXFP4_BLOCK:
        raise checks.bad_shape("w", f"[E, N, K / 2] with K a multiple of {MXFP4_BLOCK} (MXFP4's block)", w.shape)
    checks.check_shape("scale", scale, (E, N, K // MXFP4_BLOCK),
                       f"[E, N, K / {MXFP4_BLOCK}] = [{E}, {N}, {K // MXFP4_BLOCK}] (one e8m0 scale per 32 values)")
    KP = cdiv(K, K_BLOCK) * K_BLOCK
    values = torch.empty(E, N, KP // 2, dtype=MXFP4_PREPACKED, device=w.device)
    scales = torch.full((E, N, KP // MXFP4_BLOCK), 127, dtype=torch.uint8, device=w.device)
    scales[:, :, :K // MXFP4_BLOCK] = _interleave(scale.view(torch.uint8)) if gate_up else scale.view(torch.uint8)
    for e in range(0, E, _CHUNK):
        b = w[e:e + _CHUNK].view(torch.uint8)
        codes = torch.zeros(b.shape[0], N, KP, dtype=torch.uint8, device=w.device)
        codes[:, :, 0:K:2] = b & 0xF
        codes[:, :, 1:K:2] = b >> 4
        values[e:e + _CHUNK] = to_fragments(_interleave(codes) if gate_up else codes)
    return PrepackedMxfp4(values, scales.view(MXFP4_SCALE), K, gate_up)


def from_fragments(p: PrepackedMxfp4) -> tuple[torch.Tensor, torch.Tensor]:
    """``prepack_mxfp4``'s inverse: (w float4_e2m1fn_x2 [E, N, K / 2], scale e8m0 [E, N, K / 32])."""
    codes = _codes_of(p.values)[:, :, :p.k]
    scale = p.scales.view(torch.uint8)[:, :, :p.k // MXFP4_BLOCK]
    if p.gate_up:
        codes, scale = _deinterleave(codes), _deinterleave(scale)
    w = (codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).contiguous()
    return w.view(MXFP4), scale.contiguous().view(MXFP4_SCALE)


def check_prepacked(name: str, p: PrepackedMxfp4, gate_up: bool) -> None:
    """A PrepackedMxfp4 argument: its tensors as ``prepack_mxfp4`` makes them, and its gate_up
    as the caller's use of it needs."""
    if p.gate_up != gate_up:
        want = "prepacked with gate_up=True (SwiGLU's gate and up rows)" if gate_up else "prepacked with gate_up=False"
        raise checks.bad_value(name, f"a PrepackedMxfp4 {want}", f"gate_up={p.gate_up}")
    checks.check_tensor(f"{name}.values", p.values, ndim=3, dtypes=(MXFP4_PREPACKED,))
    checks.check_tensor(f"{name}.scales", p.scales, ndim=3, dtypes=(MXFP4_SCALE,))
    E, N, half = p.values.shape
    blocks = cdiv(p.k, K_BLOCK) if isinstance(p.k, int) and p.k > 0 else -1
    if blocks < 0 or p.k % MXFP4_BLOCK or half != blocks * K_BLOCK // 2 or N % ROW_GROUP:
        raise checks.bad_shape(f"{name}.values", f"[E, N, ceil(k / 128) * 64] with N a multiple of 16 for k = {p.k} "
                               "(as prepack_mxfp4 makes it)", p.values.shape)
    checks.check_shape(f"{name}.scales", p.scales, (E, N, blocks * K_BLOCK // MXFP4_BLOCK),
                       f"[E, N, ceil(k / 128) * 4] = [{E}, {N}, {blocks * 4}]")
    if p.values.stride(2) != 1 or p.scales.stride(2) != 1:
        raise checks.bad_value(name, "values and scales with unit stride along their last dimension (as prepacked)",
                               f"strides {tuple(p.values.stride())} and {tuple(p.scales.stride())}")


def unwrap_prepacked(a, b, scale_b) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_matmul's ``b``, a PrepackedMxfp4 of [G, N, K] weights, as the kernels read it:
    (uint8 [G, ceil(K / 128) * 64, N], e8m0 [G, ceil(K / 128) * 4, N]), the transposes of its
    values and scales. Refuses bare uint8 (only prepack_mxfp4 makes the order they are read in)."""
    if not isinstance(b, PrepackedMxfp4):
        raise checks.bad_value("b", "a PrepackedMxfp4 (onegemm.prepack_mxfp4) for fragment-order MXFP4 bytes; uint8 "
                               "is not read as weights otherwise", "a bare uint8 tensor")
    if scale_b is not None:
        raise checks.bad_value("scale_b", "None with a PrepackedMxfp4 b (it carries its scales)", "a tensor")
    check_prepacked("b", b, gate_up=False)
    if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[1] != b.k:
        raise checks.bad_shape("a", f"[sum_M, K] with K = {b.k} (the prepacked weights' k)", a.shape)
    return b.values.transpose(1, 2), b.scales.transpose(1, 2)


def prepacked(w_gate_up, w_down) -> bool:
    """Whether moe_ffn's experts are PrepackedMxfp4s (or bare uint8 values, refused by
    moe_experts). On every eager call: kept to two type tests and a dtype read."""
    return (w_gate_up.__class__ is PrepackedMxfp4 or w_down.__class__ is PrepackedMxfp4
            or (isinstance(w_gate_up, torch.Tensor) and w_gate_up.dtype is MXFP4_PREPACKED))


def moe_experts(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale) -> tuple:
    """moe_ffn's prepacked experts as its 4-bit path reads them: (w_gate_up uint8 [E, 2I, HP/2],
    w_down uint8 [E, H, IP/2], their e8m0 scales [E, 2I, HP/32] and [E, H, IP/32]), HP and IP
    H and I padded to the 128 block. Both weights prepacked (w_gate_up with gate_up), no scales."""
    for name, w, gate_up in (("w_gate_up", w_gate_up, True), ("w_down", w_down, False)):
        if not isinstance(w, PrepackedMxfp4):
            raise checks.bad_value(name, "a PrepackedMxfp4 (onegemm.prepack_mxfp4) like the other expert weight",
                                   type(w).__name__ if not isinstance(w, torch.Tensor) else f"a {w.dtype} tensor")
        check_prepacked(name, w, gate_up)
    for name, t in (("w_gate_up_scale", w_gate_up_scale), ("w_down_scale", w_down_scale)):
        if t is not None:
            raise checks.bad_value(name, "None with prepacked experts (they carry their scales)", "a tensor")
    H, two_i = w_gate_up.k, w_gate_up.values.shape[1]
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] != H:
        raise checks.bad_shape("x", f"[T, H] with H = {H} (the prepacked w_gate_up's k)", x.shape)
    if w_down.k != two_i // 2 or w_down.values.shape[1] != H or w_down.values.shape[0] != w_gate_up.values.shape[0]:
        raise checks.bad_shape("w_down", f"prepacked [E, H, I] = [{w_gate_up.values.shape[0]}, {H}, {two_i // 2}] "
                               "(w_gate_up's E, H and I)", w_down.shape)
    return w_gate_up.values, w_down.values, w_gate_up.scales, w_down.scales
