"""The root of opake's errors: ``except opake.errors.OpakeError`` catches every refusal of ours.

Each error also subclasses the builtin that fits it (``ValueError`` for a bad argument,
``TypeError`` for a wrong kind of argument, ``RuntimeError`` for a call the run's state does not
allow), so code that catches those keeps working. Messages say what was wrong and what to do.
"""

from __future__ import annotations

__all__ = ["OpakeError"]


class OpakeError(Exception):
    """Something opake refused, before it released or changed anything it guards."""
