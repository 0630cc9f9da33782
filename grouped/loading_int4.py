"""Reading INT4 experts for grouped/loading.py: compressed-tensors' pack-quantized INT4, kept
as stored, and 4-bit GPTQ, transposed into it on load (moe_ffn's INT4 experts), with their
quantization_config checks. Asymmetric groups (zero points) of either come as scale words with
their zero points (blockscaled.pack_int4_zeros: a layout step, unpack_int4_zeros undoes it). Every key and config field is accounted for or refused, as in
loading.py; ``keys`` is always its LayerKeys (the layer's tensors under its prefix).
"""

from __future__ import annotations

import torch

from typing import NamedTuple

from ..blockscaled.quantize import pack_int4_zeros
from ..core import checks
from ..core.scaling import INT4, INT4_MIN_GROUP, INT4_ZERO


# compressed-tensors' pack-quantized INT4 (symmetric, group scales): each projection's tensors
INT4_PACKED = ((INT4,), " (pack-quantized INT4: eight 4-bit values per int32)")
INT4_REFUSED = {"weight_g_idx": "is a group index (activation-ordered groups): only contiguous groups of the input "
                                "dimension are read"}


def packed_int4(keys, per_expert: list) -> bool:
    """Whether the per-expert experts are compressed-tensors' pack-quantized INT4 (``weight_packed``
    keys); a layer mixing them with plain ``weight`` experts, and group indices (of any
    expert), are refused."""
    for n in per_expert:
        if n.rsplit(".", 1)[1] in INT4_REFUSED:
            raise keys.fail(n, INT4_REFUSED[n.rsplit(".", 1)[1]])
    packed = [n for n in per_expert if n.endswith(".weight_packed")]
    plain = [n for n in per_expert if n.endswith(".weight")]
    if packed and plain:
        raise keys.fail(plain[0], f"is a plain expert weight, but {keys.prefix + packed[0]!r} is packed INT4: the "
                                  "experts of one layer are all packed or all plain")
    return bool(packed)


