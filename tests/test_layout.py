"""The package's layout, read from its source with `ast`: imports run one way (no cycles, imports
inside functions included), model.py imports only the model's own modules, and no function
runs past 60 lines unless it is a data table on the allowlist below.

The graph builder is tested on small synthetic packages first, so a builder that misses an
edge (and so hides a cycle) fails here rather than passing silently."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .support import REPO

PACKAGE = REPO / "src" / "glassformer"
MAX_LINES = 60

# What model.py may import inside the package (besides the subpackage modules of attention).
MODEL_MAY_IMPORT = {"glassformer.config", "glassformer.attention", "glassformer.kv_cache", "glassformer.probes",
                    "glassformer.moe", "glassformer.norms", "glassformer.rope_scaling"}  # the families' parts beside it

# Functions allowed past MAX_LINES: data tables only, each with why. "module.function": reason.
LONG_ALLOWED: dict[str, str] = {}


# ----------------------------------------------------------------------------- reading the source


def modules_of(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package folder `root` (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _base(module: str, is_package: bool, level: int) -> str:
    """The package a relative import of `level` dots starts from, inside `module`.

    >>> _base("p.a.b", False, 1), _base("p.a.b", False, 2), _base("p.a", True, 1)
    ('p.a', 'p', 'p.a')
    """
    parts = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(parts[: len(parts) - (level - 1)])


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `module` imports anywhere in its file (functions included).

    `from X import name` is an edge to X.name when that is a module, else to X; so
    `from . import x` names the module x, not the package that holds it."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node.level) if node.level else ""
            src = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                found.add(f"{src}.{alias.name}" if f"{src}.{alias.name}" in known else src)
            if node.module is None:  # `from . import x`: Python runs the package's __init__ first, an edge to it too
                found.add(src)
    return {m for m in found if m in known and m != module}


def import_graph(root: Path) -> dict[str, set[str]]:
    mods = modules_of(root)
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is at most the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def long_functions(root: Path, limit: int = MAX_LINES) -> dict[str, int]:
    """"module.function" (methods "module.Class.method") -> lines, for every def longer than limit."""
    out = {}
    for module, path in modules_of(root).items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        todo = [(module, node) for node in tree.body]
        while todo:
            prefix, node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{node.name}"
                if not isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                    out[name] = node.end_lineno - node.lineno + 1
                todo += [(name, child) for child in ast.iter_child_nodes(node)]
            else:
                todo += [(prefix, child) for child in ast.iter_child_nodes(node)]
    return out


# ----------------------------------------------------------------------------- the builder, on synthetic packages


def make_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_builder_finds_a_cycle_hidden_in_a_function(tmp_path):
    root = make_package(tmp_path, {
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from .c import g\n    return g\n",
        "c.py": "import pkg.a\n",
        "d.py": "from .a import f\n",  # reaches the cycle but is not in it
    })
    assert cycles(import_graph(root)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_builder_resolves_relative_imports(tmp_path):
    root = make_package(tmp_path, {
        "sub/__init__.py": "from .x import X\n",
        "sub/x.py": "from .. import top\nfrom . import y\nfrom ..sub import z as zz\nX = 1\n",
        "sub/y.py": "",
        "sub/z.py": "from ...outside import nothing\n",  # beyond the package: no edge, no crash
        "top.py": "from .sub.x import X\n",
    })
    g = import_graph(root)
    # modules by name, and the package a bare `from .. import` / `from . import` runs first
    assert g["pkg.sub.x"] == {"pkg", "pkg.sub", "pkg.top", "pkg.sub.y", "pkg.sub.z"}
    assert g["pkg.sub"] == {"pkg.sub.x"}
    assert g["pkg.top"] == {"pkg.sub.x"}
    assert cycles(g) == [["pkg.sub", "pkg.sub.x", "pkg.top"]]  # `from . import y` in sub.x runs sub's __init__


def test_from_dot_import_of_a_name_is_an_edge_to_the_package(tmp_path):
    root = make_package(tmp_path, {"__init__.py": "from .a import f\nVALUE = 1\n", "a.py": "from . import VALUE\n"})
    assert cycles(import_graph(root)) == [["pkg", "pkg.a"]]


def test_long_functions_are_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))  # def line + 60 = 61 lines
    root = make_package(tmp_path, {"m.py": f"def long():\n{body}\n\nclass C:\n    def method(self):\n{body.replace('    ', '        ')}"
                                   f"\ndef short():\n    return 1\n"})
    assert long_functions(root) == {"pkg.m.long": MAX_LINES + 1, "pkg.m.C.method": MAX_LINES + 1}


# ----------------------------------------------------------------------------- the package itself


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_the_builder_sees_the_package(graph):
    assert "glassformer.config" in graph["glassformer.model"]  # a top-level import
    assert "glassformer.checkpoint.loading" in graph["glassformer"]


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that reach each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_model_imports_only_the_model(graph):
    extra = sorted(m for m in graph["glassformer.model"]
                   if m not in MODEL_MAY_IMPORT and not m.startswith("glassformer.attention."))
    assert not extra, f"model.py imports {extra}; it may import only {sorted(MODEL_MAY_IMPORT)} (and attention's modules)"


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start` can run (its imports, theirs, ...)."""
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


