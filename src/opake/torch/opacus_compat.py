"""``PrivacyEngine``: Opacus' call shapes on top of ``make_private`` (docs/from_opacus.md).

An Opacus script switches from DP-SGD noise to BLT noise by changing its import::

    from opake.torch import PrivacyEngine          # was: from opacus import PrivacyEngine
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model, optimizer=optimizer, data_loader=train_loader, epochs=EPOCHS,
        target_epsilon=EPSILON, target_delta=DELTA, max_grad_norm=MAX_GRAD_NORM)
    for epoch in range(EPOCHS):
        for x, y in train_loader: ...              # one epoch of the plan per pass
    privacy_engine.get_epsilon(DELTA)

This is glue: the dataset and batch size come from ``data_loader``, the plan (balls-in-bins
batches, BLT noise, flat clipping by hooks) is ``make_private``'s, and ``privacy_engine.private``
is the ``PrivateTraining`` it returned (``plan``, ``state_dict()``, ``load_state_dict()``).
Opacus options that would change what is planned are refused, saying what opake does instead.
"""

from __future__ import annotations

import torch

from opake.torch.private import PrivateTraining, make_private

__all__ = ["PrivacyEngine"]

# DataLoader settings that only say how batches are loaded (not which examples): passed through.
_LOADING_OPTIONS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
                    "persistent_workers", "pin_memory_device")
_OPACUS_ACCOUNTANTS = ("prv", "rdp", "gdp")


