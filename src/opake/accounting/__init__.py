"""Generic privacy accounting: the process protocol, budgets, calibration, the Gaussian mechanism.

Mechanism-specific processes (matrix-factorization Gaussian, amplifiers) live in
``opake.dpftrl.accounting`` and satisfy :class:`PrivacyProcess`.
"""

from opake.accounting.budget import EpsilonBudget, epsilon_budget
from opake.accounting.calibrate import (
    CalibrationRangeError,
    CalibrationResult,
    EstimateNotAllowedError,
    calibrate,
    calibrate_near,
)
from opake.accounting.gaussian import Gaussian, gaussian
from opake.accounting.process import PrivacyProcess

__all__ = [
    "CalibrationRangeError",
    "CalibrationResult",
    "EpsilonBudget",
    "EstimateNotAllowedError",
    "Gaussian",
    "PrivacyProcess",
    "calibrate",
    "calibrate_near",
    "epsilon_budget",
    "gaussian",
]
