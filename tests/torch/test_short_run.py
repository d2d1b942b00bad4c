"""A run that ends short of its plan says what it spent (``ShortRunWarning``); a complete run does not.

The short run is the issue's: a loop that passes over ``private.data_loader`` once, of a plan of
two epochs, stops at half the planned steps while ``private.epsilon`` is the whole plan's.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import opake.random
from opake.torch import ShortRunWarning, make_private

EXAMPLES, BATCH, EPOCHS = 32, 8, 2  # 4 steps an epoch, 8 planned


def _private():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(EXAMPLES, 3), torch.randint(0, 2, (EXAMPLES,)))
    return make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dataset=data,
                        batch_size=BATCH, epochs=EPOCHS, max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-5,
                        key=opake.random.key(0))


def _epoch(private):
    for x, y in private.data_loader:
        private.optimizer.zero_grad()
        if len(y):
            F.cross_entropy(private.module(x), y).backward()
        private.optimizer.step()


def test_reading_the_planned_epsilon_of_a_short_run_warns_with_what_was_spent():
    private = _private()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)
        planned = private.epsilon  # before the first step: the plan, nothing to warn about
    _epoch(private)  # one pass over the loader: half the plan
    assert private.steps_taken == 4
    spent = private.epsilon_spent()
    assert spent < planned
    with pytest.warns(ShortRunWarning) as caught:
        assert private.epsilon == planned
    message = str(caught[0].message)
    assert "private.epsilon: this private run has taken 4 of its 8 planned steps" in message
    assert f"spent epsilon {spent:.4g}" in message and f"the planned {planned:.4g}" in message
    assert caught[0].filename == __file__  # points at the line that read it
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)
        private.epsilon  # once per run: a loop that logs it every step is told once
        private.epsilon_spent()  # never warns
    with pytest.warns(ShortRunWarning, match=re.escape("private.detach(): this private run has taken 4 of its 8")):
        private.detach()


def test_a_complete_run_never_warns():
    private = _private()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)
        for _ in range(EPOCHS):
            _epoch(private)
        assert private.steps_taken == 8
        assert private.epsilon == private.epsilon_spent()
        private.detach()


def test_detaching_an_untouched_run_does_not_warn():
    private = _private()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortRunWarning)
        private.detach()
