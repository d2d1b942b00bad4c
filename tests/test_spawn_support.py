"""spawn_ranks accepts a rank's abort only once every rank's result is saved (the gloo teardown
abort it exists for); an abort before the results are written still fails the test."""

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

import spawn_support_workers as workers
from spawn_support import spawn_ranks


def test_an_abort_after_every_result_is_saved_is_accepted(tmp_path):
    spawn_ranks(workers.abort_after_saving, (str(tmp_path),), 2, [tmp_path / f"rank{r}.pt" for r in range(2)])


def test_an_abort_before_the_results_are_saved_fails(tmp_path):
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        spawn_ranks(workers.abort_before_saving, (str(tmp_path),), 2, [tmp_path / f"rank{r}.pt" for r in range(2)])
