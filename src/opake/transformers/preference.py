"""Preference losses formed one pair at a time, from the policy's logits (``DPDPOTrainer``).

A preference pair (a prompt, a chosen and a rejected completion) is one example of a DPO data
set, and one privacy unit: its two sequences run as two rows of the model's batch (the chosen
rows first, then the rejected rows in the same order, as TRL's collator lays them out), and the
clipper clips the pair's summed gradient. For the release to move by at most C when a pair is
added, each pair's loss must depend on that pair alone. Every loss here is a function of one
pair's four sequence log-probabilities (policy and reference, chosen and rejected) and its own
completion lengths; TRL's ``'aot'`` and ``'aot_unpaired'`` (which sort the batch's pairs) and
``'sft'`` (a mean over all chosen tokens of the batch) are not, and are refused by the
trainer's argument table.

The formulas are those of the papers TRL cites for each ``loss_type`` and ``f_divergence_type``,
written per pair; ``tests/transformers/test_trl.py`` checks that their mean over a batch equals
TRL's own loss on an unhooked copy of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opake.errors import InvalidArgumentError

__all__ = ["PAIRWISE_LOSSES", "PairLossSettings", "completion_log_probs", "pair_losses"]

IGNORE = -100

# loss_type -> what the loss of one pair is a function of (all: its own sequences only).
PAIRWISE_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                   "apo_down", "discopop", "sigmoid_norm")


@dataclass(frozen=True)
class PairLossSettings:
    """The DPO settings the per-pair losses read."""

    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    ld_alpha: float | None = None
    use_weighting: bool = False

    @classmethod
    def of_trainer(cls, trainer) -> PairLossSettings:
        """The settings a ``trl.DPOTrainer`` holds (its attributes, read from its DPOConfig in its
        ``__init__``; TRL's own loss reads the same attributes)."""
        types = tuple(trainer.loss_types)
        weights = tuple(trainer.loss_weights) if trainer.loss_weights is not None else (1.0,) * len(types)
        return cls(types, weights, float(trainer.beta), float(trainer.label_smoothing), str(trainer.f_divergence_type),
                   float(trainer.f_alpha_divergence_coef), float(trainer.args.discopop_tau), trainer.ld_alpha,
                   bool(trainer.use_weighting))


def completion_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                         ld_alpha: float | None = None, with_square_mass: bool = False):
    """Each row's log-probability of its completion tokens: (rows,), and with ``with_square_mass``
    also (rows,) the WPO mean of ``log p(token) - log sum_v p_v^2`` over the row's completion.

    ``logits`` (rows, T, V) score position t's next token, ``input_ids`` (rows, T), and
    ``completion_mask`` (rows, T) marks the completion tokens. Rows are ``[chosen..., rejected...]``;
    with ``ld_alpha`` (LD-DPO) the tokens of a pair's longer completion beyond the shorter one's
    length count ``ld_alpha`` times: a weight within the pair.
    """
    logits = logits[:, :-1]
    logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    targets = input_ids[:, 1:].to(logits.device)
    mask = completion_mask[:, 1:].to(logits.device).bool()
    log_softmax = logits.log_softmax(dim=-1)
    token = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
    if ld_alpha is None:
        sums = token.sum(dim=1)
    else:
        position = mask.long().cumsum(dim=1)  # 1, 2, ... along each row's completion
        lengths = mask.sum(dim=1)
        chosen, rejected = lengths.chunk(2)
        shared = torch.minimum(chosen, rejected).repeat(2)[:, None]  # both rows of a pair: the shorter length
        weight = torch.where(position <= shared, 1.0, float(ld_alpha)).to(token.dtype)
        sums = (token * weight).sum(dim=1)
    if not with_square_mass:
        return sums
    with torch.no_grad():  # WPO's weights are constants of the step (no gradient through them)
        square_mass = torch.logsumexp(2 * log_softmax, dim=-1)
        aligned = ((token - square_mass) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return sums, aligned


def _scores(log_ratio: torch.Tensor, settings: PairLossSettings) -> torch.Tensor:
    """f'(ratio) of the f-divergence regularizer (f-DPO) at the policy/reference ratio."""
    kind = settings.f_divergence_type
    if kind == "reverse_kl":
        return log_ratio
    if kind == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if kind == "alpha_divergence":
        alpha = settings.f_alpha_divergence_coef
        if abs(alpha - 1.0) < 1e-6:  # the limit alpha -> 1 is the reverse KL
            return log_ratio
        exponent = ((alpha - 1.0) * log_ratio).float().clamp(max=80.0)
        return ((torch.exp(exponent) - 1.0) / (alpha - 1.0)).to(log_ratio.dtype)
    raise InvalidArgumentError(f"unknown f_divergence_type {kind!r}")


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, completion_mask: torch.Tensor,
                settings: PairLossSettings, square_mass: torch.Tensor | None = None) -> torch.Tensor:
    """(pairs,) each pair's loss: ``policy`` and ``reference`` are (2 * pairs,) sequence
    log-probabilities, chosen rows first; ``completion_mask`` (2 * pairs, T) gives the
    completion lengths; ``square_mass`` the WPO terms of ``completion_log_probs``."""
    policy_chosen, policy_rejected = policy.chunk(2)
    reference_chosen, reference_rejected = reference.to(policy.dtype).chunk(2)
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    chosen_score, rejected_score = _scores(chosen_ratio, settings), _scores(rejected_ratio, settings)
    margin = chosen_score - rejected_score
    lengths = completion_mask.sum(dim=1).clamp(min=1).to(policy.device, policy.dtype)  # each row's own tokens
    chosen_length, rejected_length = lengths.chunk(2)
    beta, smoothing = settings.beta, settings.label_smoothing
    total = torch.zeros_like(margin)
    for loss_type, weight in zip(settings.loss_types, settings.loss_weights, strict=True):
        if loss_type == "sigmoid":  # DPO (Rafailov et al. 2023)
            loss = -F.logsigmoid(beta * margin)
        elif loss_type == "hinge":  # SLiC
            loss = torch.relu(1 - beta * margin)
        elif loss_type == "ipo":  # IPO, on per-token average scores; beta is its tau
            loss = (chosen_score / chosen_length - rejected_score / rejected_length - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":  # EXO: KL from the policy's pair distribution to (1 - eps, eps)
            epsilon = torch.as_tensor(smoothing, dtype=margin.dtype, device=margin.device)
            loss = (torch.sigmoid(beta * margin) * (F.logsigmoid(beta * margin) - torch.log1p(-epsilon))
                    + torch.sigmoid(-beta * margin) * (F.logsigmoid(-beta * margin) - torch.log(epsilon)))
        elif loss_type == "nca_pair":  # NCA
            loss = (-F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                    - 0.5 * F.logsigmoid(-beta * rejected_ratio))
        elif loss_type == "robust":  # robust DPO: labels flipped with probability eps
            loss = ((-(1 - smoothing) * F.logsigmoid(beta * margin) + smoothing * F.logsigmoid(-beta * margin))
                    / (1 - 2 * smoothing))
        elif loss_type == "bco_pair":  # BCO on pairs
            loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
        elif loss_type == "sppo_hard":  # SPPO with hard win probabilities
            loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
        elif loss_type == "apo_zero":  # APO-zero: raise chosen, lower rejected
            loss = (1 - torch.sigmoid(beta * chosen_ratio)) + torch.sigmoid(beta * rejected_ratio)
        elif loss_type == "apo_down":  # APO-down: lower both, rejected more
            loss = torch.sigmoid(beta * chosen_ratio) + (1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio)))
        elif loss_type == "discopop":  # DiscoPOP: logistic and exponential blended by the margin
            scaled = beta * margin
            blend = torch.sigmoid(scaled / settings.discopop_tau)
            loss = -F.logsigmoid(scaled) * (1 - blend) + torch.exp(-scaled) * blend
        elif loss_type == "sigmoid_norm":  # DPO on per-token average scores
            loss = -F.logsigmoid(beta * (chosen_score / chosen_length - rejected_score / rejected_length))
        else:
            raise InvalidArgumentError(
                f"loss_type {loss_type!r} is not a per-pair loss opake forms (one of {PAIRWISE_LOSSES})"
            )
        if settings.use_weighting:  # WPO: each pair weighted by its own detached probabilities
            if square_mass is None:
                raise InvalidArgumentError(
                    "use_weighting needs the WPO terms (completion_log_probs(with_square_mass=True))"
                )
            chosen_weight, rejected_weight = square_mass.exp().chunk(2)
            loss = loss * chosen_weight * rejected_weight
        total = total + weight * loss
    return total
