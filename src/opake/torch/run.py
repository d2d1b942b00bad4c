"""The state of a private run, and its one owner.

Three things change as a run trains: the noise state (its step, buffers and key stream), which
planned batch the loop was served last, and nothing else. They live together in one frozen
``RunState``, held by one ``PrivateRun``, which the loader, the optimizer and ``PrivateTraining``
share and call explicitly:

* the planned loader calls ``serve(step)`` as it hands batch ``step`` to the loop (with privacy
  units, that is also when the clipper learns the batch's users: ``clipper.expect_units``);
* ``DPOptimizer.step`` calls ``release(gradients, examples)``: the check that this is the
  served batch (``PlannedBatches.check_step``), then one step of the noise engine;
* ``PrivateTraining.load_state_dict`` calls ``restore(noise_state)``; the audit's control
  (``opake.audit``) calls ``replace_noise`` before the first step.

Each of them replaces ``state`` by a new ``RunState``; nothing else writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from opake.dpftrl.noise.engine.state import NoiseState
from opake.errors import InvalidStateError
from opake.torch.loader import PlannedBatches

__all__ = ["PrivateRun", "RunState"]


@dataclass(frozen=True)
class RunState:
    """``noise``: the noise engine's state (its ``step`` is the next step to take); ``served``: the
    step whose batch the planned loader handed out last (None: none since the start or a restore)."""

    noise: NoiseState
    served: int | None = None

    @property
    def step(self) -> int:
        return self.noise.step


class PrivateRun:
    """Owns a run's ``state``; ``batches`` (the plan's batches on this rank), ``noise_fn`` (the
    noise engine's step) and ``clipper`` (told each served batch's units) are fixed."""

    def __init__(self, batches: PlannedBatches, noise_fn, noise_state: NoiseState, clipper):
        self.batches = batches
        self.noise_fn = noise_fn
        self.clipper = clipper
        self.state = RunState(noise_state)

    @property
    def step(self) -> int:
        """The next step to take (steps taken so far)."""
        return self.state.step

    @property
    def n_steps(self) -> int:
        return self.state.noise.n_steps

    def serve(self, step: int) -> None:
        """Batch ``step`` is handed to the training loop now; with privacy units, its users go to the
        clipper first (each user's rows are clipped together)."""
        units = self.batches.units(step)
        if units is not None:
            self.clipper.expect_units(units)
        if self.batches.placeholder:
            self.clipper.expect_placeholder(not self.batches.indices(step))
        self.state = replace(self.state, served=step)

    def check(self, step: int, examples: int) -> None:
        """Raise unless ``examples`` clipped examples are the served batch ``step``'s."""
        self.batches.check_step(step, examples, self.state.served)

    def release(self, gradients):
        """The noised ``gradients`` (a ``ClippedPytree``) of the next step; the step is then taken."""
        noisy, noise = self.noise_fn(gradients, self.state.noise)
        self.state = replace(self.state, noise=noise)
        return noisy

    def restore(self, noise_state: NoiseState) -> None:
        """Continue from a restored noise state; the loader serves from its step."""
        self.state = RunState(noise_state)

    def replace_noise(self, noise_fn, noise_state: NoiseState) -> None:
        """Run another noise engine from the first step (the audit's deliberately weakened control,
        ``opake.audit``); refused once a step was taken."""
        if self.step != 0:
            raise InvalidStateError("the noise engine of a run can be replaced before its first step only")
        self.noise_fn = noise_fn
        self.state = RunState(noise_state, self.state.served)
