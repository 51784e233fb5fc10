"""DESIGN.md's rules of the road, checked on the source with ``ast`` (nothing is imported):

1. **No import cycles** between fxmegatron modules. An edge A -> B is any ``import`` of B
   in A, at module level or inside a function (``import fxmegatron.b``, ``from
   fxmegatron.x import b`` where b is a module, else an edge to ``fxmegatron.x``; relative
   imports resolved the same way). Imports under ``if TYPE_CHECKING:`` do not run and are
   left out; a package's ``__init__`` counts only where it is imported by name.
2. **No module reads another module's underscore names.** A private name is one that
   starts with ``_`` and is not a dunder. In module M, these are violations:
   - ``from fxmegatron.x import _y`` (x other than M);
   - ``mod._y`` where ``mod`` is a name M bound to another fxmegatron module
     (``import fxmegatron.x as mod``, ``from fxmegatron import x``, ``fxmegatron.x._y``);
   - ``obj._y`` (read or written) where the attribute ``_y`` belongs to other fxmegatron
     modules and not to M. An attribute belongs to the modules whose classes define it: in
     the class body (a method, a class attribute, a dataclass field) or by assigning
     ``self._y`` / ``cls._y`` (or ``setattr(self, "_y", ...)``). If no class defines it, it
     belongs to the modules whose classes read ``self._y``, and failing that to those that
     assign ``obj._y`` (ParallelModel's ``_seed`` is set by ``parallelize`` in api.py). So
     ``pm._pipeline`` in io/checkpoint.py, or ``self._pm._grad_sync``, is caught; ``self._y``
     of M's own classes is not, nor are private attributes that no fxmegatron module
     defines (torch's, such as ``t._local_tensor``): those are not this rule's business.
   The rule errs towards silence: a module that owns a ``_y`` of its own may read another
   object's ``_y`` unseen. A class that reads ``self._y`` defined by a base class in
   another module is caught.
3. **Every file in fxmegatron/ is under MAX_LINES lines.**
4. **No import goes up the layers** of LAYERS, bottom to top: the graph-level building blocks
   (capture, ops, codegen, kernels), then ``passes/`` (graph -> graph), ``lower/`` (a
   transformed graph -> modules: materialisation, stages, torch.compile), ``program.py`` (one
   rank's program), ``runtime/`` (what runs it). A module may import its own layer and those
   below, never one above: ``runtime`` may import ``lower``, not the reverse; ``program.py``
   and ``passes/`` import nothing from ``runtime``. Here imports under ``if TYPE_CHECKING:``
   count too (a type-only import up the layers is still a dependency on what sits above).
   Modules in no layer (compiler, config, io, verify, train, ...) are not constrained.

The checks take the package's directory, so the tests of the checks themselves
(``test_checks_*``) run them on small planted trees.
"""
from __future__ import annotations

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fxmegatron")
MAX_LINES = 400


# ---- reading the package ----------------------------------------------------------------------
def modules(package_dir: str) -> Dict[str, str]:
    """{dotted module name: file path} for every .py file under ``package_dir`` (a package's
    ``__init__.py`` is the package itself)."""
    top = os.path.basename(os.path.normpath(package_dir))
    out = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, package_dir)
        parts = [top] + ([] if rel == "." else rel.split(os.sep))
        for f in sorted(filenames):
            if f.endswith(".py"):
                name = parts if f == "__init__.py" else parts + [f[:-3]]
                out[".".join(name)] = os.path.join(dirpath, f)
    return out


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def is_private(name: str) -> bool:
    return name.startswith("_") and len(name) > 1 and not (name.startswith("__") and name.endswith("__"))


