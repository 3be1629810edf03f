"""The house stays: the package's import drawing has no circle and at most three imports running back up.

Before: nothing (the modules are parsed with ``ast``, not imported, for the drawing).
Under test: every module under ``weightshare/``: its imports (module level, inside functions, under
``TYPE_CHECKING``, ``from . import x``) against the layers below; the private/public boundary, with every module
imported (as onnx_ir's public-API test walks its package).
After: nothing written.

``python tests/test_layering.py [ROOT]`` prints the drawing (floors, layers, upward imports, circles) of the tree at
ROOT (default: this checkout).
"""

from __future__ import annotations

import ast
import functools
import importlib
import pkgutil
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORMAT_FOLDERS = tuple(sorted(p.parent.name for p in (ROOT / "weightshare" / "formats").glob("*/__init__.py")))

# The layers, top first. A module may import its own layer and any layer below; an import of a layer above is an
# upward import (at most MAX_UPWARD, each named when there are more). Every module must match one pattern.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("entry point", ("weightshare.__main__", "weightshare.cli", "weightshare.cli.*")),
    ("machine documents", ("weightshare._contract",)),
    ("commands over the public functions", ("weightshare._bench", "weightshare._demo")),
    ("public functions", ("weightshare", "weightshare.api")),
    (
        "drivers",
        (
            "weightshare._convert_api",
            "weightshare._folder",
            "weightshare._run",
            "weightshare._zoo_api",
            "weightshare._inspect_api",
            "weightshare._samples",
        ),
    ),
    (
        "over the registry",
        ("weightshare._gate", "weightshare._check", "weightshare._dispatch", "weightshare._format_options"),
    ),
    # children started by name from a format's measuring code (never imported by it): they open a model through a
    # loader, so they sit above the loaders and the formats
    ("measuring through the loaders", ("weightshare._loader_probes",)),
    (
        "loaders",
        (
            "weightshare.ort",
            "weightshare.litert",
            "weightshare._litert_interpreter",
            "weightshare.genai",
            "weightshare.executorch",
        ),
    ),
    ("registry", ("weightshare.formats",)),
    ("format folders", ("weightshare.formats.*.*", *(f"weightshare.formats.{f}" for f in FORMAT_FOLDERS))),
    ("format protocol", ("weightshare.formats.base",)),
    # sessions, interpreters and process memory: told the format's facts (index bounds) by their callers
    ("the runtimes the formats drive", ("weightshare._runtimes", "weightshare._runtimes.*")),
    (
        "report models and shared machinery",
        (
            "weightshare.options",
            "weightshare._option_keywords",
            "weightshare.report",
            "weightshare._inventory",
            "weightshare._paid",
            "weightshare._verify",
            "weightshare._pipeline",
            "weightshare._outputs_record",
            "weightshare._replacement",
            "weightshare._recorded",
            "weightshare._safetensors",
            "weightshare._write",
            "weightshare._container",
            "weightshare._atomic",
            "weightshare._stale",
            "weightshare._placement",
            "weightshare._disk",
            "weightshare._compare",
            "weightshare._flatbuffers",
            "weightshare._measure_cache",
        ),
    ),
    (
        "ground floor",
        (
            "weightshare._tensors",
            "weightshare._inputs",
            "weightshare._checksum",
            "weightshare._paths",
            "weightshare._platform",
            "weightshare._private_cache",
            "weightshare._findings",
            "weightshare.errors",
            "weightshare._version",
        ),
    ),
]
MAX_UPWARD = 3

# The rooms: each top-level module or package under weightshare/ (``_runtimes``, ``cli``, ``_check``, ...), and
# each format's folder on its own (``formats.onnx``, ``formats.tflite``, ...; ``formats`` itself is the registry
# and the protocol, ``formats/__init__`` and ``formats/base``). Modules of one room may import each other in any
# order; between rooms the drawing has no circle at all (not even through an upward import), and the runtimes'
# room imports no format and no loader.
RUNTIMES_ROOM = "weightshare._runtimes"

# Modules no other module imports that are still part of the product: entry points, the public surface, and
# modules started as children by name (found as string literals in the package, see ``started_by_name``).
ENTRY_POINTS = frozenset({"weightshare", "weightshare.__main__", "weightshare.cli"})


