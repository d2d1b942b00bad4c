"""The error contract: every refusal of opake is an ``OpakeError`` that is also the builtin users catch.

The test reads every ``raise`` in src/opake, resolves the class it raises (by name in that module,
through a factory function of that module that returns one, or in builtins) and checks it against
``opake.errors.OpakeError``. A bare ``raise`` and ``raise error`` of an exception object already
built elsewhere are re-raises, not raise sites. What is Python protocol rather than a refusal is
listed in ``ALLOWED`` with its reason. The negative controls read made-up modules that raise a
builtin and a class defined in no module.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pathlib

import pytest

from opake.errors import OpakeError

SOURCE = pathlib.Path(__file__).resolve().parent.parent / "src"

# (module, enclosing function, raised expression) -> why it is not an OpakeError.
ALLOWED = {
    ("opake.dpftrl.sampling", "__getattr__", "AttributeError"):
        "module and instance __getattr__: an unknown name is AttributeError, the attribute protocol",
    ("opake.transformers", "__getattr__", "AttributeError"):
        "module __getattr__: an unknown name is AttributeError, the attribute protocol",
    ("opake.dpftrl.sampling", "_period", "NotImplementedError"): "abstract method of _CyclicSampler",
    ("opake.dpftrl.sampling", "_min_sep", "NotImplementedError"): "abstract method of _CyclicSampler",
    ("opake.dpftrl.sampling", "batch", "NotImplementedError"): "abstract method of _CyclicSampler",
    ("opake.torch.per_example.rules.base", "squared_norms", "NotImplementedError"):
        "LayerRule method a ghost rule overrides (the clipper calls it only when rule.ghost is True)",
    ("opake.torch.per_example.rules.base", "clipped_sums", "NotImplementedError"):
        "LayerRule method a ghost rule overrides (the clipper calls it only when rule.ghost is True)",
    ("opake.torch.per_example.rules.base", "per_example_grads", "NotImplementedError"):
        "abstract method of LayerRule: every rule implements it",
    ("opake.dpftrl.strategies.lbfgs", "stop_when_stalled", "StopIteration"):
        "scipy's protocol: StopIteration from a callback (or the objective) ends minimize early; lbfgs catches it, never a user-facing error",
    ("opake.audit.canaries", "__getitem__", "IndexError"):
        "sequence protocol: IndexError past the end ends iteration over the dataset",
    ("opake.dpftrl.strategies.blt_optimize", "objective", "_Stalled"):
        "control flow: _minimize catches it and returns the best point (never leaves the module)",
    ("opake.dpftrl.strategies.blt_optimize", "objective", "_Exhausted"):
        "control flow: _minimize catches it and returns the best point (never leaves the module)",
    ("opake.dpftrl.unit_ids", "key", "_Refused"):
        "control flow: _IdReader.keyed catches it and raises the OpakeError it carries",
    ("opake.dpftrl.unit_ids", "_refuse_unless_compared_by_value", "_Refused"):
        "control flow: _IdReader.keyed catches it and raises the OpakeError it carries",
    ("opake.dpftrl.unit_ids", "keyed", "refused.error"):
        "the class a _Refused carries: test_refused_carries_opake_errors checks every one",
}


def modules() -> list[tuple[pathlib.Path, str]]:
    found = []
    for path in sorted((SOURCE / "opake").rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append((path, ".".join(parts)))
    return found


def _enclosing_functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node's innermost enclosing function name (``<module>`` at the top)."""
    owner: dict[ast.AST, str] = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else name
            owner[child] = inner
            visit(child, inner)

    visit(tree, "<module>")
    return owner


def _lookup(namespace: dict, dotted: str):
    """``dotted`` (``Name`` or ``alias.Name``) in a module's namespace, then builtins; None if absent."""
    first, *rest = dotted.split(".")
    if first in namespace:
        value = namespace[first]
    elif hasattr(builtins, first):
        value = getattr(builtins, first)
    else:
        return None
    for part in rest:
        value = getattr(value, part, None)
    return value