def _type_checking_only(tree: ast.Module) -> Set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
                    (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
    return skip


def imports(tree: ast.Module, module: str, is_package: bool,
            type_checking: bool = False) -> Iterator[Tuple[ast.AST, str, List[str]]]:
    """Every executed import in ``tree`` as (node, absolute base module, imported names);
    ``import a.b`` gives (node, "a.b", []), ``from a import b, c`` gives (node, "a", ["b", "c"]).
    ``type_checking``: those under ``if TYPE_CHECKING:`` as well."""
    skip = set() if type_checking else _type_checking_only(tree)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            yield node, base, [a.name for a in node.names]


# ---- 1. import cycles ---------------------------------------------------------------------------
def import_graph(package_dir: str) -> Dict[str, Set[str]]:
    """{module: the fxmegatron modules it imports}."""
    mods = modules(package_dir)
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for _, base, names in imports(parse(path), m, path.endswith("__init__.py")):
            targets = [f"{base}.{n}" if f"{base}.{n}" in mods else base for n in names] or [base]
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


def tangles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): the
    sets of modules that import each other, directly or not."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(comps, key=min)


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (a path that returns to its start) in each tangle: the shortest through its
    first module."""
    return [_shortest_cycle(graph, comp, min(comp)) for comp in tangles(graph)]


def _shortest_cycle(graph, comp, start):
    """The shortest path start -> ... -> start inside ``comp`` (breadth first)."""
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")   # cannot happen: comp is strongly connected


# ---- 2. private names -----------------------------------------------------------------------------
def _is_self(expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("self", "cls")


def private_attributes(tree: ast.Module) -> Tuple[Set[str], Set[str], Set[str]]:
    """The private attribute names a module (1) defines: in a class body (a method, a class
    attribute, a dataclass field) or by assigning ``self._y`` / ``cls._y`` (or ``setattr(self,
    "_y", ...)``) in a class; (2) reads as ``self._y`` / ``cls._y`` in a class; (3) assigns
    on any object (``obj._y = ...``)."""
    defines, self_reads, assigns = set(), set(), set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defines.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                defines.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) and isinstance(stmt.target, ast.Name):
                defines.add(stmt.target.id)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and _is_self(node.value):
                (defines if isinstance(node.ctx, ast.Store) else self_reads).add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) >= 2 and _is_self(node.args[0]) and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                defines.add(node.args[1].value)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            assigns.add(node.attr)
    return tuple({n for n in names if is_private(n)} for names in (defines, self_reads, assigns))


def owners(trees: Dict[str, ast.Module]) -> Dict[str, Set[str]]:
    """{private attribute: the modules it belongs to}: those that define it (see
    ``private_attributes``); for an attribute no class defines, those whose classes read it
    on self; failing that, those that assign it on some object."""
    found = {m: private_attributes(tree) for m, tree in trees.items()}
    best = {}       # name -> (level of the claim, modules): 0 defines, 1 reads on self, 2 assigns
    for level in (0, 1, 2):
        for m, sets in found.items():
            for name in sets[level]:
                if best.setdefault(name, (level, set()))[0] == level:
                    best[name][1].add(m)
    return {name: mods for name, (_, mods) in best.items()}


def module_aliases(tree: ast.Module, module: str, is_package: bool, mods) -> Dict[str, str]:
    """{local name: fxmegatron module} for the names that imports bind to modules. ``import
    a.b.c`` binds ``a`` (to the package a), ``import a.b as x`` binds x to a.b."""
    top = next(iter(mods)).split(".")[0]
    out = {}
    for node, base, names in imports(tree, module, is_package):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in mods:
                    out[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] == top:
                    out[top] = top
        else:
            for alias in node.names:
                if f"{base}.{alias.name}" in mods:
                    out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def private_reads(package_dir: str) -> List[str]:
    """Every read of another module's private name, as "module:line: what"."""
    mods = modules(package_dir)
    trees = {m: parse(p) for m, p in mods.items()}
    belongs = owners(trees)
    out = []
    for m, tree in trees.items():
        is_pkg = mods[m].endswith("__init__.py")
        aliases = module_aliases(tree, m, is_pkg, mods)

        def module_of(expr):
            """The fxmegatron module that ``expr`` (a name or a dotted chain) stands for, or None."""
            if isinstance(expr, ast.Name):
                return aliases.get(expr.id)
            if isinstance(expr, ast.Attribute):
                base = module_of(expr.value)
                if base is not None and f"{base}.{expr.attr}" in mods:
                    return f"{base}.{expr.attr}"
            return None

        for node, base, names in imports(tree, m, is_pkg):
            if isinstance(node, ast.ImportFrom) and base in mods and base != m:
                for n in names:
                    if is_private(n) and f"{base}.{n}" not in mods:
                        out.append(f"{m}:{node.lineno}: from {base} import {n}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            target = module_of(node.value)
            if target is not None:
                if target != m:
                    out.append(f"{m}:{node.lineno}: {target}.{node.attr}")
            elif node.attr in belongs and m not in belongs[node.attr]:
                what = ast.unparse(node) + (" = ..." if isinstance(node.ctx, ast.Store) else "")
                out.append(f"{m}:{node.lineno}: {what} (belongs to {', '.join(sorted(belongs[node.attr]))})")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


# ---- 3. file length ---------------------------------------------------------------------------------
def long_files(package_dir: str, limit: int = MAX_LINES) -> List[str]:
    """The files under ``package_dir`` with ``limit`` lines or more, as "path: N lines"."""
    out = []
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                n = len(fh.read().splitlines())
            if n >= limit:
                out.append(f"{os.path.relpath(path, os.path.dirname(package_dir))}: {n} lines")
    return sorted(out)


# ---- 4. layers ----------------------------------------------------------------------------------------
LAYERS = (      # bottom to top; each entry is a package (and everything under it) or a module
    ("fxmegatron.capture", "fxmegatron.codegen", "fxmegatron.kernels", "fxmegatron.ops"),
    ("fxmegatron.passes",),
    ("fxmegatron.lower",),
    ("fxmegatron.program",),
    ("fxmegatron.runtime",),
)


def layer_of(module: str, layers=LAYERS):
    """(index of ``module``'s layer, the package or module of LAYERS that holds it), or None."""
    for i, layer in enumerate(layers):
        for top in layer:
            if module == top or module.startswith(top + "."):
                return i, top
    return None


def upward_imports(package_dir: str, layers=LAYERS) -> List[str]:
    """Every import (executed or under ``TYPE_CHECKING``) of a module in a higher layer than
    the importer's, as "module:line: imports target (T is above M)", T and M the entries of
    LAYERS that hold the target and the importer."""
    mods = modules(package_dir)
    out = []
    for m, path in mods.items():
        here = layer_of(m, layers)
        if here is None:
            continue
        for node, base, names in imports(parse(path), m, path.endswith("__init__.py"), type_checking=True):
            for t in [f"{base}.{n}" if f"{base}.{n}" in mods else base for n in names] or [base]:
                there = layer_of(t, layers)
                if there is not None and there[0] > here[0]:
                    out.append(f"{m}:{node.lineno}: imports {t} ({there[1]} is above {here[1]})")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


# ---- the rules on fxmegatron/ --------------------------------------------------------------------------
def test_no_import_cycles():
    graph = import_graph(PACKAGE)
    found = [" -> ".join(c) + ("" if len(set(c)) == len(t) else f"  (the tangle: {', '.join(sorted(t))})")
             for c, t in zip(cycles(graph), tangles(graph))]
    assert not found, "import cycles:\n  " + "\n  ".join(found)


def test_no_module_reads_another_modules_private_names():
    found = private_reads(PACKAGE)
    assert not found, "private names read from another module:\n  " + "\n  ".join(found)


def test_no_file_over_the_line_limit():
    found = long_files(PACKAGE)
    assert not found, f"files of {MAX_LINES} lines or more:\n  " + "\n  ".join(found)


def test_no_import_goes_up_the_layers():
    found = upward_imports(PACKAGE)
    assert not found, "imports up the layers (tests/test_architecture.py's LAYERS):\n  " + "\n  ".join(found)


def test_every_layer_exists():
    """A renamed or removed folder would make its layer's rule vacuous."""
    mods = modules(PACKAGE)
    assert [top for layer in LAYERS for top in layer if top not in mods] == []


# ---- the checks on planted trees ------------------------------------------------------------------------
CLEAN = {
    "__init__.py": "from fxmegatron.api import parallelize\n",
    "api.py": '''
        import torch.utils._pytree as pytree        # torch's private names are not the rule's business

        from fxmegatron.ops import collectives


        class ParallelModel:
            def __init__(self):
                self._pipeline = None

            def step(self, t):
                return collectives.all_reduce(t._local_tensor, self._pipeline, self._seed)


        def parallelize():
            pm = ParallelModel()
            pm._seed = 0            # this module's own class
            return pm, pytree
        ''',
    "ops/__init__.py": "",
    "ops/collectives.py": '''
        def _group(name):
            return name


        def all_reduce(*args):
            from fxmegatron.placement import Shard      # a function-level import: an edge too
            return _group(Shard(0))
        ''',
    "placement.py": '''
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:       # not run: no edge, so no cycle placement -> api -> ops.collectives -> placement
            from fxmegatron.api import ParallelModel


        class Shard:
            def __init__(self, dim):
                self._dim = dim

            def __eq__(self, other):
                return self._dim == other._dim
        ''',
    "passes/__init__.py": "",
    "passes/split.py": '''
        from fxmegatron.ops import collectives      # down: ops sit below the passes


        def split(gm):
            return collectives.all_reduce(gm)
        ''',
    "lower/__init__.py": "",
    "lower/stages.py": '''
        from fxmegatron.passes.split import split


        class Stage:
            pass


        def build(gm):
            return Stage(), split(gm)
        ''',
    "program.py": '''
        from fxmegatron.lower.stages import Stage


        class RankProgram:
            stage: Stage
        ''',
    "runtime/__init__.py": "",
    "runtime/loop.py": '''
        def run(step):
            return step()
        ''',
    "runtime/model.py": '''
        from typing import TYPE_CHECKING

        from fxmegatron.lower.stages import build       # down: runtime runs what lower builds
        from fxmegatron.runtime.loop import run

        if TYPE_CHECKING:
            from fxmegatron.program import RankProgram


        def train(program: "RankProgram", gm):
            return run(lambda: build(gm))
        ''',
    "io/__init__.py": "",
    "io/checkpoint.py": '''
        from fxmegatron.api import ParallelModel


        class Saver:
            def __init__(self, pm: ParallelModel):
                self._pm = pm

            def params(self):
                return self._pm.parameters()
        ''',
}

PLANTED = [   # (file, code appended, the violation the checks must name: {1} is the first appended line)
    ("placement.py", "def f():\n    from fxmegatron.api import parallelize\n",
     "fxmegatron.api -> fxmegatron.ops.collectives -> fxmegatron.placement -> fxmegatron.api"),
    ("io/checkpoint.py", "from fxmegatron.ops.collectives import _group\n",
     "fxmegatron.io.checkpoint:{1}: from fxmegatron.ops.collectives import _group"),
    ("io/checkpoint.py", "from fxmegatron.ops import collectives\nx = collectives._group\n",
     "fxmegatron.io.checkpoint:{2}: fxmegatron.ops.collectives._group"),
    ("io/checkpoint.py", "import fxmegatron.ops.collectives as C\nx = C._group\n",
     "fxmegatron.io.checkpoint:{2}: fxmegatron.ops.collectives._group"),
    ("io/checkpoint.py", "import fxmegatron.ops.collectives\nx = fxmegatron.ops.collectives._group\n",
     "fxmegatron.io.checkpoint:{2}: fxmegatron.ops.collectives._group"),
    ("io/checkpoint.py", "def f(pm):\n    return pm._pipeline\n",
     "fxmegatron.io.checkpoint:{2}: pm._pipeline (belongs to fxmegatron.api)"),
    ("io/checkpoint.py", "    def seed(self):\n        return self._pm._seed\n",
     "fxmegatron.io.checkpoint:{2}: self._pm._seed (belongs to fxmegatron.api)"),
    ("io/checkpoint.py", "def f(pm):\n    pm._seed = 1\n",
     "fxmegatron.io.checkpoint:{2}: pm._seed = ... (belongs to fxmegatron.api)"),
    ("io/checkpoint.py", "class Sub(ParallelModel):\n    def f(self):\n        return self._pipeline\n",
     "fxmegatron.io.checkpoint:{3}: self._pipeline (belongs to fxmegatron.api)"),
    ("placement.py", "LONG", f"fxmegatron/placement.py: {MAX_LINES} lines"),    # up to MAX_LINES lines
    ("program.py", "from fxmegatron.runtime.loop import run\n",
     "fxmegatron.program:{1}: imports fxmegatron.runtime.loop (fxmegatron.runtime is above fxmegatron.program)"),
    ("lower/stages.py", "def f():\n    from fxmegatron.runtime import loop\n",
     "fxmegatron.lower.stages:{2}: imports fxmegatron.runtime.loop (fxmegatron.runtime is above fxmegatron.lower)"),
    ("lower/stages.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fxmegatron.program import "
     "RankProgram\n",      # not run, but a dependency all the same: no cycle reported, the layer is
     "fxmegatron.lower.stages:{3}: imports fxmegatron.program (fxmegatron.program is above fxmegatron.lower)"),
    ("passes/split.py", "from fxmegatron.runtime import loop\n",
     "fxmegatron.passes.split:{1}: imports fxmegatron.runtime.loop (fxmegatron.runtime is above "
     "fxmegatron.passes)"),
    ("ops/collectives.py", "from .. import lower\n",          # relative
     "fxmegatron.ops.collectives:{1}: imports fxmegatron.lower (fxmegatron.lower is above fxmegatron.ops)"),
]


def _tree(root, extra=None):
    """CLEAN written under root/fxmegatron, with ``extra`` = (file, code) appended; returns the
    package's path and the number of lines the file had before."""
    import textwrap
    pkg = root / "fxmegatron"
    for rel, code in CLEAN.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        code = textwrap.dedent(code).lstrip("\n")
        if extra and extra[0] == rel:
            n = len(code.splitlines())
            code += "\n" * (MAX_LINES - n) if extra[1] == "LONG" else extra[1]
            extra = (rel, n)
        path.write_text(code)
    return str(pkg), (extra[1] if extra else None)


def _all_checks(pkg):
    return ([" -> ".join(c) for c in cycles(import_graph(pkg))], private_reads(pkg), long_files(pkg),
            upward_imports(pkg))


def test_checks_pass_on_a_clean_tree(tmp_path):
    assert _all_checks(_tree(tmp_path)[0]) == ([], [], [], [])


@pytest.mark.parametrize("planted", PLANTED, ids=lambda p: p[2].split(": ")[-1][:40])
def test_checks_name_a_planted_violation(tmp_path, planted):
    pkg, n = _tree(tmp_path, planted)
    found = [v for check in _all_checks(pkg) for v in check]
    assert found == [planted[2].format(*range(n, n + 4))]