def room_of(name: str) -> str:
    """The room of a module: ``weightshare.X`` for a top-level module or package X, ``weightshare.formats.F`` for a
    module of a format's folder F."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[1] == "formats" and parts[2] in FORMAT_FOLDERS:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def room_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """room -> {room it imports: the first such import, ``importer:line -> imported``}."""
    rooms: dict[str, dict[str, str]] = {room_of(m): {} for m in graph}
    for a in sorted(graph):
        for b, line in sorted(graph[a].items()):
            if room_of(a) != room_of(b):
                rooms[room_of(a)].setdefault(room_of(b), f"{a}:{line} -> {b}")
    return rooms


def loaders() -> tuple[str, ...]:
    return next(patterns for title, patterns in LAYERS if title == "loaders")


def runtimes_reaching_up(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import by a module of the runtimes' room of a format (the registry, the protocol, a format's folder)
    or of a loader, as ``importer:line -> imported``."""
    return [
        f"{a}:{line} -> {b}"
        for a in sorted(graph)
        if room_of(a) == RUNTIMES_ROOM
        for b, line in sorted(graph[a].items())
        if b.split(".")[:2] == ["weightshare", "formats"] or any(fnmatchcase(b, p) for p in loaders())
    ]


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every ``.py`` file under ``root/weightshare``."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted((root / "weightshare").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, name: str, package: bool, known: dict[str, tuple[Path, bool]]
) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "weightshare"]
    if node.level:
        base = name.split(".") if package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    elif node.module and node.module.split(".")[0] == "weightshare":
        target = node.module
    else:
        return []
    # ``from P import x``: the submodule P.x when there is one, else P itself
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """importer -> {imported module: line of the first such import}, every import statement anywhere counted."""
    known = modules(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in known}
    for name, (path, package) in known.items():
        for node in ast.walk(_tree(path)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, name, package, known):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def edges(v: str) -> list[str]:
        return list(graph[v])

    def visit(v: str) -> None:  # iterative: no recursion limit on a long chain
        work = [(v, iter(edges(v)))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges(w))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def layer_of(name: str) -> int | None:
    """Index in ``LAYERS`` (0 = top) of the first layer with a pattern matching ``name``."""
    for i, (_title, patterns) in enumerate(LAYERS):
        if any(fnmatchcase(name, p) for p in patterns):
            return i
    return None


def upward(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a layer above the importer's, as ``importer:line -> imported (layer -> layer)``."""
    found = []
    for a in sorted(graph):
        for b, line in sorted(graph[a].items()):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb < la:
                found.append(f"{a}:{line} -> {b} ({LAYERS[la][0]} -> {LAYERS[lb][0]})")
    return found


def floors(graph: dict[str, dict[str, int]]) -> int:
    """How many floors the drawing has: the longest import chain, each circle counted as one room."""
    group = {m: m for m in graph}
    for c in circles(graph):
        for m in c:
            group[m] = c[0]
    dag: dict[str, set[str]] = {}
    for a, bs in graph.items():
        dag.setdefault(group[a], set()).update(group[b] for b in bs if group[b] != group[a])
    height: dict[str, int] = {}

    def h(v: str) -> int:
        if v not in height:
            height[v] = 0  # no circle is left in the condensed graph
            height[v] = 1 + max((h(w) for w in dag.get(v, ())), default=0)
        return height[v]

    return max(h(v) for v in dag)


def started_by_name(root: Path = ROOT) -> set[str]:
    """Modules the package names in a string literal (``python -m weightshare.x.y``, ``in_child(__name__, ...)``
    resolves to the module itself): run as children rather than imported."""
    names: set[str] = set()
    known = modules(root)
    for name, (path, _package) in known.items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                names.add(node.value)
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "in_child"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "__name__"
            ):
                names.add(name)
    return names


def public(name: str) -> bool:
    """Not private by name, and not inside a format's folder (internal as a whole, as ``formats`` states)."""
    from weightshare import formats

    parts = name.split(".")
    if any(p.startswith("_") for p in parts):
        return False
    return not (len(parts) > 2 and parts[1] == "formats" and parts[2] in formats._BUILTIN)


# --- the tests ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    missing = sorted(m for m in graph if layer_of(m) is None)
    assert not missing, f"modules in no layer of tests/test_layering.py's LAYERS: {', '.join(missing)}"


def test_no_import_circle(graph):
    found = circles(graph)
    lines = []
    for c in found:
        members = set(c)
        lines.append(
            " <-> ".join(c)
            + ": "
            + "; ".join(f"{a}:{line} -> {b}" for a in c for b, line in sorted(graph[a].items()) if b in members)
        )
    assert not found, "import circles:\n" + "\n".join(lines)


