"""The import structure stays one shape: no cycles, no upward imports, formats apart.

Every ``import`` in ``ckpt_tool`` (module level and inside functions) is read with ``ast``.
Layers, lowest first: the base modules (``errors``, ``model``, ...), ``planning``, ``formats``,
``dist_checkpointing``, ``ops``, ``cli``; a module may import its own layer and lower ones. A
format package (``formats/<name>/``) imports no other format package: what two formats share
lives in ``formats/containers/`` (the codecs, by what they decode), which imports no format
package, or in the few modules directly under ``formats/`` (the contracts, the registry, the
write guard). A command package (``ops/<command>/``) is used through its ``__init__`` only:
no module outside it imports one of its helpers.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ckpt_tool"
LAYERS = {"planning": 1, "formats": 2, "dist_checkpointing": 3, "ops": 4, "cli": 5}
FORMAT_PACKAGES = sorted(p.name for p in (PKG / "formats").iterdir()
                         if (p / "__init__.py").is_file() and p.name != "containers")
COMMAND_PACKAGES = sorted(p.name for p in (PKG / "ops").iterdir() if (p / "__init__.py").is_file())
FORMATS_ROOT_MAX = 8  # the contracts, the registry, the write guard and what detection reads


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level
                                         + (path.name == "__init__.py")]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {n: _imports(n, p, modules) for n, p in modules.items()}


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else ""
    if top == "__main__":  # ``python -m ckpt_tool``: the command line
        top = "cli"
    return top, LAYERS.get(top, 0)


def test_the_analysis_sees_the_packages():
    graph = _graph()
    assert "ckpt_tool.formats.mcore_dist.reader" in graph
    assert "ckpt_tool.formats.base" in graph["ckpt_tool.formats.mcore_dist.reader"]
    assert set(FORMAT_PACKAGES) >= {"mcore_dist", "dcp", "legacy", "torch_save", "safetensors"}
    assert set(COMMAND_PACKAGES) == {"inspect", "validate", "diff", "convert", "reshard"}


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_no_upward_imports():
    upward = [(a, b) for a, deps in _graph().items() for b in deps
              if _layer(b)[1] > _layer(a)[1]]
    assert upward == []


def test_a_format_package_imports_no_other_format_package():
    crossing = []
    for a, deps in _graph().items():
        pa = a.split(".")[2] if a.startswith("ckpt_tool.formats.") else None
        for b in deps:
            pb = b.split(".")[2] if b.startswith("ckpt_tool.formats.") else None
            if pa in FORMAT_PACKAGES and pb in FORMAT_PACKAGES and pa != pb:
                crossing.append((a, b))
    assert crossing == []


def test_the_formats_root_holds_few_modules():
    """What formats share sits in ``formats/containers/``; the root keeps the contracts."""
    root = sorted(p.name for p in (PKG / "formats").glob("*.py"))
    assert len(root) <= FORMATS_ROOT_MAX, root


def test_containers_import_no_format_package():
    found = [(a, b) for a, deps in _graph().items()
             if a.startswith("ckpt_tool.formats.containers.") or a == "ckpt_tool.formats.containers"
             for b in deps
             if b.startswith("ckpt_tool.formats.") and b.split(".")[2] in FORMAT_PACKAGES]
    assert found == []


def test_a_command_package_is_used_through_its_init():
    """``from ckpt_tool.ops.convert import convert, ConvertOptions``: a command's helpers
    (``ops/<command>/_*.py``) are imported by that command's own modules only."""
    reaching = []
    for a, deps in _graph().items():
        for b in deps:
            parts = b.split(".")
            if len(parts) > 3 and parts[:2] == ["ckpt_tool", "ops"] and parts[2] in COMMAND_PACKAGES \
                    and not a.startswith(f"ckpt_tool.ops.{parts[2]}.") \
                    and a != f"ckpt_tool.ops.{parts[2]}":
                reaching.append((a, b))
    assert reaching == []


def test_test_modules_have_unique_basenames():
    """The tests' folders are not packages: pytest imports each test module by its basename,
    and two modules of one name stop the whole run at collection."""
    names: dict[str, list[str]] = {}
    for path in (PKG.parent / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(PKG.parent)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}


def _format_names() -> set[str]:
    """The registered names of source formats (``formats.base.formats``) and of target
    formats (``formats.writer.WRITERS``)."""
    from ckpt_tool.formats.base import formats
    from ckpt_tool.formats.writer import WRITERS

    return set(formats()) | set(WRITERS)


def _format_name_tests(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``, ``match`` cases) of a format name
    given as a string, and collections of two or more format names (what ``in`` tests or
    lookups then ask)."""

    def named(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [n for e in node.elts for n in named(e)]
        return []

    found: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hits = [n for side in (node.left, *node.comparators) for n in named(side)]
        elif isinstance(node, ast.MatchValue):
            hits = named(node.value)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            hits = named(node) if len(named(node)) > 1 else []
        elif isinstance(node, ast.Dict):
            keys = [n for k in node.keys if k is not None for n in named(k)]
            hits = keys if len(keys) > 1 else []
        else:
            continue
        if hits:
            found.setdefault(node.lineno, ", ".join(hits))
    return sorted(found.items())


def test_ops_tests_no_format_name():
    """``ops`` asks the contracts what a format can do (``Reader``'s capabilities, ``Writer``'s
    class attributes through ``writer_for``, ``CheckpointMeta.kind``/``FormatKind``), never
    compares a format's name: a new format then declares its facts in one place."""
    names = _format_names()
    found = [f"{path.relative_to(PKG.parent)}:{line}: {hit}"
             for path in sorted((PKG / "ops").rglob("*.py"))
             for line, hit in _format_name_tests(ast.parse(path.read_text()), names)]
    assert found == []


def test_the_format_name_check_sees_comparisons():
    names = {"torch_dist", "legacy", "safetensors"}
    source = '''
to == "legacy"
"safetensors" != options.to
to in ("torch_dist", "legacy")
_TARGETS = {"torch_dist", "safetensors"}
_FLAGS = {"torch_dist": 1, "legacy": 2}
match to:
    case "legacy": pass
ok = to == "other" or stacked_view(reader, "torch_dist") or to in TARGETS
format_name = "legacy"
'''
    assert [line for line, _ in _format_name_tests(ast.parse(source), names)] == \
        [2, 3, 4, 5, 6, 8]