# What model.py must not hold: speed machinery belongs to glassformer.speed (docs/architecture.md).
MODEL_FORBIDS = ("torch.ops", "torch._", "is_compiling", "is_grad_enabled", "get_num_threads", "_forward_hooks",
                 "_forward_pre_hooks", "_global_", "mkldnn", "ctypes", "subprocess", "cpp_extension", "bench/")
MODEL_MAX_LINES = 400  # the architecture a learner reads in one sitting (nanoGPT's model.py: ~330 lines)


def test_model_is_the_architecture_alone():
    text = (PACKAGE / "model.py").read_text(encoding="utf-8")
    found = [name for name in MODEL_FORBIDS if name in text]
    assert not found, f"model.py holds {found}: speed is put on from outside (glassformer.speed)"
    lines = text.count("\n")
    assert lines <= MODEL_MAX_LINES, f"model.py has {lines} lines; keep it at most {MODEL_MAX_LINES}"
    tree = ast.parse(text)
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and not n.attr.startswith("__") and n.attr not in ("_apply", "_positions", "_show_scores")]
    assert not private, f"model.py reads private names {sorted(set(private))}"


def test_no_native_code_is_built_at_run_time():
    """No C/C++ source ships in the package and nothing in it calls a compiler (train/cpu_memory.py's
    ctypes call into the system's glibc builds nothing)."""
    assert not [p for p in PACKAGE.rglob("*") if p.suffix in (".c", ".cc", ".cpp", ".cu", ".h")]
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for name in ("cpp_extension", "load_inline", "-march", "-fopenmp", '"c++"', '"g++"', '"gcc"', '"clang'):
            assert name not in text, f"{path.relative_to(PACKAGE)} uses {name}"


def test_reach_follows_imports_of_imports():
    g = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert reach(g, "a") == {"b", "c"} and reach(g, "c") == set()


def test_the_model_reaches_nothing_above_it(graph):
    # Through its imports too: the model sits at the bottom, under text/, checkpoint/, ...
    bottom = MODEL_MAY_IMPORT | {"glassformer.errors", "glassformer.files"}
    above = sorted(m for m in reach(graph, "glassformer.model")
                   if m not in bottom and not m.startswith("glassformer.attention."))
    who = {m: sorted(k for k in reach(graph, "glassformer.model") | {"glassformer.model"} if m in graph[k]) for m in above}
    assert not above, f"importing model.py runs modules above the model: {who} (module: who imports it)"


def test_functions_stay_short():
    found = long_functions(PACKAGE)
    too_long = {k: v for k, v in found.items() if k not in LONG_ALLOWED}
    assert not too_long, f"functions over {MAX_LINES} lines (name their phases as functions): " + ", ".join(
        f"{k} ({v})" for k, v in sorted(too_long.items(), key=lambda kv: -kv[1]))
    stale = sorted(set(LONG_ALLOWED) - set(found))
    assert not stale, f"allowlisted functions that are no longer long (or gone): {stale}; remove them from LONG_ALLOWED"