def test_no_circle_between_rooms(graph):
    """No room imports, even through other rooms, a room that imports it (``room_of``): the import circles
    inside one room are left to ``test_no_import_circle``."""
    rooms = room_graph(graph)
    found = circles({r: dict.fromkeys(bs, 0) for r, bs in rooms.items()})
    lines = [
        " <-> ".join(c) + ": " + "; ".join(rooms[a][b] for a in c for b in sorted(rooms[a]) if b in c) for c in found
    ]
    assert not found, "circles between rooms:\n" + "\n".join(lines)


def test_the_runtimes_import_no_format_and_no_loader(graph):
    """``_runtimes/`` drives ONNX Runtime and LiteRT with what its callers tell it of the model (index bounds, the
    buffers an instance owns): the format's reading lives in the format's folder, measuring through a loader above
    the loaders (``_loader_probes``)."""
    assert RUNTIMES_ROOM in {room_of(m) for m in graph}
    found = runtimes_reaching_up(graph)
    assert not found, "the runtimes import a format or a loader:\n" + "\n".join(found)


def test_at_most_three_upward_imports(graph):
    found = upward(graph)
    assert len(found) <= MAX_UPWARD, f"{len(found)} upward imports (at most {MAX_UPWARD}):\n" + "\n".join(found)


def test_public_modules_declare_all_and_format_folders_are_internal():
    """Every importable module imports; a public one (no ``_`` in its path, not inside a format's folder) has
    ``__all__`` naming what it defines or re-exports; ``formats`` states its folders are internal."""
    import weightshare
    from weightshare import formats

    assert "internal" in (formats.__doc__ or "") and "_BUILTIN" in (formats.__doc__ or "")
    assert set(formats._BUILTIN) == {
        p.name for p in (ROOT / "weightshare" / "formats").iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    without_all, bad_names = [], []
    names = ["weightshare"] + [m.name for m in pkgutil.walk_packages(weightshare.__path__, "weightshare.")]
    for name in names:
        if name == "weightshare.__main__":
            continue  # runs the command on import
        module = importlib.import_module(name)
        if not public(name):
            continue
        exported = getattr(module, "__all__", None)
        if exported is None:
            without_all.append(name)
            continue
        bad_names += [f"{name}.{n}" for n in exported if not hasattr(module, n)]  # lazy names (__getattr__) too
    assert sorted(set(names)) == sorted(set(modules())), "pkgutil and the file walk disagree"
    assert not without_all, f"public modules without __all__: {', '.join(without_all)}"
    assert not bad_names, f"__all__ names nothing: {', '.join(bad_names)}"


def test_no_module_is_imported_only_by_tests_or_scripts(graph):
    """Each module is imported by another (a package counts as imported with any of its modules; the format
    folders are imported by the registry by name, ``formats._BUILTIN``), is an entry point or a public module, or
    is run as a child by name."""
    from weightshare import formats

    imported = {b for bs in graph.values() for b in bs} | {f"weightshare.formats.{n}" for n in formats._BUILTIN}
    imported |= {m.rsplit(".", k)[0] for m in imported for k in range(1, m.count(".") + 1)}
    children = started_by_name()
    orphans = sorted(
        m for m in graph if m not in imported and m not in ENTRY_POINTS and m not in children and not public(m)
    )
    assert not orphans, f"modules no module of the package imports (tests or scripts only): {', '.join(orphans)}"


def _drawing(root: Path) -> str:
    g = import_graph(root)
    up = upward(g)
    found = circles(g)
    rooms = room_graph(g)
    between = circles({r: dict.fromkeys(bs, 0) for r, bs in rooms.items()})
    reaching = runtimes_reaching_up(g)
    lines = [
        f"{root}: {len(g)} modules, {sum(map(len, g.values()))} imports, {floors(g)} floors, "
        f"{len(LAYERS)} layers, {len(up)} upward imports, {len(found)} circles; {len(rooms)} rooms, "
        f"{len(between)} circles between rooms, {len(reaching)} imports of a format or a loader by the runtimes"
    ]
    lines += [f"  upward: {u}" for u in up]
    lines += [f"  circle: {' <-> '.join(c)}" for c in found]
    lines += [f"  circle between rooms: {' <-> '.join(c)}" for c in between]
    lines += [f"  runtimes reach up: {u}" for u in reaching]
    lines += [f"  no layer: {m}" for m in sorted(g) if layer_of(m) is None]
    return "\n".join(lines)


if __name__ == "__main__":
    print(_drawing(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))
