"""Opacus' clipping options, read into the clipping rule opake's hooks apply.

* ``clipping="flat"`` (default): one float ``max_grad_norm``, each example's gradient clipped over
  all parameters together.
* ``clipping="per_layer"``: ``max_grad_norm`` a list with one bound per trainable parameter, in
  ``module.parameters()`` order (as Opacus: ``[C] * len([p for p in model.parameters() if
  p.requires_grad])``); each parameter's per-example gradient is clipped to its own bound
  (``opake.dpftrl.clipping.PerLayerClipping``). One example's clipped gradient then has norm at
  most ``sqrt(sum C_p^2)``, the sensitivity the noise is scaled to and the run is priced at, as
  Opacus does (``optimizer.max_grad_norm`` is that bound).
* ``clipping="adaptive"``: flat clipping to a bound that starts at ``max_grad_norm`` and follows a
  quantile of the norms (``opake.torch.opacus.adaptive``).
"""

from __future__ import annotations

from torch import nn

from opake.dpftrl.clipping import PerLayerClipping
from opake.errors import InvalidArgumentError

__all__ = ["CLIPPINGS", "clipping_of"]

CLIPPINGS = ("flat", "per_layer", "adaptive")


def clipping_of(clipping: str, max_grad_norm, module: nn.Module):
    """The bound or clipping rule value ``make_private`` plans with, for Opacus' ``clipping`` and
    ``max_grad_norm`` over ``module``'s trainable parameters (module docstring)."""
    listed = isinstance(max_grad_norm, (list, tuple))
    if clipping in ("flat", "adaptive"):  # adaptive: max_grad_norm is the first step's bound (adaptive.py)
        if listed:
            raise InvalidArgumentError(
                "clipping='flat' takes one float max_grad_norm (the bound on each example's whole gradient); "
                "a list of bounds, one per parameter, is clipping='per_layer'"
            )
        return max_grad_norm
    if clipping == "per_layer":
        names = [name for name, param in module.named_parameters() if param.requires_grad]
        if not listed or len(max_grad_norm) != len(names):
            given = f"a list of {len(max_grad_norm)}" if listed else repr(max_grad_norm)
            raise InvalidArgumentError(
                f"clipping='per_layer' takes max_grad_norm as a list of one bound per trainable parameter "
                f"({len(names)} here, in module.parameters() order), got {given}: pass "
                f"[C] * {len(names)} for the same bound everywhere"
            )
        return PerLayerClipping(tuple(zip(names, max_grad_norm)))
    raise InvalidArgumentError(
        f"clipping must be one of {CLIPPINGS} (Opacus' names), got {clipping!r}: 'flat' clips each example's "
        f"gradient over all parameters to one bound, 'per_layer' each parameter to its own, 'adaptive' to a bound "
        f"that follows a quantile of the norms"
    )
