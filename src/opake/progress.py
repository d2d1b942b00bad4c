"""A one-line progress report on stderr for planning work that can take seconds.

Resolving a strategy and calibrating a noise multiplier to an amplified bound take seconds on
large runs (a million examples). ``Progress`` says what is being done while it runs: one line
on stderr, rewritten in place on a terminal, with the stage, its latest news (the last
calibration evaluation) and the seconds elapsed. Nothing is written until the work has run for
``delay`` seconds, so a fast plan prints nothing; a ticker thread refreshes the elapsed time on
a terminal, so a stage that reports no news (an optimizer running) still shows it is alive. On
a stream that is not a terminal (a log file, forced on with ``enabled=True``) every report is a
whole line and there is no ticker.

``progress=None`` (the default of ``make_private``, ``plan_run``, ``plan_dataset`` and ``opake
plan``) means: on when stderr is a terminal. ``False`` silences it; ``True`` forces it on.
No dependency: one line needs no progress-bar library.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager

from opake.errors import InvalidTypeError

_TICK_SECONDS = 0.5
DELAY_SECONDS = 1.0


class Progress:
    """Reports planning stages on ``stream`` (stderr): ``stage(label)`` around the work,
    ``note(text)`` inside, ``close(summary)`` at the end (in a ``finally``: it ends the line).

    A disabled Progress does nothing at all (no thread, no writes). ``Progress.of(progress)``
    turns a ``progress=`` argument (None, True, False, or a Progress, kept) into one.
    """

    def __init__(self, enabled: bool | None = None, stream=None, *, delay: float | None = None, prefix: str = "opake"):
        if enabled is not None and not isinstance(enabled, bool):
            raise InvalidTypeError(
                f"progress must be None (on when stderr is a terminal), True or False, got {enabled!r}"
            )
        self._stream = stream
        stream = self.stream
        self.is_terminal = bool(getattr(stream, "isatty", lambda: False)())
        self.enabled = self.is_terminal if enabled is None else enabled
        self.delay = DELAY_SECONDS if delay is None else float(delay)
        self.prefix = prefix
        self._start = time.perf_counter()
        self._label = ""
        self._news = ""
        self._width = 0  # characters of the line now on a terminal (0: none)
        self._written = False
        self._lock = threading.Lock()
        self._ticker = None
        self._stop = threading.Event()

    @property
    def stream(self):
        return sys.stderr if self._stream is None else self._stream

    @classmethod
    def of(cls, progress) -> "Progress":
        """A Progress for a ``progress=`` argument: None (auto), True, False, or a Progress (kept)."""
        if isinstance(progress, Progress):
            return progress
        return cls(progress)

    @contextmanager
    def stage(self, label: str):
        """Report ``label`` (with elapsed seconds) while the block runs."""
        if not self.enabled:
            yield self
            return
        with self._lock:
            previous, self._label, self._news = self._label, label, ""
        self._start_ticker()
        self._render()
        try:
            yield self
        finally:
            with self._lock:
                self._label, self._news = previous, ""

    def note(self, text: str) -> None:
        """Latest news of the current stage (e.g. the last calibration evaluation)."""
        if not self.enabled:
            return
        with self._lock:
            self._news = text
        self._render()

    def close(self, summary: str | None = None) -> None:
        """Stop the ticker and end the line: with ``summary`` (and the seconds) if anything was shown.

        The Progress can be used again afterwards (its clock restarts).
        """
        if not self.enabled:
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if summary is not None and self._written:
                self._write(f"{self.prefix}: {summary} ({self._elapsed():.1f} s)", final=True)
            elif self._width:
                self.stream.write("\n")
                self.stream.flush()
                self._width = 0
            self._ticker, self._stop, self._written = None, threading.Event(), False
            self._start = time.perf_counter()

    def _elapsed(self) -> float:
        return time.perf_counter() - self._start

    def _render(self) -> None:
        with self._lock:
            if self._elapsed() < self.delay or not self._label:
                return
            head = f"{self.prefix}: {self._label}"
            tail = (f": {self._news}" if self._news else "") + f" ({self._elapsed():.0f} s)"
            if self.is_terminal:  # a wrapped line could not be rewritten: shorten the label, keep the news
                width = self._columns() - 1
                if len(head) + len(tail) > width:
                    head = head[: max(len(self.prefix) + 8, width - len(tail) - 3)] + "..."
            self._write(head + tail, final=False)

    def _write(self, text: str, final: bool) -> None:
        """Write ``text`` (lock held): in place on a terminal, as a whole line elsewhere."""
        stream = self.stream
        if self.is_terminal:
            text = text[: self._columns() - 1]
            stream.write("\r" + " " * self._width + "\r" + text)  # blank the old line, then write
            self._width = 0 if final else len(text)
            if final:
                stream.write("\n")
        else:
            stream.write(text + "\n")
        stream.flush()
        self._written = True

    def _columns(self) -> int:
        """The terminal's width: of the stream itself (stdout may be redirected), else the default.

        A terminal that reports no size (0 columns: a pseudo-terminal nobody sized, as ``script``
        opens) gets shutil's answer ($COLUMNS, else 80), not a line cut to nothing.
        """
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        return columns if columns > 0 else shutil.get_terminal_size().columns

    def _start_ticker(self) -> None:
        if not self.is_terminal or self._ticker is not None:
            return

        def tick():
            while not self._stop.wait(_TICK_SECONDS):
                self._render()

        self._ticker = threading.Thread(target=tick, name="opake-progress", daemon=True)
        self._ticker.start()


def calibration_reporter(progress: Progress, target: float):
    """``on_evaluation`` for ``opake.accounting.calibrate``: one note per evaluation."""
    count = [0]

    def report(param: float, epsilon: float) -> None:
        count[0] += 1
        progress.note(f"evaluation {count[0]}: sigma {param:.6g}, epsilon {epsilon:.6g} (target {target:g})")

    return report
