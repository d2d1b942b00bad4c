"""The privacy request: what a private run protects and how much, as one frozen value.

``PrivacySpec`` holds the settings every guarantee of opake's PyTorch front end depends on: the
budget (``target_epsilon``, or a given ``noise_multiplier``) at ``target_delta``, the clipping
rule (``max_grad_norm`` and ``clipping``), the batches (``batch_size``, ``epochs``, ``sampling``),
the accounting (``amplification``), the mechanism (``strategy``; None: the least noise at the
budget) and the protected unit (``privacy_unit``). It checks them once, when it is built, and
compares and hashes by what they mean (``max_grad_norm=1.0`` and ``FlatClipping(1.0)`` are one
request; a user id list and the ``PrivacyUnits`` it makes are one request).

Every front end builds one and nothing else: ``make_private`` and ``plan_privacy`` from their
keyword arguments (the user's form; ``make_private(privacy=spec)`` takes the value itself),
``PrivacyEngine`` from Opacus' arguments, ``DPTrainer`` and the TRL trainers from their
arguments classes (``opake.transformers.DPTrainingArguments``) or keywords. The planner
(``opake.torch.planning.plan_request``) turns it, with the data set's size and a key, into the
``PrivacyPlan``, which records it (``plan.request``).

Left out, on purpose: the key (a secret of one run, not a setting: two runs of one request
differ in it), the data (its size is the planner's input), the optimizer and its schedule (read
by the planner to fit the noise to what the optimizer does with it) and the performance options
(DataLoader workers, which rank noises which parameters, ``noise_correction`` of an Adam's second
moment): they change no privacy figure, so they stay with the front end that runs the plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields

from opake._checks import integer_at_least, positive_finite
from opake.accounting import epsilon_budget
from opake.accounting.process import check_delta
from opake.dpftrl.clipping import clipping_rule
from opake.dpftrl.noise import band_mf_strategy, identity_strategy
from opake.dpftrl.sampling import PrivacyUnits
from opake.errors import InvalidTypeError, PlanError
from opake.torch.checkpoint import units_record
from opake.torch.privacy_units import privacy_units

__all__ = ["OPTIMIZER_BLT", "PlanError", "PrivacySpec", "SAMPLINGS", "STRATEGY_NAMES", "request_of"]

SAMPLINGS = ("balls_in_bins", "poisson")
# The strategy a request may name (a command line cannot build a recipe): "blt" stays a name, since
# its recipe is fitted to the optimizer's workload by the planner (strategy_for_optimizer); the
# others are recipes of their own.
OPTIMIZER_BLT = "blt"
STRATEGY_NAMES = (OPTIMIZER_BLT, "dp_sgd", "band_mf:BANDS")


@dataclass(frozen=True, kw_only=True)
class PrivacySpec:
    """A private run's request: what is protected and how much (module docstring).

    ``target_delta`` always, and exactly one of ``target_epsilon`` (the noise multiplier is
    calibrated) and ``noise_multiplier`` (epsilon is computed). ``max_grad_norm`` is the bound C
    on one unit's clipped gradient, or a clipping rule value; ``clipping`` (None, ``"flat"``,
    ``"automatic"``) the rule for a bound. ``batch_size`` units per step (expected), and the run's
    length: ``epochs`` passes, or ``steps`` (a horizon in steps, the last epoch cut where it ends,
    as ``max_steps`` is for Trainer; the noise is calibrated for exactly those steps). ``sampling`` (None, ``"balls_in_bins"``, ``"poisson"``) and ``amplification`` (None:
    the tightest bound proven for adaptively chosen gradients; True, False) as in ``make_private``.
    ``strategy``: None (with ``target_epsilon``: the mechanism with the least noise), a recipe
    (``blt_strategy()``, ``band_mf_strategy(bands=g)``, ``identity_strategy()``) or a name:
    ``"dp_sgd"`` (the identity), ``"band_mf:g"``, ``"blt"`` (the BLT fitted to the optimizer's
    workload, what a ``noise_multiplier`` request gets without a strategy). ``privacy_unit``: None
    (each example is a unit), one id per example, or a ``PrivacyUnits``.

    Built once from the fields: ``clipping_rule`` (the rule value) and ``units`` (the
    ``PrivacyUnits``, or None). Equality and hashing follow the meaning: the clipping rule, the unit
    assignment (a digest of every example's unit) and the other fields as given (a named strategy
    as its recipe).
    """

    target_delta: float | None = None
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    max_grad_norm: object = field(default=None, compare=False)
    clipping: str | None = field(default=None, compare=False)
    batch_size: int | None = None
    epochs: int | None = None
    steps: int | None = None
    sampling: str | None = None
    amplification: bool | None = None
    strategy: object = None
    privacy_unit: object = field(default=None, compare=False, repr=False)
    # Derived once from the fields above, for the planner and for equality.
    clipping_rule: object = field(init=False, repr=False)
    units: PrivacyUnits | None = field(init=False, repr=False, compare=False)
    unit_record: str = field(init=False, repr=False)

    def __post_init__(self):
        # The checks plan_privacy made at its top, in the same order and words.
        self._set("batch_size", integer_at_least("batch_size", self.batch_size))
        if self.steps is None:
            self._set("epochs", integer_at_least("epochs", self.epochs))
        elif self.epochs is not None:
            raise InvalidTypeError(f"give epochs (whole passes over the data) or steps (a horizon in steps, the "
                                   f"last epoch cut where it ends), not both: got epochs={self.epochs!r}, "
                                   f"steps={self.steps!r}")
        else:
            self._set("steps", integer_at_least("steps", self.steps))
        _check_sampling(self.sampling, self.amplification)
        self._set("clipping_rule", clipping_rule(self.max_grad_norm, mode=self.clipping))
        if self.target_delta is None:
            raise InvalidTypeError("make_private needs target_delta (e.g. 1e-5, below 1 / len(dataset))")
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise InvalidTypeError("give exactly one of target_epsilon (calibrate the noise) and noise_multiplier")
        if self.target_epsilon is not None:
            epsilon_budget(self.target_epsilon, self.target_delta)
        else:
            check_delta(self.target_delta, "target_delta")
            positive_finite("noise_multiplier", self.noise_multiplier)
        self._set("strategy", _strategy_of(self.strategy))
        privacy_unit, units = _units_of(self.privacy_unit)
        self._set("privacy_unit", privacy_unit)
        self._set("units", units)
        self._set("unit_record", units_record(units))

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # normalizing a frozen value while it is being built

    @property
    def calibrated(self) -> bool:
        """Whether the noise multiplier is calibrated to ``target_epsilon`` (else it is given)."""
        return self.target_epsilon is not None

    def settings(self) -> dict:
        """The fields as keyword arguments (``PrivacySpec(**spec.settings()) == spec``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def _check_sampling(sampling, amplification) -> None:
    if sampling is not None and sampling not in SAMPLINGS:
        raise PlanError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if amplification is not None and not isinstance(amplification, bool):
        raise InvalidTypeError(f"amplification must be None (the proven default), True or False, got {amplification!r}")
    if sampling == "poisson" and amplification is False:
        raise PlanError(
            "amplification=False applies to sampling='balls_in_bins'; cyclic Poisson sampling is always "
            "priced with its amplification (Band23 Thm 4). For an unamplified bound use "
            "sampling='balls_in_bins', amplification=False"
        )


def _strategy_of(strategy):
    """A named strategy's recipe ("blt" stays a name: the planner fits it to the optimizer); any
    other value as given (a recipe, or None)."""
    if not isinstance(strategy, str):
        return strategy
    name, _, bands = strategy.strip().lower().partition(":")
    if name == OPTIMIZER_BLT and not bands:
        return OPTIMIZER_BLT
    if name == "dp_sgd" and not bands:
        return identity_strategy()
    if name == "band_mf" and bands.strip().isdigit() and int(bands) >= 1:
        return band_mf_strategy(bands=int(bands))
    raise PlanError(f"strategy {strategy!r} is not a strategy opake knows by name: use one of {STRATEGY_NAMES} "
                    f"(e.g. 'band_mf:8'), a recipe (opake.dpftrl.noise.blt_strategy(), ...), or None for the "
                    f"least noise at target_epsilon")


def _units_of(privacy_unit) -> tuple:
    """``(privacy_unit, units)``: the form given (an iterator read into a list) and the assignment of
    examples to units it makes (None: each example is one). Its length is checked against the data
    set by the planner, which knows the data set (in the words of the form given)."""
    if privacy_unit is None or isinstance(privacy_unit, PrivacyUnits):
        return privacy_unit, privacy_unit
    try:
        count = len(privacy_unit)
    except TypeError:  # an iterator is read once here; privacy_units names what is no sequence
        with contextlib.suppress(TypeError):
            privacy_unit = list(privacy_unit)
        count = len(privacy_unit) if isinstance(privacy_unit, list) else 0
    return privacy_unit, privacy_units(privacy_unit, count)


def request_of(privacy: PrivacySpec | None, caller: str, **settings) -> PrivacySpec:
    """The request of a front end that takes it either whole (``privacy=``) or as keyword arguments
    (``settings``, None where not given); both at once is refused, naming the keywords."""
    if privacy is None:
        return PrivacySpec(**settings)
    if not isinstance(privacy, PrivacySpec):
        raise InvalidTypeError(f"privacy must be an opake.torch.PrivacySpec, got {type(privacy).__name__}")
    given = sorted(name for name, value in settings.items() if value is not None)
    if given:
        raise InvalidTypeError(
            f"{caller} got privacy=PrivacySpec(...) and the keyword(s) {', '.join(given)}, which the request "
            f"already settles: give the request whole or as keywords, not both (dataclasses.replace(privacy, "
            f"...) changes a field of it)")
    return privacy
