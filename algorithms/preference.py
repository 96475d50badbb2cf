"""Preference losses: DPO (sigmoid, IPO) and the Bradley-Terry reward-model loss.

Consumes per-pair scalars (shape ``[B]``, one entry per (chosen, rejected) pair):

* DPO: the summed (or, for IPO, length-averaged) log-probabilities of the chosen and
  rejected responses under the policy (``policy_*_logps_B``, the only inputs that get
  a gradient) and under the frozen reference model (``ref_*_logps_B``);
* Bradley-Terry: the scalar rewards a reward model gives the chosen and rejected
  responses (``rewards_chosen_B``, ``rewards_rejected_B``).

Emits per-pair losses ``[B]`` (the caller averages them over the pairs of a step) and
detached per-pair statistics. No I/O, no config classes.

The formulas are TRL's (``DPOTrainer.dpo_loss``, ``RewardTrainer``)::

    logits    = (pi_c - pi_r) - (ref_c - ref_r)
    sigmoid:  loss = -(1 - ls) log σ(β logits) - ls log σ(-β logits)   # ls: label smoothing
    ipo:      loss = (logits - 1 / (2β))²                            # β is IPO's τ
    implicit rewards: r_c = β (pi_c - ref_c),  r_r = β (pi_r - ref_r)
    Bradley-Terry: loss = -log σ(r_c - r_r)

For IPO, TRL feeds length-averaged log-probabilities (``logps / n_tokens``); the
trainer does the same (:func:`tapioca.algorithms.supervised.sequence_logprobs` with
``average=True``), this module only sees the numbers. ``log σ`` is ``F.logsigmoid``,
which is finite for any finite margin (``log σ(-x) ≈ -x`` for large ``x``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import AlgorithmInputError

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def _check_pairs(name: str, *tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    if tensors[0].dim() != 1 or any(t.shape != shape for t in tensors):
        raise AlgorithmInputError(
            f"{name}: need 1-D per-pair tensors of one shape [B]; got "
            f"{[tuple(t.shape) for t in tensors]}.")


def dpo_loss(
    policy_chosen_logps_B: torch.Tensor,
    policy_rejected_logps_B: torch.Tensor,
    ref_chosen_logps_B: torch.Tensor,
    ref_rejected_logps_B: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the detached implicit rewards ``(losses_B, r_c_B, r_r_B)``.

    ``label_smoothing`` (conservative DPO, cDPO) applies to ``sigmoid`` only.
    Reference log-probs are treated as constants (detached here).
    """
    _check_pairs("dpo_loss", policy_chosen_logps_B, policy_rejected_logps_B,
                 ref_chosen_logps_B, ref_rejected_logps_B)
    if not beta > 0:
        raise AlgorithmInputError(f"dpo_loss: beta={beta!r} must be > 0.")
    if loss_type not in DPO_LOSS_TYPES:
        raise AlgorithmInputError(f"dpo_loss: loss_type={loss_type!r}; use one of {DPO_LOSS_TYPES}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise AlgorithmInputError(f"dpo_loss: label_smoothing={label_smoothing!r} must be in [0, 0.5).")
    if label_smoothing and loss_type != "sigmoid":
        raise AlgorithmInputError("dpo_loss: label_smoothing only applies to loss_type='sigmoid'.")
    ref_c, ref_r = ref_chosen_logps_B.detach(), ref_rejected_logps_B.detach()
    logits_B = (policy_chosen_logps_B - policy_rejected_logps_B) - (ref_c - ref_r)
    if loss_type == "sigmoid":
        losses_B = (-F.logsigmoid(beta * logits_B) * (1.0 - label_smoothing)
                    - F.logsigmoid(-beta * logits_B) * label_smoothing)
    else:  # ipo: regress the log-ratio margin onto 1 / (2 beta)
        losses_B = (logits_B - 1.0 / (2.0 * beta)) ** 2
    chosen_rewards_B = beta * (policy_chosen_logps_B.detach() - ref_c)
    rejected_rewards_B = beta * (policy_rejected_logps_B.detach() - ref_r)
    return losses_B, chosen_rewards_B, rejected_rewards_B


def bradley_terry_loss(
    rewards_chosen_B: torch.Tensor,
    rewards_rejected_B: torch.Tensor,
    *,
    center_rewards_coefficient: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ``-log σ(r_c - r_r)`` and whether each pair is ranked right (``r_c > r_r``).

    ``center_rewards_coefficient`` (TRL's name) adds ``coef * (r_c + r_r)²`` per pair,
    which keeps rewards centred on 0 (the BT loss only sees differences). A tie is
    counted as wrong, so an untrained constant model has accuracy 0, not 1.
    """
    _check_pairs("bradley_terry_loss", rewards_chosen_B, rewards_rejected_B)
    if center_rewards_coefficient < 0:
        raise AlgorithmInputError("bradley_terry_loss: center_rewards_coefficient must be >= 0.")
    losses_B = -F.logsigmoid(rewards_chosen_B - rewards_rejected_B)
    if center_rewards_coefficient:
        losses_B = losses_B + center_rewards_coefficient * (rewards_chosen_B + rewards_rejected_B) ** 2
    correct_B = (rewards_chosen_B > rewards_rejected_B).detach()
    return losses_B, correct_B
