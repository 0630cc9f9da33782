"""The docs stay true to the code: every repository path and ``module.name`` that code and docs
cite exists, the README's python blocks run, and every signature the README documents is the
code's (inspect.signature).

Everything here reads text and runs on CPU; the README blocks run under the interpreter with the
small sizes of ``CPU_SIZES`` (see ``test_readme_python_blocks_run``).
"""

import inspect
import io
import os
import re
import tokenize
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import onegemm

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TOP_DIRS = ("core", "grouped", "persistent", "blockscaled", "ep", "tests", "bench", "docs", "tools")
PACKAGES = ("core", "grouped", "persistent", "blockscaled", "ep")
SKIP_DIRS = {"__pycache__", "build", "sass"}


def _files(*suffixes):
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(suffixes):
                yield Path(folder) / name


def _prose(path, docs_only=False):
    """What a reader reads in ``path``: a markdown or shell file whole; a .py file's comments and
    strings (docstrings, messages), not its code; with ``docs_only`` its comments and docstrings
    (strings that stand as a statement) only."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    kept, previous = [], tokenize.NEWLINE
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type == tokenize.COMMENT or (t.type == tokenize.STRING and (
                not docs_only or previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT))):
            kept.append(t.string)
        if t.type not in (tokenize.COMMENT, tokenize.NL):
            previous = t.type
    return "\n".join(kept)


def _code_names(path):
    """Every identifier the code of ``path`` uses or defines (comments and strings left out)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


# ---- (a) references: repository paths, `path.py name`, `module.name`, private helpers ----

# A path under one of the repository's folders; one followed by a wildcard or a placeholder
# (core/tuned/*.json, bench/results/{name}.md, bench/results/NAME.png) names a pattern, not a file.
PATH = r"(?<![\w/.-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*\w)(?!\.?[*{<\w])"
PLACEHOLDER = r"/[A-Z_]+(\.\w+)?$"
# `core/fp8.py fp8_cast` (the whole code span) or core/matmul.py ``auto_persistent``.
PATH_NAME = [r"`((?:" + "|".join(TOP_DIRS) + r")/[\w/]+\.py) ([A-Za-z_]\w*)`",
             r"((?:" + "|".join(TOP_DIRS) + r")/[\w/]+\.py) `{1,2}([A-Za-z_]\w*)`"]
# A dotted name whose head is one of the package's modules or onegemm itself.
CHAIN = r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)"
EXTENSIONS = {"py", "md", "json", "sh", "toml", "png", "safetensors", "txt", "log", "xml"}


def _modules():
    """module basename -> the package's files of that name (matmul is in core/, persistent/, ...)."""
    found = {}
    for path in [ROOT / "testing.py", *(p for d in PACKAGES if (ROOT / d).is_dir() for p in (ROOT / d).glob("*.py"))]:
        found.setdefault(path.stem, []).append(path)
    return found


def _resolve_onegemm(chain):
    """onegemm.a.b...: a module or folder of the repository (onegemm.grouped.make_layer, run with
    python -m), then attributes."""
    parts, place = chain.split(".")[1:], ROOT
    while parts and ((place / parts[0]).is_dir() or (place / f"{parts[0]}.py").is_file()):
        place = place / parts.pop(0)
    if not parts:
        return True
    obj = onegemm
    for part in [*place.relative_to(ROOT).parts, *parts]:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _broken_references(paths):
    modules = _modules()
    names = {path: _code_names(path) for path in _files(".py")}
    all_names = set().union(*names.values())
    broken = []
    for path in paths:
        where = os.path.relpath(path, ROOT)
        text = _prose(path)
        for ref in re.findall(PATH, text):
            if re.search(PLACEHOLDER, ref) or (where.startswith("bench/") and ref.startswith("bench/results/")):
                continue  # a pattern, or a file a benchmark writes
            if not ((ROOT / ref).exists() or (path.parent / ref).exists()):
                broken.append(f"{where}: {ref} does not exist")
        for file, name in [m for pattern in PATH_NAME for m in re.findall(pattern, text)]:
            target = ROOT / file
            if target.exists() and name not in names.get(target, set()):
                broken.append(f"{where}: {file} has no {name}")
        for chain in re.findall(CHAIN, text):
            head, attr = chain.split(".")[:2]
            if attr in EXTENSIONS:
                continue
            if head == "onegemm" and not _resolve_onegemm(chain):
                broken.append(f"{where}: {chain} does not exist")
            elif head in modules and not any(attr in names[m] for m in modules[head]):
                broken.append(f"{where}: {chain}: no {attr} in {', '.join(str(m.relative_to(ROOT)) for m in modules[head])}")
        # A private helper cited by name (`_round_up_pow2`) in a comment, docstring or doc must be
        # one the code still has (a suffix such as _ptr in prose is not a name).
        for name in sorted(set(re.findall(r"(?<![\w.}])_[a-z][a-z0-9]*_\w*[a-z0-9]\b", _prose(path, docs_only=True)))):
            if name not in all_names:
                broken.append(f"{where}: {name} is defined nowhere")
    return broken


