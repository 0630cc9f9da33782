"""The library's import graph: no circle, no reach up the layers, no borrowed private names.

Every library module (the repository's .py files outside tests/, bench/, tools/, examples/ and
docs/; testing.py included) is parsed with ``ast``, nothing imported. Checked:

1. No import cycle between library modules. Every import statement is an edge, one inside a
   function too: a lazy import hides a cycle from import time but not from the design (the
   two modules still need each other), which is what this test is about.
2. No module imports from a package above its own. The packages' layers (each may import its
   own package and those of lower layers, never a sibling of its layer):
       core  <  blockscaled, persistent  <  grouped  <  ep
   (blockscaled and persistent each build on core alone). The top-level modules (__init__.py,
   __main__.py, testing.py) sit above them all and may import anything; no package imports them.
3. No module takes another module's ``_private`` name: neither ``from .x import _name`` nor
   ``x._name`` on an imported library module (dunder names such as ``__version__`` are public).
   Only library modules count: third-party privates (``torch.distributed._functional_collectives``)
   are those projects' business.

And the sizes that keep the library readable:

4. No function longer than MAX_FUNCTION_LINES (its decorators, signature and docstring
   included); no Gluon partition or helper (a ``@gluon.jit`` function that is not a
   ``*_kernel`` entry point) with more than MAX_GLUON_PARAMETERS parameters: group them in an
   aggregate; core/configs.py (the mechanism and the dense policy) under MAX_CONFIGS_LINES.

Each failure names the module, its import (file:line and the statement) and what it breaks.
"""

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "onegemm"
NOT_LIBRARY = {"tests", "bench", "tools", "examples", "docs"}
SKIP_DIRS = {"__pycache__", "build"}
# A package's layer: it may import packages of lower layers (and itself), no other.
LAYERS = {"core": 0, "blockscaled": 1, "persistent": 1, "grouped": 2, "ep": 3}
MAX_FUNCTION_LINES = 80
MAX_GLUON_PARAMETERS = 12
MAX_CONFIGS_LINES = 500


class Import:
    """One import of a library module ``target`` by ``module``, with the names taken from it
    (``names``; none when the module itself is imported)."""

    def __init__(self, library, module, target, names, node):
        self.library, self.module, self.target, self.names, self.node = library, module, target, names, node

    def where(self):
        return f"{self.library.path(self.module)}:{self.node.lineno}: {ast.unparse(self.node)}"