def take_group_scales(keys, kinds: dict, key: str, rows: int, cols: int, kind: str, transposed: bool) -> tuple:
    """(scales, group) of a [rows, cols] INT4 matrix at ``key``: [rows, cols/group], or GPTQ's
    [cols/group, rows] (``transposed``). The first matrix of a kind (the gate/up projections,
    the down projection) sets the kind's group and scale dtype in ``kinds``; the others must
    have them."""
    group, dtype = kinds.get(kind, (None, None))
    whose = " (the group scales)" if dtype is None else f" (the group scales; the layer's other {kind} scales')"
    shape = None if group is None else ((cols // group, rows) if transposed else (rows, cols // group))
    s = keys.take(key, shape, checks.FLOAT_DTYPES if dtype is None else (dtype,), whose)
    if group is None:
        group_dim = 0 if transposed else 1
        n = s.shape[group_dim] if s.dim() == 2 else 0
        group = cols // n if n and cols % n == 0 else 0
        if s.dim() != 2 or s.shape[1 - group_dim] != rows or group < INT4_MIN_GROUP or group & (group - 1):
            expected = f"[{cols}/group, {rows}]" if transposed else f"[{rows}, {cols}/group]"
            raise keys.fail(key, f"has shape {tuple(s.shape)}, expected {expected} with the group a power of two >= "
                                 f"{INT4_MIN_GROUP} dividing {cols}")
        kinds[kind] = group, s.dtype
    return s, group


def unpack_zeros(keys, key: str, z, rows: int, along_rows: bool, minus: int = 0):
    """Zero points 0..15 [rows, groups] (uint8) from int32 words of eight 4-bit values (value j
    in bits 4j..4j+3), packed along the rows (``along_rows``: [rows/8, groups],
    compressed-tensors') or GPTQ's [groups, rows/8]; ``minus``: GPTQ v1's stored zero - 1
    (mod 16, as its kernels read it)."""
    shifts = torch.arange(0, 32, 4, device=z.device)
    nibbles = (z.long()[..., None] >> shifts) & 0xF  # [.., .., 8]
    if along_rows:
        zeros = nibbles.permute(0, 2, 1).reshape(-1, z.shape[1])[:rows]
    else:
        zeros = nibbles.flatten(1).t()[:rows]
    return ((zeros + minus) & 0xF).to(torch.uint8)


def with_zeros(keys, key: str, scale, zeros):
    """The scale words of asymmetric groups (pack_int4_zeros), 16-bit scales only (an fp32
    scale has no room for the zero point)."""
    if scale.dtype not in (torch.bfloat16, torch.float16):
        raise keys.fail(key, f"has dtype {scale.dtype}: the scales of asymmetric INT4 groups are read as "
                             "bfloat16 or float16")
    return pack_int4_zeros(scale, zeros)


class _Int4Reader:
    """Reads pack-quantized matrices [rows, cols]: ``{name}.weight_packed`` [rows, cols/8] int32,
    ``{name}.weight_scale`` [rows, cols/group], ``{name}.weight_shape`` (rows, cols) and, with
    asymmetric groups, ``{name}.weight_zero_point`` [ceil(rows/8), cols/group] (each group's
    zero point, stored + 8, eight per int32 along the rows). The first matrix of each kind (the
    gate/up projections, the down projection) sets the kind's group and scale dtype; the others
    must have them."""

    def __init__(self, keys):
        self.keys, self.kinds, self.zeros = keys, {}, None

    def __call__(self, name: str, rows, cols: int, kind: str) -> tuple:
        keys = self.keys
        if cols % 8:
            raise keys.fail(f"{name}.weight_packed", f"packs rows of {cols} values, not a multiple of 8")
        q = keys.take(f"{name}.weight_packed", None if rows is None else (rows, cols // 8), *INT4_PACKED)
        if rows is None:  # the layer's first matrix: its rows are I
            if q.dim() != 2 or q.shape[1] != cols // 8:
                raise keys.fail(f"{name}.weight_packed", f"has shape {tuple(q.shape)}, expected [I, {cols}/8]")
            rows = q.shape[0]
        shape = keys.take(f"{name}.weight_shape", (2,), (torch.int32, torch.int64), " (the weight's [rows, columns])")
        if shape.tolist() != [rows, cols]:
            raise keys.fail(f"{name}.weight_shape", f"is {shape.tolist()}, but {keys.prefix + name + '.weight_packed'!r} "
                                                    f"holds a [{rows}, {cols}] weight")
        s, group = take_group_scales(keys, self.kinds, f"{name}.weight_scale", rows, cols, kind, transposed=False)
        key = f"{name}.weight_zero_point"
        if self.zeros is None:  # the layer's first matrix: all have zero points, or none
            self.zeros = keys.has(key)
        if keys.has(key) != self.zeros:
            if self.zeros:
                raise keys.fail(f"{name}.weight_scale", "has no zero point beside it, but the layer's first matrix "
                                                        "has: one layer's experts are all asymmetric or all not")
            raise keys.fail(key, "is a zero point (asymmetric INT4), but the layer's first matrix has none: one "
                                 "layer's experts are all asymmetric or all not")
        if self.zeros:
            z = keys.take(key, (-(-rows // 8), cols // group), *INT4_PACKED)
            s = with_zeros(keys, f"{name}.weight_scale", s, unpack_zeros(keys, key, z, rows, along_rows=True))
        return q, s


def int4_experts(keys, gate, names: tuple, mine: range, router: str, read=None) -> dict:
    """compressed-tensors' pack-quantized INT4 experts (Kimi-K2-Thinking, llm-compressor's
    W4A16): per expert and projection ``weight_packed``, ``weight_scale``, ``weight_shape``
    (``_Int4Reader``), or GPTQ's with ``read`` a ``GptqReader``. Kept packed, as stored (GPTQ's
    transposed): moe_ffn's INT4 experts, each expert's gate rows then its up rows."""
    E, H = gate.shape
    if gate.dtype not in (torch.bfloat16, torch.float16):
        raise keys.fail(router, f"has dtype {gate.dtype}, expected bfloat16 or float16 (INT4 experts are "
                                "weight-only: they run in the router's dtype)")
    g_name, u_name, d_name = names
    read = read or _Int4Reader(keys)
    first = read(f"experts.{mine.start}.{g_name}", None, H, "gate/up")
    I = first[0].shape[0]
    gate_up, down, gate_up_s, down_s = [], [], [], []
    for e in mine:
        wg, sg = first if e == mine.start else read(f"experts.{e}.{g_name}", I, H, "gate/up")
        wu, su = read(f"experts.{e}.{u_name}", I, H, "gate/up")
        wd, sd = read(f"experts.{e}.{d_name}", H, I, "down")
        gate_up.append(torch.cat([wg, wu]))
        gate_up_s.append(torch.cat([sg, su]))
        down.append(wd)
        down_s.append(sd)
    return dict(w_gate_up=torch.stack(gate_up), w_down=torch.stack(down), w_gate_up_scale=torch.stack(gate_up_s),
                w_down_scale=torch.stack(down_s))


# GPTQ (AutoGPTQ, GPTQModel, transformers' "gptq" quant_method), 4-bit: each projection's
# tensors. Zero points are stored as zero - 1 by checkpoint_format "gptq" (v1) and as they are by
# "gptq_v2", eight per int32 along the output dimension; a symmetric weight's are all 8, one
# word everywhere.
GPTQ_PACKED = ((INT4,), " (GPTQ: eight 4-bit values per int32)")
GPTQ_ZERO_WORDS = {"gptq": 0x77777777, "gptq_v2": 0x88888888 - 2**32}  # as int32


class GptqStorage(NamedTuple):
    """How a GPTQ config stores its experts: checkpoint_format ("gptq" or "gptq_v2") and sym."""

    format: str = "gptq"
    symmetric: bool = True


def gptq_int4(keys, per_expert: list, gptq_format) -> bool:
    """Whether the per-expert experts are GPTQ's (``qweight`` keys). Refused: GPTQ experts under
    a config whose quantization_config is not GPTQ (``gptq_format`` ""), compressed-tensors'
    packed experts under a GPTQ one, a GPTQ expert's bias, and plain or packed expert weights
    beside GPTQ ones."""
    qweight = [n for n in per_expert if n.endswith(".qweight")]
    if not qweight:
        packed = [n for n in per_expert if n.endswith(".weight_packed")]
        if packed and gptq_format:
            raise keys.fail(packed[0], "is compressed-tensors' packed INT4, but the config's quantization_config "
                                       "is GPTQ (quant_method 'gptq', whose experts are qweight, qzeros, scales)")
        return False
    if gptq_format == "":
        raise keys.fail(qweight[0], "is a GPTQ weight, but the config has no GPTQ quantization_config "
                                    "(quant_method 'gptq')")
    for n in per_expert:
        last = n.rsplit(".", 1)[1]
        if last == "bias":
            raise keys.fail(n, "is the bias of a GPTQ expert: MoEFFN's INT4 experts have none")
        if last in ("weight", "weight_packed"):
            raise keys.fail(n, f"is a {'plain' if last == 'weight' else 'packed INT4'} expert weight, but "
                               f"{keys.prefix + qweight[0]!r} is GPTQ: the experts of one layer are all in one format")
    return True


class GptqReader:
    """Reads GPTQ matrices [rows, cols] (a Linear's [out, in]): ``{name}.qweight`` [cols/8, rows]
    int32 (eight values along the input per word, value j in bits 4j..4j+3, stored as value +
    8: the words of compressed-tensors' weight_packed), ``{name}.scales`` [cols/group, rows],
    ``{name}.qzeros`` [cols/group, rows/8] (symmetric: every zero point 8) and, optionally,
    ``{name}.g_idx`` [cols] (must be arange(cols) // group: no activation order). Returns
    (qweight.t(), scales.t()) made contiguous: weight_packed [rows, cols/8] and weight_scale
    [rows, cols/group], the words and scales unchanged (a layout step on load: transposing them
    back gives the file's tensors); asymmetric (``storage.symmetric`` False), the scales with
    their zero points (pack_int4_zeros). The first matrix of each kind (gate/up, down) sets the
    kind's group and scale dtype; the others must have them. ``storage`` None: no config, read
    as GptqStorage()'s default."""

    def __init__(self, keys, storage):
        self.keys, self.given, self.kinds = keys, storage is not None, {}
        self.format, self.symmetric = storage or GptqStorage()

    def __call__(self, name: str, rows, cols: int, kind: str) -> tuple:
        keys = self.keys
        if cols % 8:
            raise keys.fail(f"{name}.qweight", f"packs columns of {cols} values, not a multiple of 8")
        q = keys.take(f"{name}.qweight", None if rows is None else (cols // 8, rows), *GPTQ_PACKED)
        if rows is None:  # the layer's first matrix: its rows are I
            if q.dim() != 2 or q.shape[0] != cols // 8:
                raise keys.fail(f"{name}.qweight", f"has shape {tuple(q.shape)}, expected [{cols}/8, I]")
            rows = q.shape[1]
        s, group = take_group_scales(keys, self.kinds, f"{name}.scales", rows, cols, kind, transposed=True)
        z = self._zeros(name, rows, cols // group)
        if keys.has(f"{name}.g_idx"):
            self._g_idx(name, cols, group)
        if not self.symmetric:
            minus = 1 if self.format == "gptq" else 0
            return q.t().contiguous(), with_zeros(keys, f"{name}.scales", s.t().contiguous(),
                                                  unpack_zeros(keys, f"{name}.qzeros", z, rows, False, minus))
        return q.t().contiguous(), s.t().contiguous()

    def _zeros(self, name: str, rows: int, groups: int):
        """``{name}.qzeros``, and symmetric: every zero point 8 (the word GPTQ_ZERO_WORDS[format])."""
        keys, key = self.keys, f"{name}.qzeros"
        if rows % 8:
            raise keys.fail(key, f"packs the zero points of {rows} output rows, not a multiple of 8")
        z = keys.take(key, (groups, rows // 8), *GPTQ_PACKED)
        if not self.symmetric:
            return z
        word = GPTQ_ZERO_WORDS[self.format]
        bad = (z != word).nonzero()
        if len(bad):
            i, j = bad[0].tolist()
            given = "" if self.given else ", the default without a config"
            raise keys.fail(key, f"is not symmetric: word [{i}, {j}] is {int(z[i, j]) & 0xFFFFFFFF:#010x}, expected "
                                 f"{word & 0xFFFFFFFF:#010x} everywhere (every zero point 8, stored as "
                                 f"{word & 0xF} by checkpoint_format {self.format!r}{given}), as the config's "
                                 "sym = true says")
        return z

    def _g_idx(self, name: str, cols: int, group: int) -> None:
        """``{name}.g_idx``: input i in group i // group (no activation order)."""
        keys, key = self.keys, f"{name}.g_idx"
        g = keys.take(key, (cols,), (torch.int32, torch.int64), " (each input's group)")
        plain = torch.arange(cols, device=g.device) // group
        bad = (g.long() != plain).nonzero()
        if len(bad):
            i = int(bad[0])
            raise keys.fail(key, f"puts input {i} in group {int(g[i])}, not {i} // {group} = {i // group}: "
                                 "activation-ordered groups (desc_act); only contiguous groups are read")


# compressed-tensors' weight arguments of a scheme moe_ffn reads: (argument, its value when
# absent (compressed-tensors' default), the values read). actorder "weight" (alias "static")
# orders the calibration only and stores plain groups; "group" (alias "dynamic", or true) stores
# a g_idx.
INT4_WEIGHTS = (("num_bits", 8, (4,)), ("type", "int", ("int",)), ("symmetric", True, (True, False)),
                ("dynamic", False, (False,)), ("actorder", None, (None, False, "weight", "static")))


def _int4_weights(weights: dict, at: str, where) -> int:
    """One scheme's ``weights`` arguments, checked (INT4_WEIGHTS, strategy "group" with a
    power-of-two group_size >= 32). Returns (the group size, whether symmetric)."""
    g = weights.get("group_size")
    # an absent strategy follows group_size, as compressed-tensors infers it
    inferred = "group" if isinstance(g, int) and g > 0 else "channel" if g == -1 else "tensor"
    for arg, default, read in (*INT4_WEIGHTS, ("strategy", inferred, ("group",))):
        got = weights.get(arg, default)
        got = got.lower() if isinstance(got, str) else got
        if got not in read:
            raise checks.in_file(where, f"{at}.weights.{arg} = {got!r}: only {' / '.join(map(repr, read))} is read "
                                        "(INT4 with contiguous groups of scales)")
    if not isinstance(g, int) or g < INT4_MIN_GROUP or g & (g - 1):
        raise checks.in_file(where, f"{at}.weights.group_size = {g!r}: expected a power of two >= {INT4_MIN_GROUP}")
    return g, weights.get("symmetric", True)


def int4_groups(quant: dict, where) -> set:
    """A compressed-tensors quantization_config, checked: every scheme of config_groups is
    weight-only INT4 with group scales (and zero points where asymmetric), stored
    pack-quantized (W4A16; which modules it covers, its targets and the ignore list, the
    tensors show). Returns its (group size, symmetric) pairs."""
    field = "quantization_config"
    for extra in ("sparsity_config", "transform_config"):
        if quant.get(extra):
            raise checks.in_file(where, f"{field}.{extra} = {quant[extra]}: only quantised (not sparse or "
                                        "transformed) weights are read")
    schemes = quant.get("config_groups")
    if not isinstance(schemes, dict) or not schemes:
        raise checks.in_file(where, f"{field}.config_groups = {schemes!r}: expected the quantisation schemes")
    groups = set()
    for name, scheme in schemes.items():
        at = f"{field}.config_groups.{name}"
        fmt = scheme.get("format") or quant.get("format")
        if fmt != "pack-quantized":
            raise checks.in_file(where, f"{at}: format {fmt!r}, only 'pack-quantized' INT4 is read")
        for act in ("input_activations", "output_activations"):
            if scheme.get(act):
                raise checks.in_file(where, f"{at}.{act} = {scheme[act]}: activation quantisation; only "
                                            "weight-only INT4 (W4A16) is read")
        groups.add(_int4_weights(scheme.get("weights") or {}, at, where))
    return groups


# A GPTQ quantization_config's fields that decide how the tensors are stored: (field, its value
# when absent (transformers' GPTQConfig default), the values read). "format" is the newer name
# of checkpoint_format; "dynamic" (GPTQModel) overrides bits or group per module; an "adapter"
# (GPTQModel's EoRA / LoRA) adds weights the layer would not have; is_marlin_format stores
# another layout.
GPTQ_FIELDS = (("bits", None, (4,)), ("sym", True, (True, False)), ("desc_act", False, (False,)),
               ("checkpoint_format", "gptq", tuple(GPTQ_ZERO_WORDS)), ("format", "gptq", tuple(GPTQ_ZERO_WORDS)),
               ("pack_dtype", "int32", ("int32",)), ("dynamic", None, (None, {})), ("adapter", None, (None,)),
               ("is_marlin_format", False, (False,)))
# Fields GPTQ tooling writes that leave those tensors as read, ignored: the calibration
# (damp_percent, damp_auto_increment, true_sequential, mse, static_groups, act_group_aware:
# GPTQModel's group-aware reordering, undone before packing, keeps g_idx arange // group, which
# the tensors are checked for), provenance (meta, quantizer, model_name_or_path,
# model_file_base_name), which modules were quantised (the tensors show it) and transformers'
# / optimum's calibration and kernel options. Any other field is refused.
GPTQ_IGNORED = frozenset((
    "damp_percent", "damp_auto_increment", "true_sequential", "mse", "static_groups", "act_group_aware", "meta",
    "quantizer", "model_name_or_path", "model_file_base_name", "modules_in_block_to_quantize", "lm_head",
    "block_name_to_quantize", "module_name_preceding_first_block", "tokenizer", "dataset", "batch_size",
    "pad_token_id", "model_seqlen", "max_input_length", "cache_block_outputs", "backend", "use_exllama",
    "disable_exllama", "exllama_config", "use_cuda_fp16"))


def gptq_config(quant: dict, where) -> tuple:
    """A GPTQ quantization_config, checked: 4 bits, not activation-ordered, groups of a power of
    two >= 32, stored as checkpoint_format "gptq" or "gptq_v2" in int32 words, no per-module
    overrides (GPTQ_FIELDS); other fields must be GPTQ_IGNORED's. Returns (the group size,
    GptqStorage)."""
    field = "quantization_config"
    for name in sorted(quant):
        if name not in GPTQ_IGNORED and name not in {"quant_method", "group_size", *(f for f, _, _ in GPTQ_FIELDS)}:
            raise checks.in_file(where, f"{field}.{name} = {quant[name]!r}: not a GPTQ field known to leave the "
                                        "stored tensors as MoEFFN reads them")
    for name, default, read in GPTQ_FIELDS:
        got = quant.get(name, default)
        got = got.lower() if isinstance(got, str) else got
        if got not in read:
            raise checks.in_file(where, f"{field}.{name} = {got!r}: only {' / '.join(map(repr, read))} is read "
                                        "(4-bit GPTQ with contiguous groups of scales)")
    fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
    if "format" in quant and str(quant["format"]).lower() != fmt:
        raise checks.in_file(where, f"{field}.format = {quant['format']!r} and checkpoint_format = "
                                    f"{quant['checkpoint_format']!r}: two storage formats")
    g = quant.get("group_size")
    if not isinstance(g, int) or g < INT4_MIN_GROUP or g & (g - 1):
        why = " (one scale per output channel)" if g == -1 else ""
        raise checks.in_file(where, f"{field}.group_size = {g!r}{why}: expected a power of two >= {INT4_MIN_GROUP}")
    return g, GptqStorage(fmt, quant.get("sym", True))


def gptq_format(cfg: dict):
    """parse_layer's ``gptq_format`` for a (checked) config: its GptqStorage, "" if it is not
    GPTQ."""
    quant = cfg.get("quantization_config") or {}
    return gptq_config(quant, "config")[1] if quant.get("quant_method") == "gptq" else ""


def check_int4_with_config(tensors_, cfg, *, prefix, where, config_name):
    """Packed INT4 experts need the config's compressed-tensors quantization_config, its group
    size and its symmetry (zero points where it is asymmetric, none where symmetric); GPTQ ones
    (parse_layer read them only under a GPTQ config, by its sym) its group size."""
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") == "gptq":
        group, storage = gptq_config(quant, config_name)
        schemes = {(group, storage.symmetric)}
    elif quant.get("quant_method") != "compressed-tensors":
        raise checks.in_file(where, f"the experts of {prefix!r} are packed INT4 (weight_packed), but {config_name} "
                                    "has no compressed-tensors quantization_config")
    else:
        schemes = int4_groups(quant, config_name)
    H, I = tensors_["w_down"].shape[1], tensors_["w_down"].shape[2] * 8
    for what, K, scale in (("gate_proj / up_proj", H, "w_gate_up_scale"), ("down_proj", I, "w_down_scale")):
        g, symmetric = K // tensors_[scale].shape[2], tensors_[scale].dtype != INT4_ZERO
        if (g, symmetric) not in schemes:
            stored = f"groups of {g} values, {'symmetric' if symmetric else 'with zero points'}"
            config = ", ".join(f"group_size {gs} {'symmetric' if sym else 'asymmetric'}" for gs, sym in sorted(schemes))
            raise checks.in_file(where, f"the {what} scales of {prefix!r} give {stored}, but {config_name}'s "
                                        f"quantization_config has {config}")
