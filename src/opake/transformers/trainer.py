"""``DPTrainer``: ``transformers.Trainer`` training on a privacy plan's batches with correlated noise.

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=train_ds,
                        data_collator=collator, target_epsilon=3.0, target_delta=1e-5,
                        key=opake.random.key(0))
    trainer.train()
    trainer.private.epsilon

or, with the request in the arguments (a command line's ``--target_epsilon 3 --target_delta 1e-5``)::

    args = DPTrainingArguments(..., target_epsilon=3.0, target_delta=1e-5, privacy_seed=0)
    trainer = DPTrainer(model=model, args=args, train_dataset=train_ds, data_collator=collator)

A subclass, not a wrapper: every Trainer feature that does not touch the guarantee (callbacks,
evaluation, logging, checkpoints, the hub) keeps working, and only the pieces that do are
replaced. ``__init__`` checks the arguments against one table (``opake.transformers.arguments``),
builds Trainer's optimizer and calls ``opake.torch.make_private`` on the model, that optimizer
and the training set, so the plan (and epsilon) exists before ``train()``. Then:

* **Batches.** ``get_train_dataloader`` returns the plan's per-epoch loader (``private.data_loader``:
  each pass serves the steps from the next untaken one to the end of its epoch); Trainer runs
  with ``gradient_accumulation_steps=1`` over it, one optimizer step per planned batch.
* **Micro-batches.** ``training_step`` cuts each planned batch into micro-batches of at most
  ``per_device_train_batch_size`` examples (``batches.micro_batches``), forward and backward on
  each; an empty planned batch has none, and its step releases noise only. The planned expected
  batch size is ``per_device_train_batch_size x gradient_accumulation_steps``, so accumulation
  keeps its Trainer meaning (more examples per step, the same memory).
* **Users.** With ``privacy_unit=`` (one user id per training example; ``make_private``'s) the
  plan samples users: ``per_device_train_batch_size x gradient_accumulation_steps`` is then the
  expected number of *users* per step, and micro-batches are cut at user boundaries
  (``batches.unit_micro_batches``): whole users packed into at most
  ``per_device_train_batch_size`` rows, a user with more rows than that alone in a larger one.
* **Loss.** ``compute_loss`` is Trainer's without ``num_items_in_batch``: the model's loss is the
  per-example form ``make_private`` installs (``opake.torch.losses``).
* **Clipping.** ``args.max_grad_norm`` is the per-example clipping norm; Trainer's own clipping of
  the summed ``.grad`` and its ``grad_norm`` log (the norm of the unclipped, un-noised gradient,
  a release the accountant never priced) are turned off.
* **Steps.** The plan has ``num_train_epochs`` epochs; with ``max_steps > 0`` (Trainer's horizon in
  steps) it has exactly ``max_steps`` steps (``PrivacySpec(steps=)``), the last epoch cut where they
  end, and the noise is calibrated to the budget for those steps.
* **Logs.** Every log carries ``epsilon`` (spent by the steps taken so far,
  ``private.epsilon_spent()``), ``epsilon_planned`` (the whole planned run's guarantee), ``delta``
  and ``noise_multiplier``, also in the metrics ``train()`` and ``evaluate()`` return. Evaluation
  runs on a fork of torch's random generators, so that it never shifts training's dropout masks.
* **Checkpoints.** Each checkpoint folder gets ``opake_private.pt`` (``private.state_dict()``:
  model, optimizer, noise state, step, key; and the SHA-256 of every file Trainer wrote there),
  written atomically after Trainer's files and before Trainer rotates old checkpoints away, so a
  kill at any moment leaves the last complete checkpoint resumable. ``train(resume_from_checkpoint=
  folder or True)`` verifies every file before anything loads; it replays the draws by itself
  only from the last complete checkpoint of this run's ``output_dir`` (the same run continuing),
  and otherwise needs ``draws="replay"`` or ``fresh_key=k`` (SECURITY.md, "Replaying or redrawing
  noise"). A worker restarted by torchrun resumes from that checkpoint by itself.

Trainer runs on a copy of the given TrainingArguments with ``gradient_accumulation_steps=1``,
``max_grad_norm=0`` and ``ignore_data_skip=True`` (the caller's object is not modified; it is
``trainer.private_args``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings

import torch
import transformers
from torch import nn
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, seed_worker
from transformers.utils import is_datasets_available

from opake.errors import InvalidStateError, InvalidTypeError
from opake.random import RngKey
from opake.torch import PrivacySpec, make_private
from opake.torch.checkpoint import CheckpointError, whole_digest
from opake.torch.contract import RestartedWorkerError
from opake.torch.loader import PlanExhaustedError
from opake.torch.ranks import LauncherWorldError, agree, launched_world_size, launcher_restarts
from opake.torch.short_run import warn_if_short
from opake.transformers.arguments import (ARGUMENT_RULES, UnsupportedTrainingArgumentError, check_arguments,
                                         is_constructor_rule, with_launcher_settings)
from opake.transformers.checkpoints import (CHECKPOINT_NAME, IncompleteCheckpointError, ResumeChoiceError,
                                           TRAINER_FILES, TRAINER_STATE, check_file_digests, check_same_step,
                                           checkpoint_name, file_digests, is_newest_folder, last_complete_checkpoint,
                                           missing_parts, write_atomically)
from opake.transformers.batches import (EmptyBatchCollator, batch_size_of, lockstep_micro_batches, micro_batches,
                                        unit_micro_batches)
from opake.transformers.training_arguments import privacy_settings

__all__ = ["CHECKPOINT_NAME", "DPTrainer", "IncompleteCheckpointError", "PrivateTrainerMixin", "ResumeChoiceError"]

class _PlannedEpochs:
    """What Trainer's loop reads of a train dataloader: ``len`` (steps per epoch, whatever the
    epoch's progress) and ``iter`` (one pass of the planned loader: the rest of the epoch).

    ``restore_rng`` (set on a resume inside an epoch) is called once, right after the first
    pass has created its DataLoader iterator: that creation draws a seed from torch's global
    generator, which an uninterrupted run drew at the start of the epoch, before the
    checkpoint's RNG state was saved. Restoring after it keeps dropout's draws, and so the
    resumed run, bit-identical.
    """

    def __init__(self, private, dataset):
        self.private = private
        self.dataset = dataset
        self.restore_rng = None

    def __len__(self) -> int:
        return self.private.plan.steps_per_epoch

    def __iter__(self):
        batches = iter(self.private.data_loader)
        restore, self.restore_rng = self.restore_rng, None
        return batches if restore is None else _restored_after_first(batches, restore)


def _restored_after_first(batches, restore):
    first = next(batches, _END)  # creates the DataLoader iterator (one draw from torch's generator)
    restore()
    if first is not _END:
        yield first
        yield from batches


_END = object()


class _EpochOfPlan(TrainerCallback):
    """``state.epoch`` from the plan's step: Trainer counts it from the batches of this call's
    pass, which after a resume starts inside an epoch (Trainer skips no batches: ignore_data_skip)."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch

    def on_step_end(self, args, state, control, **kwargs):
        state.epoch = state.global_step / self.steps_per_epoch