class Library:
    """The library under ``root`` (the folder of ``package``): its modules, parsed, and their
    imports; ``layers``: its subpackages' layers (LAYERS)."""

    def __init__(self, root, package=PACKAGE, layers=LAYERS):
        self.root, self.package, self.layers = Path(root), package, layers
        self.files = {}  # module name -> path
        for folder, dirs, files in os.walk(self.root):
            rel = Path(folder).relative_to(self.root)
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                             and not d.endswith(".egg-info") and not (rel == Path(".") and d in NOT_LIBRARY))
            for name in sorted(files):
                if name.endswith(".py"):
                    parts = [package, *rel.parts, name[:-3]]
                    if parts[-1] == "__init__":
                        parts.pop()
                    self.files[".".join(parts)] = Path(folder) / name
        self.packages = {m for m, path in self.files.items() if path.name == "__init__.py"}
        # module -> (its tree, its library imports, {name bound to a library module: that module})
        self.graph = {m: self._imports(m) for m in self.files}

    def path(self, module):
        return self.files[module].relative_to(self.root)

    def _resolve(self, module, node):
        """The module an ImportFrom's ``from X`` names, absolute."""
        if not node.level:
            return node.module
        base = (module if module in self.packages else module.rpartition(".")[0]).split(".")
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _imports(self, module):
        tree = ast.parse(self.files[module].read_text(), str(self.files[module]))
        found, bound = [], {}
        for node in ast.walk(tree):  # every import, at module level or inside a function
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in self.files:
                        found.append(Import(self, module, alias.name, [], node))
                        # `import onegemm.core.checks as c` binds c to that module; without `as`, it binds onegemm
                        bound[alias.asname or self.package] = alias.name if alias.asname else self.package
            elif isinstance(node, ast.ImportFrom):
                source = self._resolve(module, node)
                if source is None or source.split(".")[0] != self.package:
                    continue
                names = []
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in self.files:  # `from . import moe`: the submodule is what is imported
                        found.append(Import(self, module, sub, [], node))
                        bound[alias.asname or alias.name] = sub
                    else:
                        names.append(alias.name)
                if names:
                    assert source in self.files, f"{self.path(module)}:{node.lineno} imports from {source}, " \
                        "which is not a library module"
                    found.append(Import(self, module, source, names, node))
        return tree, found, bound

    def cycles(self):
        """One problem per strongly connected component of more than one module (Tarjan)."""
        edges = {m: sorted({i.target for i in self.graph[m][1] if i.target != m}) for m in self.files}
        index, low, stack, on_stack, components = {}, {}, [], set(), []

        def visit(v):
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in edges[v]:
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

        for v in self.files:
            if v not in index:
                visit(v)
        problems = []
        for component in components:
            inside = [i.where() for m in component for i in self.graph[m][1] if i.target in component and i.target != m]
            problems.append(f"import cycle among {', '.join(component)}:\n    " + "\n    ".join(inside))
        return problems

    def upward(self):
        """Imports of a package of the same or a higher layer (the top level included)."""
        problems = []
        for module in self.files:
            package, layer = self._layer(module)
            if package is None:
                continue  # a top-level module: may import anything
            for imp in self.graph[module][1]:
                other, other_layer = self._layer(imp.target)
                if other != package and other_layer >= layer:
                    what = "the top level" if other is None else f"{other} (layer {other_layer})"
                    problems.append(f"{module} ({package}, layer {layer}) imports from {what}: {imp.where()}")
        return problems

    def privates(self):
        """``_name`` taken from another library module, by import or as an attribute."""
        problems = []
        for module in self.files:
            tree, imports, bound = self.graph[module]
            for imp in imports:
                for name in imp.names:
                    if _private(name) and imp.target != module:
                        problems.append(f"{module} imports {imp.target}'s private {name}: {imp.where()}")
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                        and _private(node.attr) and bound[node.value.id] != module):
                    problems.append(f"{module} uses {bound[node.value.id]}'s private {node.attr}: "
                                    f"{self.path(module)}:{node.lineno}: {ast.unparse(node)}")
        return problems

    def oversized(self):
        """Functions over MAX_FUNCTION_LINES and Gluon helpers over MAX_GLUON_PARAMETERS."""
        problems = []
        for module in self.files:
            for node in ast.walk(self.graph[module][0]):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - first + 1
                where = f"{self.path(module)}:{node.lineno} {node.name}"
                if lines > MAX_FUNCTION_LINES:
                    problems.append(f"{where}: {lines} lines (at most {MAX_FUNCTION_LINES})")
                gluon = any("gluon.jit" in ast.unparse(d) for d in node.decorator_list)
                params = len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs)
                if gluon and not node.name.endswith("_kernel") and params > MAX_GLUON_PARAMETERS:
                    problems.append(f"{where}: a Gluon function of {params} parameters "
                                    f"(at most {MAX_GLUON_PARAMETERS}; group them in an aggregate)")
        return problems

    def _layer(self, module):
        """(subpackage, its layer) of a module; (None, above every layer) for a top-level one."""
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in self.layers:
            return parts[1], self.layers[parts[1]]
        return None, len(self.layers)


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


LIBRARY = Library(ROOT)


