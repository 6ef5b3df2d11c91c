"""No import cycles under zo_megatron/ and tools/ (issue 36, "no cycles, no back arrows").

The graph is built statically with ast from every module's source (nothing is imported), and
fails naming each cycle with the file:line of every import on it.

What is an edge (importer -> imported module, both under zo_megatron/ or tools/):
  * `import a.b.c` -> a.b.c; `from a.b import c` -> a.b.c when that is a module, else a.b;
  * relative imports (`from . import x`, `from ..m import y`) resolved against the importer's package;
  * in a tools/ script, `import x` / `from x import y` -> tools/x.py (a script's own directory is
    first on sys.path, which is how the tools import each other);
  * `importlib.import_module("literal")`, and, in a module that calls importlib.import_module with a
    computed name (the PEP 562 `_LAZY` table of zo_megatron/data/__init__.py), every string constant
    in it that names one of our modules.
Imports anywhere count: at module level, under `if __name__ == "__main__":`, in try/except, and inside
functions. A function-level ("lazy") import runs later, but a cycle through one is still a back arrow:
the lower module then knows about the one above it. The ALLOWED_LAZY table is where such an edge
would be tolerated, each with its reason; it is empty, and an entry whose edge is no longer on a cycle
fails the test, so the table cannot go stale.
Not counted: the implicit import of parent packages (`import a.b.c` runs a/__init__ and a/b/__init__
first). Counting them would put every package that re-exports a submodule on a cycle with it although
Python's order there is fixed and safe; an explicit `from a import x` inside a/ IS counted (edge to a).
"""
from __future__ import annotations

import ast
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("zo_megatron", "tools")

# (importer, imported) -> reason: a function-level import tolerated on a cycle. Keep it empty.
ALLOWED_LAZY: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    path: str
    line: int
    lazy: bool      # inside a function body: runs when called, not when the module is imported

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({self.path}:{self.line}{', in a function' if self.lazy else ''})"


def find_modules(root: Path, tops=TOPS) -> dict[str, Path]:
    """Dotted name -> file for every .py under the given top-level directories."""
    mods = {}
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    parts = list((Path(dirpath) / f).relative_to(root).with_suffix("").parts)
                    if parts[-1] == "__init__":
                        parts.pop()
                    mods[".".join(parts)] = Path(dirpath) / f
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


