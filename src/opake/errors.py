"""The root of opake's errors: ``except opake.errors.OpakeError`` catches every refusal of ours.

Each error also subclasses the builtin that fits it (``ValueError`` for a bad argument,
``TypeError`` for a wrong kind of argument, ``RuntimeError`` for a call the run's state does not
allow, ``ImportError`` for a missing optional extra), so code that catches those keeps working.
Messages say what was wrong and what to do.

Where a module has a refusal of its own it defines a class for it beside the code that raises it
(``opake.torch.loader.UnplannedBatchError``,
``opake.dpftrl.noise.engine.state.CheckpointIntegrityError``, ...). The other refusals raise one
of the general classes here:

- ``InvalidArgumentError`` (``ValueError``): an argument has the right kind but a value opake
  cannot use (out of range, inconsistent with another argument, not one of the listed choices).
- ``InvalidTypeError`` (``TypeError``): an argument of the wrong kind, a missing or conflicting
  argument, or an operation the object does not support (copying a noise state).
- ``InvalidStateError`` (``RuntimeError``): a call the state of the run (or of the environment)
  does not allow now, such as replacing the noise engine after the first step.
- ``ConvergenceError`` (``RuntimeError``): a numerical search (a calibration, a certified bound)
  did not reach its answer within its limits.
- ``PlanError`` (``ValueError``): a privacy request no plan can meet (an unknown sampling, a budget
  no noise multiplier reaches, a sample rate above 1), raised before anything is built.
- ``MissingDependencyError`` (``ImportError``): an optional extra is not installed, or is a
  version opake does not support; the message says what to install.

``tests/test_errors.py`` reads every ``raise`` in src/opake and checks that it raises an
``OpakeError``; the few that are Python protocol (``AttributeError`` from a ``__getattr__``,
``NotImplementedError`` of an abstract method, ``StopIteration`` and ``IndexError`` ending an
iteration) are listed there with their reasons.
"""

from __future__ import annotations

__all__ = [
    "ConvergenceError",
    "InvalidArgumentError",
    "InvalidStateError",
    "InvalidTypeError",
    "MissingDependencyError",
    "OpakeError",
    "PlanError",
]


class OpakeError(Exception):
    """Something opake refused, before it released or changed anything it guards."""


class InvalidArgumentError(OpakeError, ValueError):
    """An argument of the right kind with a value opake cannot use; the message says which values work."""


class InvalidTypeError(OpakeError, TypeError):
    """An argument of the wrong kind, a missing or conflicting argument, or an unsupported operation."""


class InvalidStateError(OpakeError, RuntimeError):
    """A call that the state of the run, or of the environment, does not allow now."""


class ConvergenceError(OpakeError, RuntimeError):
    """A numerical search did not reach its answer within its limits; nothing was built from it."""


class MissingDependencyError(OpakeError, ImportError):
    """An optional extra is not installed, or not in a supported version; the message says what to install."""


class PlanError(OpakeError, ValueError):
    """A privacy request no plan can meet (an unknown sampling, a budget no noise multiplier reaches,
    a sample rate above 1); raised by the planner or the request before anything is built."""