def test_the_library_is_found():
    for module in ("onegemm", "onegemm.testing", "onegemm.core.matmul", "onegemm.grouped.moe", "onegemm.ep.moe"):
        assert module in LIBRARY.files, module
    assert not any(m.split(".")[1] in NOT_LIBRARY for m in LIBRARY.files if "." in m)
    assert {m.split(".")[1] for m in LIBRARY.packages if "." in m} == set(LAYERS), "a package without a layer in LAYERS"


def test_no_import_cycle():
    problems = LIBRARY.cycles()
    assert not problems, "\n".join(problems)


def test_no_import_from_a_higher_package():
    problems = LIBRARY.upward()
    assert not problems, f"imports reaching up (or sideways) the package layers {LAYERS}:\n  " + "\n  ".join(problems)


def test_no_private_name_from_another_module():
    problems = LIBRARY.privates()
    assert not problems, "private names taken from another module:\n  " + "\n  ".join(problems)


def test_functions_stay_readable():
    problems = LIBRARY.oversized()
    configs = len(LIBRARY.files["onegemm.core.configs"].read_text().splitlines())
    if configs >= MAX_CONFIGS_LINES:
        problems.append(f"core/configs.py: {configs} lines (under {MAX_CONFIGS_LINES}: each family's policy "
                        "belongs beside its op)")
    assert not problems, "\n  ".join(["too big:"] + problems)


def test_the_size_check_finds_what_it_looks_for(tmp_path):
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    params = ", ".join(f"p{i}" for i in range(MAX_GLUON_PARAMETERS + 1))
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "m.py").write_text(
        f"def long():\n{long_body}\n\n@gluon.jit\ndef _wide({params}):\n    pass\n\n\n"
        f"@gluon.jit\ndef entry_kernel({params}):\n    pass\n\n\n@gluon.jit\ndef _fine(a, b):\n    pass\n")
    problems = Library(tmp_path, "fake", {}).oversized()
    assert problems == [f"m.py:1 long: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})",
                        f"m.py:{MAX_FUNCTION_LINES + 5} _wide: a Gluon function of {MAX_GLUON_PARAMETERS + 1} "
                        f"parameters (at most {MAX_GLUON_PARAMETERS}; group them in an aggregate)"], problems


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checker itself, on a small fake library (its own package and layer names, so that
    test_docs.py does not take the expected messages below for references to the real code):
    each kind of problem is reported with its module and import line, and what is allowed is not."""
    files = {
        "__init__.py": "from .high import *\nfrom . import testing\n",
        "testing.py": "from .low.a import _helper\n",  # the top level may import anything, but no privates
        "low/__init__.py": "",
        "low/a.py": "def _helper():\n    pass\n\n\ndef f():\n    from ..high import b  # up, and a cycle\n",
        "left/__init__.py": "",
        "left/q.py": "from ..right import p  # sideways\n",
        "right/__init__.py": "",
        "right/p.py": "import fake\n",
        "high/__init__.py": "",
        "high/b.py": "from ..low import a\n\n\ndef g():\n    return a._helper, a.__name__\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    fake = Library(tmp_path, "fake", {"low": 0, "left": 1, "right": 1, "high": 2})
    (cycle,) = fake.cycles()
    assert "among fake.high.b, fake.low.a:" in cycle and "low/a.py:6: from ..high import b" in cycle
    assert "high/b.py:1: from ..low import a" in cycle
    up = fake.upward()
    assert len(up) == 3, up  # high -> low and the top level's imports are fine
    assert "fake.low.a (low, layer 0) imports from high (layer 2): low/a.py:6: from ..high import b" in up
    assert "fake.left.q (left, layer 1) imports from right (layer 1): left/q.py:1: from ..right import p" in up
    assert "fake.right.p (right, layer 1) imports from the top level: right/p.py:1: import fake" in up
    private = fake.privates()
    assert private == ["fake.testing imports fake.low.a's private _helper: testing.py:1: from .low.a import _helper",
                       "fake.high.b uses fake.low.a's private _helper: high/b.py:5: a._helper"], private
