"""Workers of tests/test_spawn_support.py: a rank that aborts after or before saving its result."""

import os
import pathlib
import time


def abort_after_saving(rank: int, folder: str) -> None:
    (pathlib.Path(folder) / f"rank{rank}.pt").write_bytes(b"done")
    if rank == 1:
        deadline = time.monotonic() + 30  # as the workers' barrier does: every rank has saved first
        while not (pathlib.Path(folder) / "rank0.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.abort()


def abort_before_saving(rank: int, folder: str) -> None:
    if rank == 1:
        os.abort()
    (pathlib.Path(folder) / f"rank{rank}.pt").write_bytes(b"done")