class _ShardedScheduler(TrainerCallback):
    """Restores a sharded run's scheduler state, which its private file carries (Trainer saves none
    with ``save_only_model``), once Trainer has built the scheduler."""

    def __init__(self):
        self.scheduler_state = None  # read from the checkpoint until Trainer builds the scheduler

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.scheduler_state is not None and lr_scheduler is not None:
            lr_scheduler.load_state_dict(self.scheduler_state)
            # Building the scheduler set the optimizer's rates to the first step's; a loaded
            # scheduler sets them only at its next step, after the resumed run's first update.
            for group, rate in zip(lr_scheduler.optimizer.param_groups, lr_scheduler.get_last_lr()):
                group["lr"] = rate
            self.scheduler_state = None


def _require_one_trainer_world(args) -> None:
    """Trainer and the launcher count the same processes: refuse when Trainer sees one process
    (``args.world_size`` 1) but the launcher started several (``WORLD_SIZE``) or a process group of
    several is initialized. On CPU without ``use_cpu`` transformers does not set up distributed
    training: each process would run Trainer as the only one (each saving into the same
    ``output_dir``), and the plan's batch would be one process's."""
    import torch.distributed as dist

    grouped = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    launched = max(grouped, launched_world_size())
    if args.world_size == 1 and launched > 1:
        raise LauncherWorldError(
            f"the launcher started {launched} processes, but transformers sees one (TrainingArguments.world_size "
            f"is 1: on CPU it sets up distributed training only with use_cpu=True): each process would train as "
            f"if it were alone, saving into the same output_dir. Pass --use_cpu (TrainingArguments(use_cpu=True)) "
            f"on CPU, or run one process")


