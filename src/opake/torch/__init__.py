"""PyTorch front end: private training with correlated noise on standard PyTorch objects.

``make_private(module=, optimizer=, dataset=, batch_size=, epochs=, target_epsilon=,
target_delta=, max_grad_norm=)`` plans the run and returns the module, a ``DPOptimizer`` and a
DataLoader for the user's unchanged loop (docs/torch.md); ``sampling=`` ("balls_in_bins" or
"poisson") and ``amplification=`` choose the sampler and its proven accountant. The privacy
settings make one frozen request, ``PrivacySpec`` (``make_private(..., privacy=spec)``,
``plan_request(spec, ...)``: ``opake.torch.request``). ``fix_model`` / ``validate_model``
deal with layers that mix examples (BatchNorm) and recurrent layers (``DPLSTM``, ``DPGRU``,
``DPRNN``: nn.LSTM's interface, clipped exactly). ``choose_mechanism`` compares the proven
mechanisms at a budget (``opake.planner.choice``). ``PrivacyEngine``, ``BatchMemoryManager`` and
``ModuleValidator`` take Opacus' calls (``opake.torch.opacus``, docs/from_opacus.md).
``make_private`` steps a plain AdamW or Adam with its second moment corrected for the noise
(DP-AdamBC floored at the noise's own variance; ``noise_correction=False`` turns it off);
``DPAdamW`` is that correction as an optimizer, with a constant floor if asked
(``opake.torch.adamw``). ``opake.torch.per_example`` is the per-example clipping engine (hooks, ghost norms)
underneath. Nothing below this package imports it.
"""

from opake.torch.opacus import BatchMemoryManager, ModuleValidator, PrivacyEngine
from opake.planner import MechanismChoice
from opake.torch.planning import choose_mechanism
from opake.torch.recurrent import DPGRU, DPLSTM, DPRNN
from opake.dpftrl.sampling import DatasetNotIndexableError, DatasetTooSmallError
from opake.torch.loader import DatasetChangedError, PlanExhaustedError, PlannedDataLoader, UnplannedBatchError
from opake.torch.losses import UnsupportedLossError, token_mean_per_example
from opake.torch.guard import DirectStepError, ForeignOptimizerError
from opake.torch.optimizer import DPOptimizer
from opake.torch.adamw import DPAdamW
from opake.torch.planning import PrivacyPlan, plan_privacy, plan_request, strategy_for_optimizer
from opake.torch.request import PrivacySpec
from opake.torch.private import PrivateTraining, make_private
from opake.torch.short_run import ShortRunWarning
from opake.torch.per_example.errors import CompiledModuleError
from opake.torch.validation import ModelValidationError, fix_model, validate_model

__all__ = [
    "BatchMemoryManager",
    "DPGRU",
    "DPLSTM",
    "DPRNN",
    "DPOptimizer",
    "DPAdamW",
    "MechanismChoice",
    "ModuleValidator",
    "choose_mechanism",
    "CompiledModuleError",
    "DatasetChangedError",
    "DatasetNotIndexableError",
    "DatasetTooSmallError",
    "DirectStepError",
    "ForeignOptimizerError",
    "ModelValidationError",
    "PlanExhaustedError",
    "PlannedDataLoader",
    "PrivacyEngine",
    "PrivacyPlan",
    "PrivacySpec",
    "PrivateTraining",
    "ShortRunWarning",
    "fix_model",
    "make_private",
    "plan_privacy",
    "plan_request",
    "UnplannedBatchError",
    "UnsupportedLossError",
    "strategy_for_optimizer",
    "token_mean_per_example",
    "validate_model",
]
