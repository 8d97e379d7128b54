"""The package's layering (docs/design.md): the folders are the layers and each imports only
the ones below it, no import cycles anywhere (no back-reference, even one for typing), and the
product (``diloco_lightning.app``) depends on the library, never the other way. Read from the source
(every import, at module level or inside a function, ``TYPE_CHECKING`` ones included), so a new
edge fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import diloco_lightning

PACKAGE = Path(diloco_lightning.__file__).resolve().parent
#: modules that only keep an old command's name working (``python -m diloco_lightning.summarize``)
SHIMS = {"diloco_lightning.summarize"}

#: the layers, lowest first; a module may import its own package and the layers below its own,
#: never a peer of its rank (``master`` and ``worker`` never import each other) nor a layer above
LAYERS: list[set[str]] = [
    {"util"},
    {"encoding", "outer", "models", "data"},  # torch only: the encodings, the outer optimizers, the product's model
    {"wire"},
    {"hub"},
    {"master", "worker"},
    {"sim"},
    {"adapters"},
    {"app"},
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _graph(type_checking: bool = False) -> dict[str, set[str]]:
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name or None

    def nodes(tree: ast.AST):
        """Every node, except what sits under ``if TYPE_CHECKING:`` (annotations, never imported at run time)."""
        for node in ast.iter_child_nodes(tree):
            if (not type_checking and isinstance(node, ast.If)
                    and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"):
                continue
            yield node
            yield from nodes(node)

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in nodes(ast.parse(p.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import sub`` needs the module ``pkg.sub`` when there is one, else ``pkg``
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            for t in targets:
                if t.startswith("diloco_lightning"):
                    r = resolve(t)
                    if r and r != m:
                        graph[m].add(r)
    return graph


def test_the_library_never_imports_the_product():
    graph = _graph()
    bad = sorted((m, d) for m, deps in graph.items() for d in deps
                 if d.startswith("diloco_lightning.app") and not m.startswith("diloco_lightning.app") and m not in SHIMS)
    assert not bad, f"library modules importing the Hydra product: {bad}"


def test_no_import_cycles():
    """Within a package too: an import only for typing (``TYPE_CHECKING``) is a back-reference all the same."""
    graph = _graph(type_checking=True)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _package(module: str) -> str | None:
    """``diloco_lightning.wire.delta.read`` -> ``wire``; the root package (and its shims) -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def test_every_package_has_a_layer():
    top = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top - {"configs", "recipes"} <= set(RANK), f"packages without a layer in LAYERS: {sorted(top - set(RANK))}"
    flat = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert flat == ["summarize"], f"modules outside the layer folders: {flat}"


def test_each_layer_imports_only_the_layers_below():
    bad = []
    for m, deps in _graph(type_checking=True).items():
        src = _package(m)
        if src is None or m in SHIMS:
            continue
        for d in deps:
            dst = _package(d)
            if dst is None:
                # the root package is the public face (DiLoCo, the old names): only the product may use it
                if src != "app":
                    bad.append((m, d))
            elif dst != src and RANK[dst] >= RANK[src]:
                bad.append((m, d))
    assert not bad, "imports of a layer at or above the importer's own:\n" + "\n".join(f"  {m} -> {d}" for m, d in sorted(bad))
