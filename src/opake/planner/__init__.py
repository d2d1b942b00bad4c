"""The planner: which mechanism a private run uses and with how much noise, decided once.

Below the PyTorch front end, above accounting and sampling. One request in (the run's shape, the
budget, the optimizer's workload recipe, the restrictions the user stated), one decision out:

* ``choose_mechanism`` (``choice``): the mechanism with the least noise on the workload among
  those proven for adaptively chosen gradients: BLT on balls in bins, BandMF with cyclic Poisson
  sampling (its bands from ``bands``), DP-SGD with Poisson sampling or on balls in bins;
* ``calibrate_noise`` / ``price_noise`` (``calibration``): an accountant's noise multiplier,
  by the search its accounting method needs (``CALIBRATIONS``, a registry by method), cached;
* ``cyclic_poisson_bands`` and the band candidates (``bands``): BandMF's band count;
* ``Workload`` (``workload``): the noise's path into the model, the error candidates are ranked on;
* ``plan_run`` / ``plan_dataset`` (``comparison``): the ``opake plan`` command's tables;
* every search range, grid and tolerance in ``constants``.

The accountants themselves are built in one place, ``opake.dpftrl.accounting.accountant``
(``balls_in_bins_accountant``, ``poisson_accountant``), which the samplers also call: a candidate
carries the accountant the plan will build, and the plan takes the choice's priced process as is.
"""

from opake.errors import PlanError
from opake.planner.bands import BandCandidate, band_candidates, cyclic_poisson_bands
from opake.planner.calibration import CALIBRATIONS, NoiseMultiplier, calibrate_noise, price_noise
from opake.planner.choice import Candidate, MechanismChoice, choose_mechanism
from opake.planner.comparison import Plan, PlanRow, plan_dataset, plan_run
from opake.planner.constants import MAX_STATE_ROWS
from opake.planner.runs import DatasetRun
from opake.planner.workload import Workload, workload_of

__all__ = [
    "CALIBRATIONS",
    "MAX_STATE_ROWS",
    "BandCandidate",
    "Candidate",
    "DatasetRun",
    "MechanismChoice",
    "NoiseMultiplier",
    "Plan",
    "PlanError",
    "PlanRow",
    "Workload",
    "band_candidates",
    "calibrate_noise",
    "choose_mechanism",
    "cyclic_poisson_bands",
    "plan_dataset",
    "plan_run",
    "price_noise",
    "workload_of",
]
