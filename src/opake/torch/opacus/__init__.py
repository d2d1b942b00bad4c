"""Opacus' interface on opake (docs/from_opacus.md): ``PrivacyEngine``, ``BatchMemoryManager``,
``ModuleValidator``, and the recurrent layers at the names Opacus gives them.

An Opacus script changes its import lines only::

    from opake.torch import PrivacyEngine                 # from opacus import PrivacyEngine
    from opake.torch import BatchMemoryManager            # from opacus.utils.batch_memory_manager import ...
    from opake.torch import ModuleValidator               # from opacus.validators import ModuleValidator
    from opake.torch import DPLSTM                        # from opacus.layers import DPLSTM
    from opake.torch.opacus import DPMultiheadAttention   # from opacus.layers import DPMultiheadAttention

One module per job: ``engine`` (the calls), ``options`` (Opacus options and the DataLoader),
``clipping`` (``clipping=`` and ``max_grad_norm``), ``unplanned`` (runs without ``epochs=``),
``keys`` (the run's key), ``no_noise`` (``noise_multiplier=0``), ``accountant``
(``privacy_engine.accountant``), ``optimizer`` (``expected_batch_size``, skipped steps,
closures, ``pre_step``, ``summed_grad``), ``batch_memory_manager``, ``checkpoint``,
``schedulers``, ``validators``, ``module_utils``.
"""

from opake.torch.opacus.attention import DPMultiheadAttention
from opake.torch.opacus.batch_memory_manager import BatchMemoryManager
from opake.torch.opacus.engine import PrivacyEngine
from opake.torch.opacus.module_utils import are_state_dict_equal
from opake.torch.opacus.no_noise import NoNoiseWarning
from opake.torch.opacus.optimizer import OpacusDPOptimizer
from opake.torch.opacus.schedulers import ScheduleChangesPlanError, StepGradClip, StepNoise
from opake.torch.opacus.unplanned import UNPLANNED_EPOCHS
from opake.torch.opacus.validators import ModuleValidator
from opake.torch.recurrent import DPGRU, DPLSTM, DPRNN

__all__ = ["DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN", "UNPLANNED_EPOCHS", "BatchMemoryManager", "ModuleValidator",
           "NoNoiseWarning", "OpacusDPOptimizer", "PrivacyEngine", "ScheduleChangesPlanError", "StepGradClip",
           "StepNoise", "are_state_dict_equal"]