def _factory_classes(tree: ast.Module, name: str, namespace: dict) -> list | None:
    """The classes a module-level function ``name`` returns as ``return SomeError(...)``."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            returned = [ret.value for ret in ast.walk(node) if isinstance(ret, ast.Return) and ret.value]
            calls = [value.func for value in returned if isinstance(value, ast.Call)]
            if not calls or len(calls) != len(returned):
                return None
            return [_lookup(namespace, ast.unparse(func)) for func in calls]
    return None


def _with_local_imports(tree: ast.Module, namespace: dict) -> dict:
    """``namespace`` and the opake names imported inside functions (``from opake.x import SomeError``);
    optional packages imported there (matplotlib, tqdm) are not needed to resolve a raise."""
    names = dict(namespace)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "opake" and not node.level:
            for alias in node.names:
                if (alias.asname or alias.name) not in names:
                    source = importlib.import_module(node.module)
                    names[alias.asname or alias.name] = getattr(source, alias.name, None)
    return names


def raise_sites(tree: ast.Module, namespace: dict):
    """``(line, function, raised expression, classes)`` for each raise that builds or names a class;
    ``classes`` is None where it cannot be resolved."""
    owner = _enclosing_functions(tree)
    namespace = _with_local_imports(tree, namespace)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue  # bare ``raise``: a re-raise
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        text = ast.unparse(target)
        value = _lookup(namespace, text) if isinstance(target, (ast.Name, ast.Attribute)) else None
        if isinstance(value, type):
            classes = [value]
        elif callable(value) and isinstance(node.exc, ast.Call) and isinstance(target, ast.Name):
            classes = _factory_classes(tree, target.id, namespace)
        elif value is None and not isinstance(node.exc, ast.Call):
            continue  # ``raise error``: an exception object built elsewhere (a local or a parameter)
        else:
            classes = None
        yield node.lineno, owner[node], text, classes


def refusals_outside_contract(files) -> list[str]:
    """``path:line raise Name`` for each raise site whose class is not an OpakeError subclass and
    which ALLOWED does not list; ``files`` pairs a path with its module's namespace."""
    problems = []
    for path, namespace in files:
        source = path.read_text()
        if "raise " not in source:
            continue
        for line, function, text, classes in raise_sites(ast.parse(source), namespace):
            if (namespace["__name__"], function, text) in ALLOWED:
                continue
            if classes is None or not all(isinstance(c, type) and issubclass(c, OpakeError) for c in classes):
                where = path.relative_to(SOURCE) if path.is_relative_to(SOURCE) else path.name
                problems.append(f"{where}:{line} raise {text}")
    return problems


def _importable():
    """Every module but ``opake.__main__`` (importing it runs the command line), with its namespace;
    a module whose optional extra (transformers, TRL) is not installed is left out."""
    found = []
    for path, module in modules():
        if module == "opake.__main__":
            continue
        try:
            found.append((path, vars(importlib.import_module(module))))
        except ImportError as error:
            if isinstance(error, ModuleNotFoundError) and (error.name or "opake").split(".")[0] == "opake":
                raise
            if module.startswith("opake.transformers"):
                continue
            raise
    return found


def test_every_raise_site_raises_an_opake_error():
    problems = refusals_outside_contract(_importable())
    assert not problems, f"{len(problems)} raise sites outside the error contract:\n" + "\n".join(problems)


def test_allowed_entries_still_exist():
    seen = set()
    for path, namespace in _importable():
        seen |= {(namespace["__name__"], function, text)
                 for _, function, text, _ in raise_sites(ast.parse(path.read_text()), namespace)}
    assert not set(ALLOWED) - seen, f"stale ALLOWED entries: {sorted(set(ALLOWED) - seen)}"


def test_refused_carries_opake_errors():
    from opake.dpftrl import unit_ids

    tree = ast.parse(pathlib.Path(unit_ids.__file__).read_text())
    carried = [node.args[0] for node in ast.walk(tree)
               if isinstance(node, ast.Call) and ast.unparse(node.func) == "_Refused"]
    assert carried
    for argument in carried:
        assert issubclass(_lookup(vars(unit_ids), ast.unparse(argument)), OpakeError), ast.unparse(argument)


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def test_every_opake_error_is_also_a_builtin_error():
    _importable()
    ours = {cls for cls in _all_subclasses(OpakeError) if cls.__module__.startswith("opake")}
    assert len(ours) > 20
    lacking = sorted(
        f"{cls.__module__}.{cls.__qualname__}" for cls in ours
        if not any(base.__module__ == "builtins" and base not in (Exception, BaseException, object)
                   for base in cls.__mro__)
    )
    assert not lacking, f"OpakeErrors that no builtin except clause catches: {lacking}"


@pytest.mark.parametrize("body, expected", [
    ("def check(x):\n    if x < 0:\n        raise ValueError(f'x must be >= 0, got {x}')\n", ["raise ValueError"]),
    ("def check(x):\n    raise Missing('no such class')\n", ["raise Missing"]),
    ("def check(x):\n    raise _error(x)\n\ndef _error(x):\n    return KeyError(x)\n", ["raise _error"]),
    ("from opake.errors import OpakeError\n\nclass Bad(OpakeError, ValueError):\n    pass\n\n"
     "def check(x):\n    raise Bad('bad')\n", []),
    ("def check(x):\n    try:\n        x()\n    except ValueError as error:\n        raise error\n", []),
])
def test_negative_control(tmp_path, body, expected):
    path = tmp_path / "made_up.py"
    path.write_text(body)
    namespace = {"__name__": "made_up"}
    exec(compile(body, str(path), "exec"), namespace)
    problems = refusals_outside_contract([(path, namespace)])
    assert [problem.split(" ", 1)[1] for problem in problems] == expected
