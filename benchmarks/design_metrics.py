"""The package's shape in figures: what issue 37 (redesign 3) measures before and after.

Prints module sizes over a bound, classes by method count, imported private names, private attributes
reached across modules (``obj._x`` where ``obj`` is not ``self``/``cls``), branches on an encoding's or
an outer optimizer's name, and transport schemes named outside ``hub/``.

    PYTHONPATH=. python benchmarks/design_metrics.py [--package diloco_lightning] [--lines 500] [--methods 25]
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="diloco_lightning")
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--methods", type=int, default=25)
    args = parser.parse_args()
    root = Path(args.package)
    modules = _modules(root)
    total = 0
    big: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    private_imports: list[str] = []
    private_attrs: list[str] = []
    name_branches: list[str] = []
    schemes: list[str] = []
    for path in modules:
        text = path.read_text()
        rel = str(path)
        lines = text.count("\n")
        total += lines
        if lines > args.lines:
            big.append((lines, rel))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                classes.append((n, f"{rel}:{node.name}"))
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private_imports.append(f"{rel}: {node.module}.{alias.name}")
            elif isinstance(node, ast.Attribute):
                if (
                    node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name)
                    and node.value.id not in ("self", "cls")
                ):
                    # a module-level private reached through an imported module is the same habit
                    private_attrs.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
        for i, line in enumerate(text.splitlines(), 1):
            if re.search(r"\bspec\.name\s*[=!]=|\bname\s*[=!]=\s*[\"']pa_cgad|[\"']pa_cgad[\"']\s*(in|==)", line):
                name_branches.append(f"{rel}:{i}")
            if "hub" not in path.parts and re.search(r"[\"'](s3|hf)://", line):
                schemes.append(f"{rel}:{i}")
    print(f"modules {len(modules)}, lines {total}")
    print(f"modules over {args.lines} lines: {len(big)}")
    for lines, rel in sorted(big, reverse=True):
        print(f"  {lines:5d} {rel}")
    many = sorted((c for c in classes if c[0] > args.methods), reverse=True)
    print(f"classes over {args.methods} methods: {len(many)}")
    for n, name in many:
        print(f"  {n:3d} {name}")
    print(f"largest classes: " + ", ".join(f"{name.split(':')[-1]} {n}" for n, name in sorted(classes, reverse=True)[:6]))
    print(f"imported private names: {len(private_imports)}")
    for item in private_imports:
        print(f"  {item}")
    print(f"private attributes of another object (obj._x, obj not self/cls): {len(private_attrs)}")
    for item in private_attrs:
        print(f"  {item}")
    print(f"branches on an encoding's or outer optimizer's name: {len(name_branches)}")
    for item in name_branches:
        print(f"  {item}")
    print(f"transport schemes named outside hub/: {len(schemes)}")
    for item in schemes:
        print(f"  {item}")


if __name__ == "__main__":
    main()
