"""No import runs upward: each module imports only its own layer and the layers below.

Layers (shared/design ARCHITECTURE): values and checks; strategy mathematics; the noise engine;
accounting; clipping and sampling; the planner; the PyTorch front end; Hugging Face; the command line, demo
and audit. Imports inside functions count too (an upward import hidden in a function is still
one). The negative control reads a made-up upward import.
"""

from __future__ import annotations

import ast
import pathlib

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "src"
LAYERS = [
    ("opake._checks", "opake.errors", "opake.random", "opake.types", "opake.progress", "opake"),
    ("opake.dpftrl.participation", "opake.dpftrl.strategies"),
    ("opake.dpftrl.noise",),
    ("opake.accounting", "opake.dpftrl.accounting"),
    ("opake.dpftrl.clipping", "opake.dpftrl.sampling", "opake.dpftrl"),
    ("opake.planner",),
    ("opake.torch",),
    ("opake.transformers",),
    ("opake.cli", "opake.demo", "opake.audit", "opake.__main__"),
]


def layer_of(module: str) -> int:
    """The layer of ``module``: its longest matching prefix's."""
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def imports(path: pathlib.Path, module: str) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against the package
                base = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")[
                    : len(module.split(".")) - node.level + 1]
                found.append(".".join(base + [node.module]))
            else:
                found.append(node.module)
    return [name for name in found if name == "opake" or name.startswith("opake.")]


def upward(files) -> list[str]:
    problems = []
    for path, module in files:
        own = layer_of(module)
        for imported in imports(path, module):
            if imported == "opake":
                continue
            if layer_of(imported) > own:
                problems.append(f"{module} (layer {own}) imports {imported} (layer {layer_of(imported)})")
    return problems


def _modules():
    for path in sorted(SOURCE.rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, ".".join(parts)


def test_no_import_runs_upward():
    modules = list(_modules())
    assert len(modules) > 80 and all(layer_of(module) is not None for _, module in modules)
    assert upward(modules) == []


def test_the_check_catches_an_upward_import(tmp_path):
    path = tmp_path / "draws.py"
    path.write_text("from opake.torch.private import make_private\n")
    assert upward([(path, "opake.dpftrl.noise.engine.draws")]) == [
        "opake.dpftrl.noise.engine.draws (layer 2) imports opake.torch.private (layer 6)"]