class PrivateTrainerMixin:
    """Makes a ``transformers.Trainer`` subclass train on the privacy plan of ``make_private``.

    Put it first: ``class MyTrainer(PrivateTrainerMixin, transformers.Trainer)`` (``DPTrainer``
    is exactly that; TRL's trainers take it the same way). It takes the parent trainer's
    arguments unchanged, plus the privacy settings, keyword-only (``DPTrainer`` lists them) or as
    the fields of ``args`` (``DPTrainingArguments``, ``opake.transformers.training_arguments``),
    which it makes into one ``PrivacySpec`` with the batch size and epochs of ``args`` (or its
    ``max_steps``), and works
    through Trainer's public seams (``get_train_dataloader``, ``get_batch_samples``,
    ``training_step``, ``compute_loss``, ``log``, ``train``, callbacks) and one private method,
    ``_save_checkpoint`` (TRL's trainers override it too): the only place where a file can join
    Trainer's checkpoint after Trainer's own files and before its rotation deletes older ones.

    A subclass for another trainer (``opake.transformers.trl``) sets ``argument_rules`` (the table
    its arguments are checked against) and ``loss_reduction``, and may override
    ``default_arguments``, ``arguments_of_trainer`` (the config the parent will read),
    ``check_trainer_setup`` (refusals of what the parent's ``__init__`` set up, before any hook),
    ``examples_in`` (the plan's examples in a collated batch), ``micro_batch_parts`` and
    ``loss_to_clip`` (what each micro-batch backpropagates).
    """

    # The rows every argument is checked against (a TRL trainer adds its config's), and how the
    # loss that training_step backpropagates combines the examples of a micro-batch.
    argument_rules = ARGUMENT_RULES
    loss_reduction = "mean"

    def __init__(self, *args, target_delta: float | None = None, target_epsilon: float | None = None,
                 noise_multiplier: float | None = None, strategy=None, sampling: str | None = None,
                 amplification: bool | None = None, key=None, privacy_unit=None, clipping=None,
                 noise_correction: bool | None = None, **kwargs):
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        run_args = arguments.get("args")
        if run_args is None:
            run_args = self.default_arguments()
        if not isinstance(run_args, transformers.TrainingArguments):
            raise InvalidTypeError(f"args must be a transformers.TrainingArguments, got {type(run_args).__name__}")
        # The privacy settings: DPTrainingArguments' fields (a command line's) or these keywords.
        settings = privacy_settings(run_args, dict(
            target_delta=target_delta, target_epsilon=target_epsilon, noise_multiplier=noise_multiplier,
            strategy=strategy, sampling=sampling, amplification=amplification, clipping=clipping, key=key,
            noise_correction=noise_correction), type(self).__name__)
        key, noise_correction = settings.pop("key"), settings.pop("noise_correction")
        run_args = with_launcher_settings(self.arguments_of_trainer(run_args))
        _require_one_trainer_world(run_args)
        if arguments.get("model") is None:
            raise InvalidTypeError(f"{type(self).__name__} needs model= (the model make_private hooks)")
        given = {**arguments, "privacy_unit": privacy_unit}  # the constructor's, and the plan's that rows name
        check_arguments(run_args, {rule.name: given[rule.name] for rule in self.argument_rules
                                   if is_constructor_rule(rule) and rule.name in given}, rules=self.argument_rules)
        self.private_args = run_args
        if run_args.fsdp:  # sharded here, before planning; Trainer then leaves the model as it is
            _fully_shard(arguments["model"], run_args)
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
            # accelerate launch's FSDP, read above: the Accelerator Trainer builds must not wrap the
            # model again after planning (on one process there is nothing to shard)
            os.environ["ACCELERATE_USE_FSDP"] = "false"
        arguments["args"] = dataclasses.replace(run_args, gradient_accumulation_steps=1, max_grad_norm=0.0,
                                                ignore_data_skip=True, fsdp="", fsdp_config=None)
        super().__init__(**arguments)
        if getattr(self, "is_fsdp_enabled", False):
            raise UnsupportedTrainingArgumentError(
                "Trainer's accelerator would wrap the model in FSDP after make_private planned it (an FSDP plugin "
                "given to accelerate directly): ask for FSDP through TrainingArguments(fsdp=...) or accelerate "
                "launch --use_fsdp, which DPTrainer reads and shards itself")
        self.check_trainer_setup()  # what the parent trainer decided in its __init__; nothing is hooked yet
        self.micro_batch_size = int(run_args.per_device_train_batch_size)
        # Trainer's global batch: per device, times accumulation, times the processes (each serves its part).
        # Read after the parent's __init__, whose Accelerator settles the processes: check_arguments' default
        # TrainingArguments resets accelerate's shared state, and world_size reads 1 until then.
        batch_size = self.micro_batch_size * int(run_args.gradient_accumulation_steps) * int(run_args.world_size)
        request = PrivacySpec(batch_size=batch_size, epochs=int(run_args.num_train_epochs),
                              max_grad_norm=run_args.max_grad_norm, privacy_unit=privacy_unit, **settings)
        dataset, collate = self._planned_dataset_and_collator(self.train_dataset)
        # max_steps > 0: the plan's horizon is max_steps, the last epoch cut where they end
        self._max_steps = int(run_args.max_steps) if run_args.max_steps > 0 else None
        if self._max_steps is not None:
            request = dataclasses.replace(request, epochs=None, steps=self._max_steps)
        optimizer = self.create_optimizer()  # Trainer's (or the one passed in optimizers=)
        # The scheduler passed in optimizers=, or the one Trainer will build for the plan's length.
        lr_scheduler = self.lr_scheduler or _TrainerSchedule(self.args)
        # Kept to plan again with a checkpoint's key (train(resume_from_checkpoint=...) of a run
        # built without key=): the same arguments, the same objects.
        self._plan_arguments = dict(
            module=self.model, optimizer=optimizer, dataset=dataset, privacy=request, lr_scheduler=lr_scheduler,
            loss_reduction=self.loss_reduction, noise_correction=noise_correction, **self._loader_options(collate))
        self._key_given = key is not None
        self.private = make_private(**self._plan_arguments, key=key)
        self.optimizer = self.private.optimizer
        if self._max_steps is not None and self._max_steps != self.private.plan.n_steps:
            raise InvalidStateError(  # the plan's horizon is the request's: anything else is a bug
                f"the plan has {self.private.plan.n_steps} steps, not max_steps={self._max_steps}; pass "
                f"num_train_epochs instead of max_steps, and report this")
        self._resumed_from = None  # the checkpoint folder train() resumes from, until its loader exists
        self.add_callback(_EpochOfPlan(self.private.plan.steps_per_epoch))
        self._sharded_scheduler = _ShardedScheduler()
        self.add_callback(self._sharded_scheduler)

    def default_arguments(self) -> transformers.TrainingArguments:
        """The arguments used when ``args=None`` (Trainer's default: ``output_dir="tmp_trainer"``)."""
        return transformers.TrainingArguments(output_dir="tmp_trainer")

    def arguments_of_trainer(self, args: transformers.TrainingArguments) -> transformers.TrainingArguments:
        """``args`` as the parent trainer will read them (a TRL trainer converts plain
        TrainingArguments to its config), so that the table checks what will run."""
        return args

    def check_trainer_setup(self) -> None:
        """Refuse what the parent trainer's ``__init__`` set up that breaks the guarantee; called
        after it, before ``make_private`` hooks the model (nothing has trained or been released)."""

    # -- the plan's data ----------------------------------------------------------------------

    def _planned_dataset_and_collator(self, dataset):
        """The training set and collator as Trainer's own loader would use them (unused columns
        removed), with empty planned batches collated."""
        collate = self.data_collator
        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
                return dataset, EmptyBatchCollator(collate, dataset)
        return dataset, EmptyBatchCollator(self._get_collator_with_removed_columns(collate, "training"), dataset)

    def _loader_options(self, collate) -> dict:
        """The DataLoader options Trainer gives its own training loader (its ``_get_dataloader``)."""
        args = self.args
        return {"collate_fn": collate, "num_workers": args.dataloader_num_workers,
                "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
                "multiprocessing_context": args.dataloader_multiprocessing_context,
                "prefetch_factor": args.dataloader_prefetch_factor, "in_order": args.dataloader_in_order,
                "worker_init_fn": _WorkerSeed(args.dataloader_num_workers, args.process_index)}

    def get_train_dataloader(self):
        """The plan's loader: each pass (one Trainer epoch) serves the rest of the current epoch."""
        loader = _PlannedEpochs(self.private, self.private.data_loader.dataset)
        if self._resumed_from is not None:
            folder, self._resumed_from = self._resumed_from, None
            if self.private.steps_taken % self.private.plan.steps_per_epoch:
                # Inside an epoch: an uninterrupted run created this epoch's iterator before the
                # checkpoint (at an epoch's start it does so after, as the resumed run does).
                loader.restore_rng = lambda: self._load_rng_state(folder)
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's prefetch of the next batch, without ``num_items_in_batch`` (a batch-wide token
        count: dividing by it lets one example rescale the others' gradients)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, None

    # -- one step ---------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs, num_items_in_batch=None) -> torch.Tensor:
        """Forward and backward over the micro-batches of ONE planned batch; Trainer then steps.

        Returns the batch's mean loss (0 for an empty batch), for Trainer's log.
        """
        model.train()
        self.private.optimizer.zero_grad()  # one planned batch per step: nothing else is summed in it
        inputs = self._prepare_inputs(inputs)
        size = self.examples_in(inputs)
        total = torch.zeros((), device=self.args.device)
        with _without_gradient_sync(model):
            for part, placeholder in self.micro_batch_parts(inputs, size):
                if placeholder:
                    self.private.optimizer.clipper.expect_placeholder()
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(model, part)
                self.accelerator.backward(self.loss_to_clip(loss, part))
                if not placeholder:
                    total = total + loss.detach().float() * self.examples_in(part)
        return total / max(size, 1)

    def examples_in(self, batch) -> int:
        """The examples of the plan in a collated batch (its rows; a preference trainer's pairs)."""
        return batch_size_of(batch)

    def micro_batch_parts(self, inputs, size: int) -> list:
        """``(micro-batch, is_placeholder)`` pairs of one planned batch of ``size`` examples: whole
        users together with privacy units, lockstep parts on a sharded model."""
        run = self.private.run
        if self.private.sharded:  # every rank runs the same passes (FSDP's collectives)
            return self._lockstep_parts(inputs, size)
        units = None if run.state.served is None else run.batches.units(run.state.served)
        parts = (micro_batches(inputs, size, self.micro_batch_size) if units is None
                 else unit_micro_batches(inputs, size, self.micro_batch_size, units))
        return [(part, False) for part in parts]

    def loss_to_clip(self, loss: torch.Tensor, part) -> torch.Tensor:
        """What ``training_step`` backpropagates for a micro-batch whose ``compute_loss`` is
        ``loss``: the loss itself, the mean over its examples (``loss_reduction="mean"``)."""
        return loss

    def _lockstep_parts(self, inputs, size: int) -> list:
        """The micro-batches of a sharded run: as many on every rank as the largest part needs (each
        rank computes every rank's part of the planned batch from the plan; no collective)."""
        run = self.private.run
        step, world_size = run.state.served, run.batches.part[1]
        largest = max(len(run.batches.sampler.part_of_batch(step, (rank, world_size))) for rank in range(world_size))
        passes = max(1, -(-largest // self.micro_batch_size))
        return lockstep_micro_batches(inputs, size, passes, placeholder_only=not run.batches.indices(step))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's loss (the model's per-example ``outputs.loss``), never with ``num_items_in_batch``.

        Training never passes one (``get_batch_samples``); evaluation's (``prediction_step``)
        is dropped too, so that the evaluation loss has the training loss's per-example form.
        """
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=None)

    def evaluate(self, *args, **kwargs):
        """Trainer's ``evaluate``, on a fork of torch's random generators: its DataLoader draws a seed
        from the global generator, which would shift every later dropout mask of training, so that a
        run evaluated every N steps would train another model than the same run without evaluation."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return super().evaluate(*args, **kwargs)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """Trainer's log with the guarantee so far (``epsilon``), the planned one, ``delta`` and sigma
        (added to ``logs`` itself, without Trainer's ``grad_norm``)."""
        # In place: Trainer returns the dict it logged at the end of train() (TrainOutput.metrics) and of
        # evaluate(), so a script's log_metrics("train", metrics) and save_metrics show the epsilon too.
        logs.pop("grad_norm", None)
        logs.update(epsilon=self.private.epsilon_spent(), epsilon_planned=self.private.plan.epsilon,
                    delta=self.private.delta, noise_multiplier=self.private.noise_multiplier)
        super().log(logs, start_time)

    # -- checkpoints ------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model``; a model DPTrainer sharded (``fsdp``) is saved whole: every rank
        gathers each parameter (a collective, so every rank calls this, as Trainer's checkpoints
        do) and the main process writes one ``save_pretrained`` folder, loadable in one process."""
        from torch.distributed.tensor import DTensor

        if not self.private.sharded:
            return super().save_model(output_dir, _internal_call=_internal_call)
        whole = {name: value.full_tensor() if isinstance(value, DTensor) else value
                 for name, value in self.model.state_dict().items()}
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.model.save_pretrained(output_dir, state_dict=whole, is_main_process=True)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint, completed by every rank's private file before old checkpoints go.

        Trainer writes its files, then rotates (``save_total_limit``) at the end of this method,
        and only then calls the callbacks' ``on_save``: a private file written there comes after
        the older checkpoints were deleted, and a kill in between leaves none to resume from. So
        the rotation waits: Trainer saves with ``save_total_limit`` held back, every rank writes
        its private file (atomically), and once every rank's is there the main process rotates.
        Both Trainer's periodic saves and its SIGTERM save (``enable_jit_checkpoint``) come here.
        """
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # Trainer's own rotation, at the end of its save, keeps everything
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.accelerator.wait_for_everyone()  # every rank's Trainer files are written: the digests see them all
        if not self.args.save_only_model or self.private.sharded:
            self._write_private_file(folder)
        self.accelerator.wait_for_everyone()  # every rank's private file is in place: the folder is complete
        if self.args.should_save:
            rotate_checkpoints(self.args.output_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _write_private_file(self, folder: str) -> None:
        """This rank's ``private.state_dict()``, with the digests of Trainer's files in ``folder``.

        Written with the optimizer (not with ``save_only_model``), except by a sharded run, which
        checkpoints only that way (Trainer cannot save its sharded optimizer state): each rank's
        file then holds its shards of the model and optimizer state, and the scheduler's state,
        which Trainer does not save. The run's digest is recomputed over all of it.
        """
        saved = self.private.state_dict()
        if self.private.sharded and self.lr_scheduler is not None:
            saved["lr_scheduler"] = self.lr_scheduler.state_dict()
        os.makedirs(folder, exist_ok=True)  # a rank that wrote none of Trainer's files may not have made it
        saved[TRAINER_FILES] = file_digests(folder)
        saved["digest"] = whole_digest(saved)
        write_atomically(saved, os.path.join(folder, checkpoint_name(self.args)))

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, *, draws: str | None = None,
              fresh_key=None):
        """Trainer's ``train``, resuming a private run only from a complete, intact checkpoint.

        ``resume_from_checkpoint=True`` resumes from the newest complete checkpoint of
        ``output_dir`` (newer folders whose save was cut short are skipped, with a warning); a
        folder given explicitly must be complete. Every file of the checkpoint is checked
        against the digests its private file recorded before anything is loaded.

        Draws: without ``draws=`` or ``fresh_key=``, a resume from the last complete checkpoint
        of this run's own ``output_dir`` replays the saved draws (``draws="replay"``): the same
        run continuing after a crash, whose steps after the checkpoint were either never
        released or, recomputed from the same state, data and kernels with bit-identical
        gradients, are released again identically. The residual risk: if something computed
        after the checkpoint was released (a pushed or evaluated model, a step's output) and the
        recomputed gradients differ in any bit (other hardware, kernels or library versions,
        a changed data set), the two releases of one draw subtract to a difference with no
        noise. From any other checkpoint (an older one, another run's) the choice is refused
        until made: ``draws="replay"`` or ``fresh_key=opake.random.key(...)`` (SECURITY.md,
        "Replaying or redrawing noise").

        Key: a DPTrainer built without ``key=`` (a key drawn from the operating system) plans
        again with the checkpoint's key before anything trains; one built with another
        ``key=`` than the checkpoint's is refused.

        A worker restarted by its launcher (``TORCHELASTIC_RESTART_COUNT`` > 0) whose script
        calls ``train()`` without ``resume_from_checkpoint`` resumes from the last complete
        checkpoint of ``output_dir`` (replaying, with a warning), and is refused when there is
        none: planning afresh would spend the budget a second time. ``resume_from_checkpoint=False``
        says, deliberately, to train a new run from the start (its privacy cost adds up with the
        earlier attempt's; give it a new ``output_dir``).
        """
        if trial is not None:
            raise UnsupportedTrainingArgumentError(
                "DPTrainer does not run hyperparameter trials: every trial trains on the private data, and "
                "their privacy cost adds up (tune on public or held-out data, or account for the search)")
        folder = self._checkpoint_to_resume(resume_from_checkpoint)
        if folder is None:
            if draws is not None or fresh_key is not None:
                raise InvalidTypeError("draws= and fresh_key= choose how a resumed run draws its noise; pass them with "
                                       "resume_from_checkpoint=")
            if self.private.steps_taken > 0:
                raise PlanExhaustedError(
                    f"this DPTrainer's plan has taken {self.private.steps_taken} of its "
                    f"{self.private.plan.participation.n_steps} steps; train() again would start Trainer over on "
                    f"a consumed plan. Resume from a checkpoint (resume_from_checkpoint=..., draws=...) or build "
                    f"a new DPTrainer (a new plan, whose privacy cost adds up with this one's)")
            if resume_from_checkpoint is False and launcher_restarts():
                self.private.new_run_after_restart()  # the caller's deliberate choice (docstring)
        else:
            self._resume_private_run(folder, draws, fresh_key)
            self._resumed_from = folder
        result = super().train(resume_from_checkpoint=folder, ignore_keys_for_eval=ignore_keys_for_eval)
        # Trainer runs the whole plan, or max_steps of it; fewer steps mean a callback stopped it.
        if self._max_steps is None or self.private.steps_taken < self._max_steps:
            warn_if_short(self.private, f"{type(self).__name__}.train() returned early")
        return result

    def _checkpoint_to_resume(self, requested) -> str | None:
        """The folder ``train(resume_from_checkpoint=requested)`` resumes from, or None."""
        output_dir, world_size = self.args.output_dir, self.args.world_size
        if requested is False:
            return None
        if requested is None:
            return self._checkpoint_of_restarted_worker()
        if requested is True:
            folder = last_complete_checkpoint(output_dir, world_size)
            if folder is None:
                raise IncompleteCheckpointError(
                    f"no complete checkpoint in {output_dir} to resume from (a complete one holds "
                    f"{TRAINER_STATE} and every rank's {CHECKPOINT_NAME})")
            return folder
        folder = os.fspath(requested)
        missing = missing_parts(folder, world_size)
        if missing and is_newest_folder(folder, output_dir):
            # What a stock script passes (transformers' get_last_checkpoint: the newest folder, complete
            # or not): a save cut short there leaves the last complete checkpoint as the run's latest.
            last = last_complete_checkpoint(output_dir, world_size)
            if last is not None:
                return last
        if missing:
            last = last_complete_checkpoint(output_dir, world_size, warn=False)
            raise IncompleteCheckpointError(
                f"{folder} is not a complete checkpoint of a private run: it lacks {', '.join(missing)} (a save "
                f"cut short, one with save_only_model=True, or a folder no DPTrainer wrote); a private run resumes "
                f"only with its noise state. The last complete checkpoint of {output_dir} is {last} "
                f"(resume_from_checkpoint=True picks it). Nothing was loaded")
        return folder

    def _checkpoint_of_restarted_worker(self) -> str | None:
        """None for a first launch; for a worker the launcher restarted, the last complete checkpoint
        of ``output_dir`` (or a refusal: its first life may have released steps)."""
        restarts = launcher_restarts()
        if not restarts:
            return None
        folder = last_complete_checkpoint(self.args.output_dir, self.args.world_size)
        if folder is None:
            raise RestartedWorkerError(
                f"the launcher restarted this worker (TORCHELASTIC_RESTART_COUNT={restarts}) and "
                f"{self.args.output_dir} holds no complete checkpoint to resume from: its first life may have "
                f"released steps, and planning afresh would spend the privacy budget a second time while reporting "
                f"one run's epsilon. To start over deliberately (the two attempts' privacy costs add up), call "
                f"train(resume_from_checkpoint=False) with a new output_dir. Nothing was trained")
        warnings.warn(f"the launcher restarted this worker (TORCHELASTIC_RESTART_COUNT={restarts}): resuming from "
                      f"{folder}, the last complete checkpoint of output_dir, replaying its draws (draws='replay'; "
                      f"train(resume_from_checkpoint=False) starts a new run instead)", stacklevel=4)
        return folder

    def _resume_private_run(self, folder: str, draws, fresh_key) -> None:
        """Check the checkpoint whole (draw choice, private file, Trainer's files, key), every rank
        alike, before anything is loaded; then adopt its key if needed and load the private state."""
        failure, saved, key = None, None, None
        try:
            draws = self._draw_choice(folder, draws, fresh_key)
            saved = self._read_private_file(folder)
            self._check_trainer_files(folder, saved)
            check_same_step(folder, saved)
            key = self._key_to_adopt(saved["key"])
        except Exception as error:
            failure = error
        # every rank refuses together (a rank left alone would wait in Trainer's first collective)
        agree(None, self.args.world_size, failure, checkpoint=os.path.basename(os.path.normpath(folder)))
        if key is not None:
            self._plan_again(key)
        self.private.load_state_dict(saved, draws=draws, fresh_key=fresh_key)
        self._sharded_scheduler.scheduler_state = saved.get("lr_scheduler")  # a sharded run's

    def _draw_choice(self, folder: str, draws, fresh_key) -> str | None:
        """``draws`` as given; or "replay" when neither is given and ``folder`` is the last complete
        checkpoint of this run's ``output_dir`` (``train``'s docstring says why that is safe)."""
        if draws is not None and fresh_key is not None:
            raise ResumeChoiceError("pass one of draws='replay' and fresh_key=..., not both")
        if draws is not None or fresh_key is not None:
            return draws
        last = last_complete_checkpoint(self.args.output_dir, self.args.world_size, warn=False)
        if last is not None and os.path.samefile(last, folder):
            return "replay"
        raise ResumeChoiceError(
            f"{folder} is not the last complete checkpoint of this run's output_dir ({last}), so the steps after "
            f"it may have been released already: resuming from it needs exactly one of draws='replay' (the steps "
            f"after the checkpoint redraw the same noise: safe only if nothing after the checkpoint was released, "
            f"or their gradients are bit-identical) and fresh_key=opake.random.key(...) (new noise: a second "
            f"release of those steps that the accounting must count); SECURITY.md, 'Replaying or redrawing noise'")

    def _read_private_file(self, folder: str) -> dict:
        """This rank's private file, read (not loaded into anything) and checked against its digest."""
        path = os.path.join(folder, checkpoint_name(self.args))
        try:
            saved = torch.load(path, weights_only=True, map_location="cpu")
        except FileNotFoundError:  # removed since the folder was found complete: not a corruption
            raise
        except Exception as error:
            raise CheckpointError(f"{path} cannot be read ({type(error).__name__}): it was corrupted (a flipped bit, "
                                  f"a truncated copy). Resume from an intact copy or another checkpoint. Nothing "
                                  f"was loaded") from error
        if not isinstance(saved, dict) or "key" not in saved:
            raise CheckpointError(f"{path} is not a private run's checkpoint (PrivateTraining.state_dict()). Nothing "
                                  f"was loaded")
        if "digest" in saved and saved["digest"] != whole_digest(saved):
            raise CheckpointError(f"{path} does not match its digest: the model, optimizer, noise state or the digests "
                                  f"of Trainer's files in it were corrupted or edited (a flipped bit, a truncated "
                                  f"copy). Resume from an intact copy or another checkpoint. Nothing was loaded")
        return saved

    def _check_trainer_files(self, folder: str, saved: dict) -> None:
        recorded = saved.get(TRAINER_FILES)
        if recorded is None:
            warnings.warn(f"{folder} was saved by an opake without digests of Trainer's files: they are loaded "
                          f"unverified", stacklevel=4)
            return
        check_file_digests(folder, recorded, checkpoint_name(self.args))

    def _key_to_adopt(self, saved_key: str) -> RngKey | None:
        """The checkpoint's key if this run must plan again with it (built without ``key=``), else None."""
        if saved_key == self.private.plan.key.hex():
            return None
        if self._key_given:
            raise CheckpointError(
                f"this checkpoint was saved by a run with another key than the key= given to {type(self).__name__}: "
                f"a resumed run continues the saved run's batches and noise only with the saved key. Omit key= "
                f"(the checkpoint's key is then adopted) or pass key=opake.random.RngKey.from_hex(saved['key']) "
                f"(torch.load of {CHECKPOINT_NAME}). Nothing was loaded")
        if self.private.steps_taken:
            raise CheckpointError(
                f"this {type(self).__name__} has trained {self.private.steps_taken} steps with its own key, and "
                f"this checkpoint holds another run's: build a new {type(self).__name__} to resume it. Nothing "
                f"was loaded")
        return RngKey.from_hex(saved_key)

    def _plan_again(self, key: RngKey) -> None:
        """Plan the run again with ``key`` (the checkpoint's): the same arguments and objects as
        ``__init__``'s, so the same plan, but for the key. Nothing has trained."""
        earlier = self.private
        earlier.detach()
        self.private = make_private(**self._plan_arguments, key=key)
        if self.private.plan.loss != earlier.plan.loss:  # a subclass's description of its loss (DPDPOTrainer)
            self.private.plan = dataclasses.replace(self.private.plan, loss=earlier.plan.loss)
        self.optimizer = self.private.optimizer

    def hyperparameter_search(self, *args, **kwargs):
        raise UnsupportedTrainingArgumentError(
            "DPTrainer does not run hyperparameter searches: every trial trains on the private data, and their "
            "privacy cost adds up (tune on public or held-out data, or account for the search)")


class DPTrainer(PrivateTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose training is the privacy plan of ``opake.torch.make_private``.

    Takes Trainer's arguments (same order), and the privacy request either in ``args``, a
    ``DPTrainingArguments`` (``--target_epsilon 8 --target_delta 1e-5`` on a command line parsed by
    ``HfArgumentParser``), or as keyword arguments (one setting given both ways is refused):
    ``target_delta`` always, and exactly one of ``target_epsilon`` (the noise is calibrated) and
    ``noise_multiplier``; ``strategy``, ``sampling``, ``amplification`` as in ``make_private``
    (without a strategy, a ``target_epsilon`` run takes the mechanism with the least noise at that
    budget for Trainer's optimizer and schedule: ``trainer.private.plan.choice``);
    ``key`` (an ``opake.random.RngKey``) seeds the batches and the noise (without it, a key is
    drawn from the operating system, as SECURITY.md recommends for published runs; resuming
    needs the same key: it is saved in each checkpoint's opake_private.pt). ``privacy_unit``
    (one user id per example of ``train_dataset``) makes the guarantee user-level, as in
    ``make_private``; the batch size then counts users (module docstring). ``clipping="automatic"``
    scales each example's gradient by C / (norm + 0.01) instead of clipping it (AUTO-S; the bound
    C is ``args.max_grad_norm`` either way, so the noise and epsilon are the same).
    ``noise_correction`` as in ``make_private``: Trainer's AdamW (``adamw_torch``,
    ``adamw_torch_fused``) steps by default with its second moment corrected for the noise
    (``trainer.private.noise_correction``); ``False`` keeps it as it is.

    ``trainer.private`` is the ``PrivateTraining`` (``epsilon``, ``plan``, ``optimizer``,
    ``state_dict()``); ``trainer.private.plan.request`` the ``PrivacySpec`` built from these settings
    and from ``args`` (batch size, epochs, ``max_grad_norm``). Arguments DPTrainer cannot honour raise
    ``UnsupportedTrainingArgumentError`` listing each with its reason (``arguments_table()``).
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, **privacy):
        # Trainer's arguments, in Trainer's order (positional calls keep working); the privacy
        # keywords are PrivateTrainerMixin's, typed there once for every private trainer.
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
                         compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics, **privacy)


class _WorkerSeed:
    """Trainer's ``seed_worker`` for the planned loader's workers (a picklable callable)."""

    def __init__(self, num_workers: int, rank: int):
        self.num_workers = num_workers
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        seed_worker(worker_id, num_workers=self.num_workers, rank=self.rank)


def _fully_shard(model, args) -> None:
    """FSDP2 on ``model`` as TrainingArguments(fsdp=...) asks: ``fully_shard`` on every layer whose
    class is in ``fsdp_config["transformer_layer_cls_to_wrap"]`` (default: the model's
    ``_no_split_modules``), then on the root. ``is_distributed_loading_by_transformers`` tells
    Trainer the model already owns its placement and reduction, so it is neither wrapped in DDP nor
    sharded again; make_private sees the DTensor parameters and runs sharded."""
    from torch.distributed.fsdp import fully_shard

    config = dict(args.fsdp_config or {})
    names = config.get("transformer_layer_cls_to_wrap")
    if isinstance(names, str):
        names = [names]
    if not names:
        names = next((getattr(m, "_no_split_modules", None) for m in model.modules()
                      if getattr(m, "_no_split_modules", None)), None)
    if not names:
        raise UnsupportedTrainingArgumentError(
            "fsdp=... needs the layers to shard: pass fsdp_config={'transformer_layer_cls_to_wrap': ['MyBlock']} "
            "(this model has no _no_split_modules to read them from)")
    reshard = config.get("reshard_after_forward", True)
    layers = [m for m in model.modules() if type(m).__name__ in set(names)]
    if not layers:
        raise UnsupportedTrainingArgumentError(
            f"fsdp=... found no layer of the classes {sorted(names)} in the model; set "
            f"fsdp_config['transformer_layer_cls_to_wrap'] to the names of its block classes")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    model.register_load_state_dict_pre_hook(_shard_whole_tensors)
    for module in model.modules():  # transformers' models keep the flag behind a read-only property
        if isinstance(getattr(type(module), "is_distributed_loading_by_transformers", None), property):
            module._is_distributed_loading_by_transformers = True
    if not getattr(model, "is_distributed_loading_by_transformers", False):
        model.is_distributed_loading_by_transformers = True


def _shard_whole_tensors(module, state_dict, prefix, *args) -> None:
    """Let a model DPTrainer sharded load a whole state dict (what ``save_model`` writes, and what
    Trainer loads when it resumes): each rank keeps its own rows of each whole tensor (no
    communication: every rank read the same file). A resumed run then loads its rank's shards
    from the private checkpoint, which hold the same values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = module.state_dict()
    for name, value in list(state_dict.items()):
        target = current.get(name[len(prefix):])
        if isinstance(target, DTensor) and not isinstance(value, DTensor) and tuple(value.shape) == tuple(target.shape):
            state_dict[name] = distribute_tensor(value.to(device=target.device, dtype=target.dtype),
                                                 target.device_mesh, target.placements, src_data_rank=None)


def _without_gradient_sync(model):
    """Trainer wraps the model in DistributedDataParallel under torch.distributed; its gradient
    synchronization would average autograd's unclipped gradients. ``no_sync`` (DDP's public
    switch) keeps it off: make_private's run all-reduces the clipped sums itself."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


class _TrainerSchedule:
    """The scheduler Trainer builds from ``args`` for a run of ``n_steps`` (``get_scheduler``), as a
    factory ``(optimizer, n_steps) -> scheduler``: the plan reads the learning rates from it on a
    copy of the optimizer (``strategy_for_optimizer``), once it knows the run's length."""

    def __init__(self, args):
        self.args = args

    def __call__(self, optimizer, n_steps: int):
        return transformers.get_scheduler(self.args.lr_scheduler_type, optimizer=optimizer,
                                          num_warmup_steps=self.args.get_warmup_steps(n_steps),
                                          num_training_steps=n_steps,
                                          scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)


