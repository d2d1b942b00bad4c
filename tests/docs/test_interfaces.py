"""docs/INTERFACES.md against the code: every name it lists exists where it says, with the
parameters it names.

Each section headed by a module (``## `opake.x.y` ...``) is read for code spans: ``name(...)``
must be an attribute of that module (or of a class it names: ``Class.member``), and every
parameter the span writes out must be a parameter of the callable. A drifted page fails here;
the negative control shows the reader catches a renamed parameter.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "INTERFACES.md"
_HEADING = re.compile(r"^## `(opake[\w.]*)`", re.M)
_SPAN = re.compile(r"`([^`]+)`")
_CALL = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)")


# Objects the page names by role, not by an attribute of the section's module.
_VARIABLES = {"noise_fn", "grad_fn", "recipe", "state", "fresh_state", "proc", "process", "trainer", "private",
              "optimizer", "sampler", "loss_fn", "mechanism", "module", "strategy", "plan", "noise_state", "run", "clipper",
              "train", "Process", "DPOptimizer", "torch", "dataclass", "DataLoader", "np", "float", "min", "max"}


def _sections(text: str):
    starts = list(_HEADING.finditer(text))
    for match, following in zip(starts, starts[1:] + [None]):
        end = following.start() if following else len(text)
        yield match.group(1), text[match.end():end]


def _parameters(argument_text: str) -> list[str]:
    names = []
    for part in re.split(r",|\|", argument_text):
        part = part.strip().lstrip("*").strip()
        word = re.match(r"([A-Za-z_]\w*)\s*=", part)
        if word:
            names.append(word.group(1))
    return names


def _resolve(module, dotted: str):
    target = module
    for part in dotted.split("."):
        if not hasattr(target, part):
            return None
        target = getattr(target, part)
    return target


def _missing(target, parameters: list[str]) -> list[str]:
    """The named parameters ``target`` does not take (none when it takes **kwargs or has no signature)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return []
    return [p for p in parameters if p not in signature.parameters]


def _problems(text: str) -> list[str]:
    problems = []
    for module_name, body in _sections(text):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            problems.append(f"{module_name}: cannot import ({error})")
            continue
        for span in _SPAN.findall(body.replace("\n", " ")):
            call = _CALL.match(span.strip())
            if call is None:
                continue
            name, arguments = call.groups()
            head = name.split(".")[0]
            if head in _VARIABLES:
                continue  # a call on an object the page introduces (noise_fn(...), recipe.resolve(...))
            targets = [_resolve(module, name)]
            if targets[0] is None:  # a method or property of the module's classes (batch(step))
                targets = [getattr(cls, name) for _, cls in inspect.getmembers(module, inspect.isclass)
                           if "." not in name and hasattr(cls, name)]
            if not targets:
                problems.append(f"{module_name}: `{name}` does not exist")
                continue
            missing = min((_missing(target, _parameters(arguments)) for target in targets), key=len)
            if missing:
                problems.append(f"{module_name}: `{name}` has no parameter(s) {missing}")
    return problems


def test_interfaces_page_matches_the_code():
    assert _problems(DOC.read_text()) == []


def test_the_reader_catches_a_drifted_name_and_parameter():
    text = ("## `opake.dpftrl.participation`\n`Participation(n_steps, min_sep=1, max_visits=None)`\n"
            "## `opake.random`\n`keys(seed)`\n")
    assert _problems(text) == ["opake.dpftrl.participation: `Participation` has no parameter(s) ['max_visits']",
                               "opake.random: `keys` does not exist"]
    assert _problems(text.replace("max_visits", "max_participations").replace("keys(", "key(")) == []
