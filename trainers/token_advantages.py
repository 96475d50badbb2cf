"""Per-token advantages of one training step: the parts that need models or the batch.

Consumes the step's :class:`~tapioca.trainers.batching.SeqItem` list (one per sampled
sequence, carrying the shaped reward, the advantage processor's group-level advantage,
the behaviour log-probs, the loss mask and the turn boundaries). Sets
``token_advantages`` on every item (and ``token_values`` / ``token_returns`` when a
critic trains) and returns the step's metrics. Nothing is keyed: one call per step.

Per sequence, over its trained output tokens (``mask``):

1. Token rewards ``r_t``: the scalar at the last trained token (the shaped reward for
   ``estimator: gae``, whose processor advantage is 0; otherwise the processor's
   group-level advantage, e.g. ``r - mean`` for REINFORCE++-baseline and the raw
   shaped reward for REINFORCE++), plus ``-kl_ctl * KL_t`` to the reference when
   ``actor.kl_ctl > 0``.
2. ``A_rl``: GAE with the critic's values (``gae``; token- or turn-level timesteps,
   ``discount``, ``gae_lambda``) or the discounted returns of ``r_t`` (every other
   estimator). With ``kl_ctl = 0`` and ``discount = 1`` the returns are the group
   advantage on every token, i.e. today's behaviour; with ``kl_ctl > 0`` each token
   gets the group advantage plus the KL penalty still to come, which is what AReaL's
   critic-free path (GAE with zero values, ``gamma = lambda = 1``) gives its GRPO.
3. The ``batch`` levels of the normalisation (``advantage.norm()``: the estimator's
   preset, or ``advantage.adv_norm``) over the trained tokens of the whole batch.
4. ``A = rl_weight * A_rl + kd_weight * A_kd`` with ``A_kd_t = logp_teacher_t -
   logp_student_t`` (on-policy distillation: the negative per-token reverse-KL
   estimate, undiscounted, not normalised), when ``distill.kd_weight > 0``.

The student / policy log-probs in the KL and the KD terms are the behaviour log-probs
of the rollout: AReaL's decoupled mode uses them for the KL reward too, and on-policy
distillation scores the tokens the student sampled. No extra policy forward pass.
When none of this applies (``grpo``-style presets without batch levels, ``kl_ctl = 0``,
``discount = 1``, no KD) :attr:`TokenAdvantages.active` is False and the trainer
leaves the scalar advantages alone.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import TYPE_CHECKING

import torch

from ..algorithms.gae import (
    discounted_returns,
    gae_advantages,
    kl_penalty_rewards,
    masked_batch_normalize,
    terminal_rewards,
    turn_gae_advantages,
)
from ..config.schema import NormConfig
from ..schemas.errors import ConfigError
from .batching import SeqItem, micro_batches, output_slice, to_tensors
from .critic import Critic
from .prefix_packing import to_tree_packed, tree_micro_batches
from .reference import FrozenLogprobModel

if TYPE_CHECKING:
    from ..config.sections import TrainerSection


def turn_ids(item: SeqItem) -> list[int]:
    """Turn number of each output token: from ``turn_boundaries`` (offsets where turns
    start) when given, else a new turn at every run of trained tokens (tool / user
    tokens, loss mask 0, separate the model's turns)."""
    n = len(item.loss_mask)
    if item.turn_boundaries:
        bounds = sorted({b for b in item.turn_boundaries if 0 < b < n})
        return [bisect_right(bounds, j) for j in range(n)]
    ids, tid, started, prev = [], 0, False, 0
    for m in item.loss_mask:
        if m and not prev and started:
            tid += 1
        started = started or bool(m)
        ids.append(tid)
        prev = m
    return ids


class TokenAdvantages:
    def __init__(self, section: "TrainerSection", *, pad_token_id: int,
                 device: str | torch.device, critic: Critic | None = None,
                 reference: FrozenLogprobModel | None = None,
                 teacher: FrozenLogprobModel | None = None) -> None:
        """``section``: the estimator, the normalisation's batch levels, GAE, KL and KD
        settings (``advantage``, ``actor``, ``distill``). ``critic`` / ``reference`` /
        ``teacher``: required when the section asks for them (runtime/builders.py
        ``build_token_models`` builds them)."""
        a, adv, kd = section.actor, section.advantage, section.distill
        self.estimator = adv.estimator
        self.norm: NormConfig = adv.norm()
        self.discount, self.gae_lambda, self.unit = a.discount, a.gae_lambda, a.gae_timestep_unit
        self.kl_ctl, self.kl_estimator = a.kl_ctl, a.kl_estimator
        self.kd_weight, self.rl_weight = kd.kd_weight, kd.rl_weight
        self.critic, self.reference, self.teacher = critic, reference, teacher
        self.pad_token_id, self.device, self.mb_max_tokens = pad_token_id, device, a.mb_max_tokens
        # Tree training for the frozen forwards (each shared prompt scored once): when every
        # frozen model in use has its packed forward and no critic reads padded batches.
        frozen = [m for m, on in ((reference, self.kl_ctl > 0), (teacher, self.kd_weight > 0)) if on and m is not None]
        self.tree_training = (a.enable_tree_training and self.estimator != "gae" and bool(frozen)
                              and all(getattr(m, "packed", None) is not None for m in frozen))
        self.center = self.norm.mean_level == "batch"
        self.scale = self.norm.std_level == "batch"
        for needed, model, what in ((self.estimator == "gae", critic, "a critic (estimator gae)"),
                                    (self.kl_ctl > 0, reference, "a reference model (actor.kl_ctl > 0)"),
                                    (self.kd_weight > 0, teacher, "a teacher (distill.kd_weight > 0)")):
            if needed and model is None:
                raise ConfigError(f"token advantages need {what}; build it with "
                                  "tapioca.runtime.builders.build_token_models or pass it in")

    @property
    def active(self) -> bool:
        return (self.estimator == "gae" or self.kl_ctl > 0 or self.kd_weight > 0
                or self.center or self.scale or self.discount != 1.0 or self.rl_weight != 1.0)

    def compute(self, items: list[SeqItem]) -> dict[str, float]:
        """Set ``token_advantages`` (and the critic's ``token_values`` / ``token_returns``)
        on every item; return metrics."""
        rl: dict[int, torch.Tensor] = {}
        kd: dict[int, torch.Tensor] = {}
        sums = {"kl": 0.0, "kd": 0.0, "teacher_logp": 0.0, "value": 0.0, "ret": 0.0}
        n_tokens = 0
        batches = (tree_micro_batches(items, self.mb_max_tokens) if self.tree_training
                   else micro_batches(items, self.mb_max_tokens))
        for mb in batches:
            # A prefix tree's [B, T-1] tensors are to_tensors' own (trainers/prefix_packing.py).
            tb = (to_tree_packed(mb, self.device) if self.tree_training
                  else to_tensors(mb, self.pad_token_id, self.device))
            mask = tb.mask_BT
            n_tokens += tb.n_tokens
            scalar_B = torch.tensor([it.reward if self.estimator == "gae" else it.advantage
                                     for it in mb], dtype=torch.float32, device=mask.device)
            rewards_BT = terminal_rewards(scalar_B, mask)
            if self.kl_ctl > 0:
                kl_r_BT, kl_BT = kl_penalty_rewards(tb.behav_logprobs_BT, self.reference.logprobs(tb),
                                                    mask, kl_ctl=self.kl_ctl, kind=self.kl_estimator)
                rewards_BT = rewards_BT + kl_r_BT
                sums["kl"] += float(kl_BT.sum())
            values_BT = returns_BT = None
            if self.estimator == "gae":
                values_BT = self.critic.values(tb)
                if self.unit == "turn":
                    ids_BT = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
                    for b, it in enumerate(mb):
                        ids_BT[b, output_slice(it)] = torch.tensor(turn_ids(it))
                    adv_BT, returns_BT = turn_gae_advantages(
                        rewards_BT, values_BT, mask, ids_BT, discount=self.discount,
                        gae_lambda=self.gae_lambda)
                else:
                    adv_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask,
                                                        discount=self.discount,
                                                        gae_lambda=self.gae_lambda)
                sums["value"] += float(values_BT.sum())
                sums["ret"] += float(returns_BT.sum())
            else:
                adv_BT = discounted_returns(rewards_BT, mask, discount=self.discount)
            if self.kd_weight > 0:
                teacher_BT = self.teacher.logprobs(tb)
                kd_BT = torch.where(mask, teacher_BT - tb.behav_logprobs_BT, 0.0)
                sums["kd"] += float(kd_BT.sum())
                sums["teacher_logp"] += float(torch.where(mask, teacher_BT, 0.0).sum())
            for b, it in enumerate(mb):
                sl = output_slice(it)
                rl[id(it)] = adv_BT[b, sl].detach().cpu()
                if values_BT is not None:
                    it.token_values = values_BT[b, sl].cpu().tolist()
                    it.token_returns = returns_BT[b, sl].cpu().tolist()
                if self.kd_weight > 0:
                    kd[id(it)] = kd_BT[b, sl].detach().cpu()
        # Batch levels over every trained token of the step, in item order.
        flat = torch.cat([rl[id(it)] for it in items])[None] if items else torch.zeros(1, 0)
        fmask = torch.cat([torch.tensor(it.loss_mask, dtype=torch.bool) for it in items])[None] \
            if items else torch.zeros(1, 0, dtype=torch.bool)
        if self.center or self.scale:
            flat = masked_batch_normalize(flat, fmask, center=self.center, scale=self.scale,
                                          leave1out=self.norm.mean_leave1out, eps=self.norm.eps,
                                          unbiased=self.norm.std_unbiased)
        final = self.rl_weight * flat
        if self.kd_weight > 0:
            final = final + self.kd_weight * torch.cat([kd[id(it)] for it in items])[None]
        final = torch.where(fmask, final, 0.0)[0]
        start = 0
        for it in items:
            n = len(it.loss_mask)
            it.token_advantages = final[start:start + n].tolist()
            start += n
        denom = max(n_tokens, 1)
        trained = final[fmask[0]]
        metrics = {"adv/token_mean": float(trained.mean()) if trained.numel() else 0.0,
                   "adv/token_std": float(trained.std(unbiased=False)) if trained.numel() else 0.0}
        if self.kl_ctl > 0:
            metrics["actor/kl_ref"] = sums["kl"] / denom
        if self.estimator == "gae":
            metrics["critic/value_mean"] = sums["value"] / denom
            metrics["critic/return_mean"] = sums["ret"] / denom
        if self.kd_weight > 0:
            # Mean of logp_student - logp_teacher: the reverse-KL estimate, >= 0 on average.
            metrics["distill/reverse_kl"] = -sums["kd"] / denom
            metrics["distill/teacher_logp"] = sums["teacher_logp"] / denom
        return metrics