class _Visitor(ast.NodeVisitor):
    def __init__(self, name: str, path: Path, mods: dict[str, Path], rel: str):
        self.name, self.path, self.mods, self.rel = name, path, mods, rel
        self.package = name if _is_package(path) else name.rpartition(".")[0]
        self.depth = 0          # function nesting
        self.edges: list[Edge] = []
        self.dynamic = False    # calls importlib.import_module(<computed>)
        self.strings: list[tuple[str, int, bool]] = []

    def _resolve(self, dotted: str | None) -> str | None:
        """The deepest of our modules that `dotted` names (a.b.c, else a.b, else a), or None."""
        if not dotted:
            return None
        candidates = (["tools." + dotted] if self.name.startswith("tools.") else []) + [dotted]
        for cand in candidates:         # a tools/ script's own directory is first on sys.path
            parts = cand.split(".")
            for i in range(len(parts), 0, -1):
                if ".".join(parts[:i]) in self.mods:
                    return ".".join(parts[:i])
        return None

    def _add(self, target: str | None, node: ast.AST) -> None:
        if target is not None and target != self.name:
            self.edges.append(Edge(self.name, target, self.rel, node.lineno, self.depth > 0))

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(self._resolve(alias.name), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.package.split(".") if self.package else []
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module
        for alias in node.names:
            # `from a import b`: the submodule a.b when there is one, else (a name in a) a itself
            sub = self._resolve(f"{base}.{alias.name}") if alias.name != "*" else None
            self._add(sub or self._resolve(base), node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                (isinstance(f, ast.Name) and f.id in ("import_module", "__import__")):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                self._add(self._resolve(node.args[0].value), node)
            else:
                self.dynamic = True
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and node.value in self.mods:
            self.strings.append((node.value, node.lineno, self.depth > 0))


def build_graph(root: Path = ROOT, tops=TOPS) -> dict[str, list[Edge]]:
    mods = find_modules(root, tops)
    graph: dict[str, list[Edge]] = {m: [] for m in mods}
    for name, path in mods.items():
        rel = str(path.relative_to(root))
        v = _Visitor(name, path, mods, rel)
        v.visit(ast.parse(path.read_text(), filename=rel))
        if v.dynamic:   # names a computed import_module may load: lazy edges (when it runs is unknown)
            v.edges += [Edge(name, s, rel, line, True) for s, line, _ in v.strings if s != name]
        graph[name] = v.edges
    return graph


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's SCCs that hold a cycle (two or more modules, or one that imports itself)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for e in graph.get(v, ()):
            w = e.dst
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or any(e.dst == v for e in graph.get(v, ())):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def a_cycle(graph: dict[str, list[Edge]], comp: list[str]) -> list[Edge]:
    """One shortest cycle through the first module of a strongly connected component, as edges."""
    members, start = set(comp), comp[0]
    prev: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for e in sorted(graph[v], key=lambda e: (e.dst, e.line)):
            if e.dst not in members:
                continue
            if e.dst == start:
                path = [e]
                while path[0].src != start:
                    path.insert(0, prev[path[0].src])
                return path
            if e.dst not in prev:
                prev[e.dst] = e
                queue.append(e.dst)
    raise AssertionError(f"no cycle through {start}")


def cycle_report(graph: dict[str, list[Edge]]) -> list[str]:
    """One paragraph per import cycle, naming it and every import on it; empty when there is none."""
    allowed = {(s, d) for s, d in ALLOWED_LAZY}
    pruned = {v: [e for e in es if not (e.lazy and (e.src, e.dst) in allowed)] for v, es in graph.items()}
    out = []
    for comp in strongly_connected(pruned):
        cyc = a_cycle(pruned, comp)
        names = " -> ".join([e.src for e in cyc] + [cyc[0].src])
        out.append(f"import cycle {names} (component: {', '.join(comp)}):\n    " + "\n    ".join(map(str, cyc)))
    return out


def test_no_import_cycles():
    graph = build_graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100, "the scan found too little to be right"
    report = cycle_report(graph)
    assert not report, "back arrows: break each cycle (move what both sides need into a lower module)\n" + \
        "\n".join(report)


def test_allowed_lazy_entries_are_live():
    """Every allow-listed edge exists, is a function-level import, and is on a cycle without the allowance."""
    graph = build_graph()
    on_cycle = {m for comp in strongly_connected(graph) for m in comp}
    for (src, dst), reason in ALLOWED_LAZY.items():
        assert reason.strip(), f"{src} -> {dst}: give the reason"
        edges = [e for e in graph.get(src, ()) if e.dst == dst]
        assert edges and all(e.lazy for e in edges), f"{src} -> {dst}: no such function-level import; drop it"
        assert src in on_cycle and dst in on_cycle, f"{src} -> {dst} is on no cycle any more; drop it"


# The argument modules, lowest first: each may import those before it, none one after it (not even
# in a function). megatron_flag_list is generated data; the doc writer sits on top.
ARGUMENT_CHAIN = ["zo_megatron.training.megatron_flag_list", "zo_megatron.training.megatron_flags",
                  "zo_megatron.training.megatron_compat", "zo_megatron.training.arguments",
                  "zo_megatron.training.megatron_doc"]


def test_argument_modules_are_a_one_way_chain():
    graph = build_graph()
    back = [str(e) for i, m in enumerate(ARGUMENT_CHAIN) for e in graph.get(m, ()) if e.dst in ARGUMENT_CHAIN[i + 1:]]
    assert not back, "the flag tables are data the parser reads, not modules that import it:\n" + "\n".join(back)
    assert not graph[ARGUMENT_CHAIN[0]], f"the generated flag list imports nothing: {graph[ARGUMENT_CHAIN[0]]}"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_detector_sees_every_import_form(tmp_path):
    """Each import form closes a cycle in a small tree, and the report names it."""
    forms = {
        "plain import": {"zo_megatron/a.py": "import zo_megatron.b\n",
                         "zo_megatron/b.py": "import zo_megatron.a as a\n"},
        "from-import of a name": {"zo_megatron/a.py": "from zo_megatron.b import f\n",
                                  "zo_megatron/b.py": "from zo_megatron.a import g\n"},
        "from-import of a submodule": {"zo_megatron/p/__init__.py": "", "zo_megatron/p/a.py": "from zo_megatron.p import b\n",
                                       "zo_megatron/p/b.py": "from zo_megatron import p\nfrom zo_megatron.p import a\n"},
        "relative imports": {"zo_megatron/p/__init__.py": "", "zo_megatron/p/a.py": "from . import b\n",
                             "zo_megatron/p/q/__init__.py": "", "zo_megatron/p/q/c.py": "from ..a import x\n",
                             "zo_megatron/p/b.py": "from .q.c import y\n"},
        "package re-export used by its submodule": {"zo_megatron/p/__init__.py": "from zo_megatron.p.a import f\n",
                                                    "zo_megatron/p/a.py": "from zo_megatron.p import g\n"},
        "function-level import": {"zo_megatron/a.py": "import zo_megatron.b\n",
                                  "zo_megatron/b.py": "def f():\n    from zo_megatron.a import g\n    return g\n"},
        "__main__ block": {"zo_megatron/a.py": "from zo_megatron.b import f\n",
                           "zo_megatron/b.py": "if __name__ == '__main__':\n    from zo_megatron.a import g\n"},
        "tools sibling scripts": {"tools/x.py": "def f():\n    import y\n",
                                  "tools/y.py": "import sys\nif True:\n    from x import f\n"},
        "importlib with a literal": {"zo_megatron/a.py": "import zo_megatron.b\n",
                                     "zo_megatron/b.py": "import importlib\nm = importlib.import_module('zo_megatron.a')\n"},
        "lazy table": {"zo_megatron/p/__init__.py": "import importlib\n_LAZY = {'f': 'zo_megatron.p.a'}\n"
                                                    "def __getattr__(n):\n    return importlib.import_module(_LAZY[n])\n",
                       "zo_megatron/p/a.py": "from zo_megatron.p import g\n"},
    }
    for i, (form, files) in enumerate(forms.items()):
        root = tmp_path / str(i)
        _write(root, {"zo_megatron/__init__.py": "", **files})
        report = cycle_report(build_graph(root))
        assert len(report) == 1 and "import cycle" in report[0], f"{form}: {report}"
    acyclic = tmp_path / "acyclic"
    _write(acyclic, {"zo_megatron/__init__.py": "", "zo_megatron/p/__init__.py": "from zo_megatron.p.a import f\n",
                     "zo_megatron/p/a.py": "from zo_megatron.p.b import g\nimport os\n",
                     "zo_megatron/p/b.py": "from . import c\n", "zo_megatron/p/c.py": "import zo_megatron\n",
                     "tools/x.py": "import y\nimport zo_megatron.p.a\n", "tools/y.py": "from zo_megatron.p import c\n"})
    assert cycle_report(build_graph(acyclic)) == []