def test_references_in_code_and_docs_exist():
    mine = Path(__file__).resolve()  # its probes below cite what does not exist
    broken = _broken_references([p for p in _files(".py", ".md", ".sh", ".toml") if p != mine])
    assert not broken, "\n".join(broken)


def test_reference_check_finds_what_is_missing(tmp_path):
    """The checker itself: each kind of stale reference is reported, and live ones are not."""
    probe = tmp_path / "probe.md"
    probe.write_text("core/gone.py, core/matmul.py `auto_persistent`, configs.no_such_name, onegemm.no_such_op, "
                     "_round_up_pow3; alive: core/tiles.py `gemm_tile`, configs.MatmulKey, onegemm.testing.moe_ffn_torch")
    broken = _broken_references([probe])
    assert [b.split(": ", 1)[1] for b in broken] == [
        "core/gone.py does not exist", "core/matmul.py has no auto_persistent",
        "configs.no_such_name: no no_such_name in core/configs.py, grouped/configs.py, blockscaled/configs.py",
        "onegemm.no_such_op does not exist",
        "_round_up_pow3 is defined nowhere"]


# ---- (b) the README's python blocks run ----

# The README's sizes are an LLM's; under the interpreter they would take hours. Each pair is
# replaced, in this order, in every block (each must still occur in the README, so the list
# cannot drift from it), and ``device="cuda"`` becomes the test's device.
CPU_SIZES = [
    ("[300, 300, 317, 318, 1018, 1024, 1024, 3024]", "[3, 3, 17, 18, 18, 24, 24, 30]"),
    ("3024", "30"),
    ("1024", "40"),
    ("14336", "48"),
    ("4096", "64"),
]
# Names the README leaves to the reader (a batch, router logits, expert weights, a model) and a
# checkpoint file, in the README's shapes at CPU_SIZES: H = 64, E = 4 experts, I = 32, T = 12.
GIVEN = """
x = torch.randn(12, 64, device=device, dtype=torch.bfloat16)
router_logits = torch.randn(12, 4, device=device, dtype=torch.bfloat16)
w_gate_up = torch.randn(4, 64, 64, device=device, dtype=torch.bfloat16) / 8
w_down = torch.randn(4, 64, 32, device=device, dtype=torch.bfloat16) / 6
model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 64)).to(device, torch.bfloat16)
"""


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _mixtral_file(path):
    """layer.safetensors: a Mixtral MoE block under the README's prefix, in GIVEN's shapes."""
    prefix, E, H, I = "model.layers.0.block_sparse_moe.", 4, 64, 32
    tensors = {f"{prefix}gate.weight": torch.randn(E, H)}
    for e in range(E):
        tensors |= {f"{prefix}experts.{e}.w1.weight": torch.randn(I, H) / 8, f"{prefix}experts.{e}.w3.weight": torch.randn(I, H) / 8,
                    f"{prefix}experts.{e}.w2.weight": torch.randn(H, I) / 6}
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path))


def test_readme_python_blocks_run(tmp_path, monkeypatch, device):
    """The blocks run in order in one namespace, as a reader runs them, after CPU_SIZES and
    the device; torch.compile gets the aot_eager backend on CPU (Inductor needs a C++
    toolchain there), the same graph without code generation. A block that starts with
    "# under torchrun" (expert parallelism: a process group per GPU) is only compiled."""
    text = README.read_text()
    for old, _ in CPU_SIZES:
        assert old in text, f"CPU_SIZES: {old!r} is no longer in the README"
    monkeypatch.chdir(tmp_path)
    _mixtral_file(tmp_path / "layer.safetensors")
    namespace = {"torch": torch, "device": device}
    exec(GIVEN, namespace)
    blocks = _python_blocks(text)
    assert len(blocks) >= 5
    for i, block in enumerate(blocks):
        if block.startswith("# under torchrun"):  # needs a process group per GPU: compiled, not run
            compile(block, f"README.md python block {i + 1}", "exec")
            continue
        for old, new in CPU_SIZES:
            block = block.replace(old, new)
        block = block.replace('device="cuda"', "device=device")
        if device == "cpu":
            block = block.replace("fullgraph=True)", 'fullgraph=True, backend="aot_eager")')
        torch._dynamo.reset()
        exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    # the last block ran: x's gradient from linear, the FP8-trained model's from the compiled loss
    assert namespace["x"].grad is not None and all(p.grad is not None for p in namespace["model"].parameters())


