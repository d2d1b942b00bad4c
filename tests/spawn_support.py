"""Spawning the ranks of a multi-process test (gloo on CPU).

Every worker saves its results, waits at a barrier for the others, then closes the process
group. gloo on CPU (torch 2.13) still aborts a rank now and then while the group is torn down
("terminate called without an active exception", SIGABRT), after all the work is done and
saved: that abort alone is not what the tests examine, so it is accepted when every rank's
result file exists. Any other failure, or an abort before the results are saved, fails.
"""

from __future__ import annotations

import pathlib

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException


def spawn_ranks(worker, args: tuple, nprocs: int, results: list[pathlib.Path]) -> None:
    try:
        mp.spawn(worker, args=args, nprocs=nprocs)
    except ProcessExitedException as error:
        if error.signal_name != "SIGABRT" or not all(pathlib.Path(path).exists() for path in results):
            raise