class PrivacyEngine:
    """Opacus' ``PrivacyEngine`` interface, planning a BLT run with ``opake.torch.make_private``.

    ``accountant`` accepts Opacus' names ("prv", "rdp", "gdp") and ignores them: opake always
    prices the run with its rigorous balls-in-bins accountant (docs/accounting.md).
    ``secure_mode=True`` is refused: opake has no cryptographically secure noise sampler
    (SECURITY.md); without ``key=`` the run's key is drawn from the operating system.
    One engine plans one run; build another engine for another run.
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False):
        if accountant not in _OPACUS_ACCOUNTANTS:
            raise ValueError(f"accountant must be one of Opacus' names {_OPACUS_ACCOUNTANTS} (all mean opake's "
                             f"balls-in-bins accountant), got {accountant!r}")
        if secure_mode:
            raise ValueError(
                "secure_mode=True is not available: opake's noise comes from torch's generators seeded by a "
                "128-bit key (not a cryptographically secure sampler, SECURITY.md); leave secure_mode off and "
                "do not pass key= for a published run (the key is then drawn from the operating system)"
            )
        self.private: PrivateTraining | None = None

    def make_private(self, *, module, optimizer, data_loader, noise_multiplier, max_grad_norm, epochs=None,
                     target_delta=None, criterion=None, batch_first=True, loss_reduction="mean",
                     poisson_sampling=True, clipping="flat", noise_generator=None, grad_sample_mode="hooks",
                     wrap_model=True, rand_on_empty=False, strategy=None, lr_scheduler=None, key=None, **kwargs):
        """Opacus' noise-multiplier form: returns ``(module, optimizer, data_loader)``.

        Unlike Opacus, ``epochs=`` is required: the BLT is planned for the whole run's
        horizon (``epochs * (len(dataset) // batch_size)`` steps). ``target_delta`` is the delta
        at which ``self.private.epsilon`` is reported (default ``min(1e-5, 1 / len(dataset))``);
        ``get_epsilon(delta)`` answers for any delta. ``strategy``, ``lr_scheduler`` and ``key``
        are ``opake.torch.make_private``'s.
        """
        if epochs is None:
            raise TypeError(
                "opake's make_private needs epochs=: the BLT noise is planned for the whole run "
                "(epochs * len(data_loader) steps), which Opacus does not ask for; add epochs=EPOCHS"
            )
        return self._plan(module=module, optimizer=optimizer, data_loader=data_loader, epochs=epochs,
                          max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier, target_delta=target_delta,
                          options=dict(batch_first=batch_first, poisson_sampling=poisson_sampling,
                                       clipping=clipping, noise_generator=noise_generator,
                                       grad_sample_mode=grad_sample_mode, wrap_model=wrap_model,
                                       rand_on_empty=rand_on_empty),
                          loss_reduction=loss_reduction, strategy=strategy, lr_scheduler=lr_scheduler, key=key,
                          extra=kwargs)

    def make_private_with_epsilon(self, *, module, optimizer, data_loader, target_epsilon, target_delta, epochs,
                                  max_grad_norm, criterion=None, batch_first=True, loss_reduction="mean",
                                  poisson_sampling=True, clipping="flat", noise_generator=None,
                                  grad_sample_mode="hooks", wrap_model=True, strategy=None, lr_scheduler=None,
                                  key=None, **kwargs):
        """Calibrate the noise to ``(target_epsilon, target_delta)`` over ``epochs`` epochs.

        Returns ``(module, optimizer, data_loader)``: the caller's module (with hooks, not
        wrapped), a ``DPOptimizer``, and a loader of which each pass serves one epoch of the
        planned balls-in-bins batches (from the optimizer's next untaken step). ``criterion``
        is accepted and unused (Opacus needs it only for ghost clipping).
        """
        return self._plan(module=module, optimizer=optimizer, data_loader=data_loader, epochs=epochs,
                          max_grad_norm=max_grad_norm, target_epsilon=target_epsilon, target_delta=target_delta,
                          options=dict(batch_first=batch_first, poisson_sampling=poisson_sampling,
                                       clipping=clipping, noise_generator=noise_generator,
                                       grad_sample_mode=grad_sample_mode, wrap_model=wrap_model),
                          loss_reduction=loss_reduction, strategy=strategy, lr_scheduler=lr_scheduler, key=key,
                          extra=kwargs)

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent so far, by the steps taken, at ``delta`` (as Opacus reports it).

        ``self.private.epsilon_spent(delta)``: 0 before the first step, the whole planned run's
        epsilon (``self.private.epsilon`` at the planned delta) once every planned step is
        taken, never above it in between.
        """
        if self.private is None:
            raise ValueError("no run is planned yet: call make_private or make_private_with_epsilon first")
        return self.private.epsilon_spent(delta)

    def _plan(self, *, module, optimizer, data_loader, epochs, max_grad_norm, options, extra, target_delta,
              **make_private_arguments):
        if self.private is not None:
            raise ValueError("this PrivacyEngine has planned a run already; build a new PrivacyEngine for "
                             "another run (opake prices one planned run, it does not compose runs)")
        if extra:
            raise TypeError(f"opake's PrivacyEngine does not take {sorted(extra)} (Opacus options it does not "
                            f"implement); see docs/from_opacus.md")
        _refuse_other_options(options, max_grad_norm)
        dataset, batch_size, loader_options = _from_loader(data_loader)
        if target_delta is None and "target_epsilon" not in make_private_arguments:
            target_delta = min(1e-5, 1.0 / len(dataset))
        private = make_private(module=module, optimizer=optimizer, dataset=dataset, batch_size=batch_size,
                               epochs=epochs, max_grad_norm=max_grad_norm, target_delta=target_delta,
                               **make_private_arguments, **loader_options)
        self.private = private
        return private.module, private.optimizer, private.data_loader  # one epoch of the plan per pass



def _refuse_other_options(options: dict, max_grad_norm) -> None:
    if not options.get("poisson_sampling", True):
        raise ValueError("poisson_sampling=False is not available: opake always replaces the loader's batches "
                         "by balls-in-bins batches (every example once per epoch), which its accountant prices "
                         "for the BLT noise; drop the argument")
    if options.get("clipping", "flat") != "flat" or isinstance(max_grad_norm, (list, tuple)):
        raise ValueError(f"clipping={options.get('clipping')!r} is not available: opake clips each example's "
                         f"gradient over all parameters together (flat clipping, by hooks) to one float "
                         f"max_grad_norm; drop the argument")
    if options.get("grad_sample_mode", "hooks") != "hooks":
        raise ValueError(f"grad_sample_mode={options['grad_sample_mode']!r} is not available: opake computes "
                         f"the clipped per-example gradients with its own hooks on the module (ghost norms "
                         f"where a layer allows); drop the argument")
    if options.get("noise_generator") is not None:
        raise ValueError("noise_generator is not available: pass key=opake.random.key(seed) for a reproducible "
                         "run (it seeds the batches and the noise), or nothing for a key from the OS")
    if not options.get("batch_first", True):
        raise ValueError("batch_first=False is not available: opake's hooks take the batch along dimension 0")
    if not options.get("wrap_model", True):
        raise ValueError("wrap_model=False is not needed: opake never wraps the module, the returned module is "
                         "yours with hooks (its state_dict loads into an unwrapped copy); drop the argument")
    if options.get("rand_on_empty", False):
        raise ValueError("rand_on_empty=True is not available: an empty balls-in-bins batch is a zero-length "
                         "batch; the optimizer step still adds that step's noise")


def _from_loader(data_loader) -> tuple:
    """The dataset, batch size and loading options of the caller's DataLoader."""
    if not isinstance(data_loader, torch.utils.data.DataLoader):
        raise TypeError(f"data_loader must be a torch.utils.data.DataLoader, got {type(data_loader).__name__}")
    dataset = data_loader.dataset
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError("data_loader must read a map-style dataset with len() (indexable examples): opake puts "
                         "every example in a random bin, which needs the examples' indices")
    if data_loader.batch_size is None:
        raise ValueError("data_loader has no fixed batch_size (it was built with a batch_sampler or "
                         "batch_size=None): build it with DataLoader(dataset, batch_size=B); opake uses B as the "
                         "expected batch size of its balls-in-bins batches")
    options = {name: getattr(data_loader, name) for name in _LOADING_OPTIONS if hasattr(data_loader, name)}
    if data_loader.num_workers > 0:
        options["prefetch_factor"] = data_loader.prefetch_factor
    if data_loader.collate_fn is not torch.utils.data.default_collate:
        options["collate_fn"] = data_loader.collate_fn  # the default gives way to one allowing empty batches
    return dataset, data_loader.batch_size, options