# ---- (c) the README's documented signatures are the code's ----

# A signature: a code span that is exactly `name(params)` of a public callable and is bold
# (**`...`**), followed by a colon, or has a bare `*`. Any other `name(...)` of a public callable
# in a code span is a call, whose keywords must be parameters.
SPAN = r"(\*\*)?`([^`]+)`(\*\*)?(:)?"
CALL = r"(?<![\w.])(?:onegemm\.)?((?:[A-Z]\w*\.)?[A-Za-z_]\w*)\(((?:[^()]|\([^()]*\))*)\)"


def _split_params(params):
    out, depth, part = [], 0, ""
    for ch in params:
        if ch == "," and depth == 0:
            out.append(part.strip())
            part = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        part += ch
    return [p for p in out + [part.strip()] if p]


def _documented():
    """(name, params, is_signature) for every code span of the README naming a public callable."""
    found, text = [], README.read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = re.findall(SPAN, prose) + [("", block, "", "") for block in _python_blocks(text)]
    for bold, span, _, colon in spans:
        span = span.replace("\n", " ")
        for call in re.finditer(CALL, span):
            name, params = call.groups()
            if _public(name) is None:
                continue
            parts = _split_params(params)
            whole = call.group(0) == span.strip()
            found.append((name, parts, whole and bool(bold or colon or "*" in parts)))
    return found


def _public(name):
    obj = onegemm
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if callable(obj) and name.split(".")[0] in dir(onegemm) else None


def _eval_default(text):
    return eval(text, {"torch": torch})


def test_readme_names_every_public_callable():
    public = {n for n in dir(onegemm) if not n.startswith("_") and callable(getattr(onegemm, n))
              and not inspect.ismodule(getattr(onegemm, n))}
    missing = public - {name.split(".")[0] for name, _, _ in _documented()}
    assert not missing, f"the README shows no call of {sorted(missing)}"


@pytest.mark.parametrize("what", ["signatures", "calls"])
def test_readme_signatures_match_the_code(what):
    documented = _documented()
    signatures = [d for d in documented if d[2]]
    assert len(signatures) >= 10, signatures  # the API section's signatures were found
    wrong = []
    for name, parts, is_signature in documented:
        params = list(inspect.signature(_public(name)).parameters.values())
        if is_signature and what == "signatures":
            want = []
            for p in params:
                if p.kind == p.KEYWORD_ONLY and "*" not in want:
                    want.append("*")
                if p.kind == p.VAR_KEYWORD:
                    want.append(f"**{p.name}")
                else:
                    want.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
            got = [part.split("=")[0] for part in parts]
            if got != [w.split("=")[0] for w in want]:
                wrong.append(f"{name}({', '.join(parts)}): the code has {name}({', '.join(want)})")
                continue
            for part, p in zip((q for q in parts if q != "*"), params):
                if "=" in part and _eval_default(part.split("=", 1)[1]) != p.default:
                    wrong.append(f"{name}: {part}, but the code's default is {p.default!r}")
                elif "=" not in part and p.default is not p.empty:
                    wrong.append(f"{name}: {part} is documented without its default {p.default!r}")
        elif not is_signature and what == "calls":
            keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
            positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
            named = [m.group(1) for m in (re.match(r"([A-Za-z_]\w*)\s*=(?!=)", part) for part in parts) if m]
            for key in named:
                if key not in keywords:
                    wrong.append(f"{name}({', '.join(parts)}): no parameter {key}")
            if len(parts) - len(named) - parts.count("...") > len(positional):
                wrong.append(f"{name}({', '.join(parts)}): more positional arguments than {name} takes")
    assert not wrong, "\n".join(wrong)
