"""One policy-gradient training step on a causal LM (single process, CPU or one GPU).

Consumes a step's :class:`SeqItem` list (and the trainer's ``policy_version``);
emits updated weights (in place) and a :class:`StepResult` of ``actor/*`` metrics.

Where pi_prox (the policy before this update) comes from, with
``actor.recompute_logprob: true``:

* micro-batches of the **first minibatch** (all of them with the default
  ``ppo_n_minibatches: 1``): their training forward runs before any optimizer step
  of this ``train_step``, so its detached log-probs *are* pi_prox, exactly and for
  free, under every ``prox_logp_method``;
* micro-batches of **later minibatches** see weights already moved by earlier
  minibatches: ``prox_logp_method: recompute`` (and ``metrics``) runs a no-grad
  forward for them before the first optimizer step; ``loglinear`` approximates
  pi_prox from their training forward (:mod:`tapioca.algorithms.prox_logp`).
* With ``m2_threshold`` under ``recompute`` / ``metrics``, M2PO's mask covers the
  whole step, which needs pi_prox of every micro-batch before the first backward:
  the no-grad forward then runs for all micro-batches (under ``loglinear`` the mask
  is per micro-batch instead).

With ``recompute_logprob: false`` the behaviour log-probs are pi_prox (coupled PPO;
the config refuses the pi_prox/pi_behav filters then, since they could never fire).
``actor/entropy`` is the entropy of the pre-update policy where known (no-grad
forward or first minibatch), else of the training forward.

Logprobs come from hidden states in chunks
(:func:`tapioca.models.forward.causal_token_logprobs`), never from the
full-vocabulary fp32 logits of a whole batch. The loss is
:func:`tapioca.algorithms.policy_losses.policy_loss` (PPO, GSPO, SAPO, CISPO, M2PO,
rejection sampling, entropy bonus, selected by :class:`ActorConfig`).

Gradients accumulate over token-balanced micro-batches (whole sequences) of each of
``ppo_n_minibatches`` minibatches (one optimizer step each). Each micro-batch's loss
is scaled by its share of the minibatch's aggregation units (trained tokens for
``token-mean``, non-empty sequences for the ``seq-mean-*`` modes; see
:func:`tapioca.algorithms.aggregation.agg_units`), so the accumulated gradient is
exactly the gradient of the minibatch's aggregated loss.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tapioca.algorithms.aggregation import agg_units
from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.policy_losses import policy_loss
from tapioca.algorithms.prox_logp import loglinear_prox_logprobs
from tapioca.algorithms.rejection_sampling import m2po_keep_flat
from tapioca.config.schema import ActorConfig
from tapioca.models.forward import autocast_context, causal_token_logprobs
from tapioca.trainers.batching import SeqItem, TensorBatch, micro_batches, to_tensors


@dataclass
class StepResult:
    metrics: dict[str, float]
    n_tokens: int


class PPOActor:
    #: True: the first minibatch takes pi_prox from its own training forward (exact).
    #: False: a separate no-grad forward for every micro-batch (``loglinear``: the
    #: approximation for every micro-batch), the slower path; tests check both agree.
    prox_from_training_forward: bool = True

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, *, temperature: float,
                 pad_token_id: int, device: str = "cpu") -> None:
        self.model = model.to(device)
        self.cfg = cfg
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
            betas=tuple(cfg.adam_betas))

    def micro_batches(self, items: list[SeqItem]) -> list[TensorBatch]:
        """The step's token-balanced micro-batches of at most ``mb_max_tokens`` tokens
        (the sharded actor, trainers/fsdp_actor.py, hands each rank its own)."""
        return [to_tensors(mb, self.pad_token_id, self.device)
                for mb in micro_batches(items, self.cfg.mb_max_tokens)]

    # The weights as the trainer role sees them (publishing, rollback, checkpoints);
    # the sharded actor (trainers/fsdp_actor.py) gathers and scatters them across ranks.

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the model, whole (what a weights file holds)."""
        return self.model.state_dict()

    def load_full_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy whole weights in (tied weights were saved once; copying one sets both)."""
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                own[name].copy_(tensor)

    def save_checkpoint(self, path, progress) -> None:
        from tapioca.trainers.checkpoint import save_checkpoint

        save_checkpoint(path, self.model, self.optimizer, progress)

    def load_checkpoint(self, path):
        """The checkpoint's TrainerProgress (weights and optimizer loaded), or None."""
        from tapioca.trainers.checkpoint import load_checkpoint

        return load_checkpoint(path, self.model, self.optimizer)

    def logprobs(self, batch: TensorBatch, *, entropy: bool = False):
        """Per-token logprobs (and entropy) of ``labels_BT`` under the current weights."""
        with autocast_context(self.device, self.cfg.autocast_dtype):
            return causal_token_logprobs(
                self.model, batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT,
                temperature=self.temperature, chunk_tokens=self.cfg.logprob_chunk_tokens,
                compute_entropy=entropy)

    def _loss_kwargs(self) -> dict:
        cfg = self.cfg
        return dict(
            eps_clip=cfg.eps_clip, eps_clip_higher=cfg.eps_clip_higher, c_clip=cfg.c_clip,
            importance_sampling_level=cfg.importance_sampling_level,
            use_sapo_loss=cfg.use_sapo_loss, sapo_tau_pos=cfg.sapo_tau_pos,
            sapo_tau_neg=cfg.sapo_tau_neg, use_cispo_loss=cfg.use_cispo_loss,
            behav_imp_weight_cap=cfg.behav_imp_weight_cap,
            rejection_sampling=cfg.rejection_sampling, entropy_coeff=cfg.entropy_coeff,
            agg_mode=cfg.loss_agg_mode, max_tokens=cfg.loss_agg_max_tokens)

    def _prox_forward_ids(self, minibatches: list[list[int]], n_mbs: int) -> list[int]:
        """Micro-batches whose pi_prox needs a no-grad forward before training."""
        cfg = self.cfg
        if not cfg.recompute_logprob or cfg.prox_logp_method == "loglinear":
            return []
        if not self.prox_from_training_forward or cfg.m2_threshold is not None:
            return list(range(n_mbs))  # step-wide M2PO mask: every pi_prox up front
        return sorted(i for mb_ids in minibatches[1:] for i in mb_ids)

    def train_step(self, items: list[SeqItem], *, policy_version: int | None = None) -> StepResult:
        """Train on ``items``; ``policy_version`` = optimizer steps applied so far (the
        version of the weights before this update), needed by ``prox_logp_method``
        ``loglinear`` and ``metrics``."""
        t0 = time.perf_counter()
        cfg = self.cfg
        method = cfg.prox_logp_method if cfg.recompute_logprob else "recompute"
        if method != "recompute" and policy_version is None:
            raise AlgorithmInputError(
                f"PPOActor.train_step: actor.prox_logp_method={method} needs "
                "policy_version= (the version of the weights before this update).")
        self.model.train()
        mbs = self.micro_batches(items)
        total_tokens = sum(mb.n_tokens for mb in mbs)
        units = [agg_units(mb.mask_BT, cfg.loss_agg_mode) for mb in mbs]
        minibatches = _split(list(range(len(mbs))), cfg.ppo_n_minibatches)
        # pi_prox per micro-batch: a tensor when known before training (behaviour
        # logprobs, or the no-grad forward below); None = from the training forward
        # (exact in the first minibatch, loglinear in later ones).
        prox: list[torch.Tensor | None] = [None] * len(mbs)
        if not cfg.recompute_logprob:
            prox = [mb.behav_logprobs_BT for mb in mbs]
        entropy_known = [False] * len(mbs)
        entropy_sum = 0.0
        with torch.no_grad():
            for i in self._prox_forward_ids(minibatches, len(mbs)):
                lp, ent = self.logprobs(mbs[i], entropy=True)
                prox[i] = lp
                entropy_known[i] = True
                entropy_sum += float((ent * mbs[i].mask_BT).sum())
        keeps = self._m2po_keeps(mbs, prox)
        kwargs = self._loss_kwargs()
        sums: dict[str, float] = {}
        for mb_index, mb_ids in enumerate(minibatches):
            mb_tokens = sum(mbs[i].n_tokens for i in mb_ids) or 1
            mb_units = sum(units[i] for i in mb_ids) or 1
            # No optimizer step yet in this train_step: the training forward is pi_prox.
            exact_forward = mb_index == 0 and self.prox_from_training_forward
            self.optimizer.zero_grad(set_to_none=True)
            for i in mb_ids:
                mb = mbs[i]
                if mb.n_tokens == 0:
                    continue
                logp, ent = self.logprobs(
                    mb, entropy=cfg.entropy_coeff > 0 or not entropy_known[i])
                prox_i = prox[i]
                if prox_i is None:
                    prox_i = logp.detach() if exact_forward else loglinear_prox_logprobs(
                        mb.behav_logprobs_BT, logp.detach(), mb.versions_BT, policy_version)
                if method == "metrics":
                    approx = loglinear_prox_logprobs(mb.behav_logprobs_BT, logp.detach(),
                                                     mb.versions_BT, policy_version)
                    err = float(torch.where(mb.mask_BT, (approx - prox_i).abs(), 0.0).sum())
                    sums["prox_loglinear_abs_err"] = sums.get("prox_loglinear_abs_err", 0.0) + err
                if not entropy_known[i]:
                    entropy_sum += float((ent.detach() * mb.mask_BT).sum())
                loss, stats = policy_loss(
                    logp, prox_i, mb.behav_logprobs_BT, mb.advantages_BT, mb.mask_BT,
                    keep_BT=keeps[i],
                    # No step-wide mask (loglinear): M2PO over this micro-batch.
                    m2_threshold=cfg.m2_threshold if keeps[i] is None else None,
                    entropy_BT=ent if cfg.entropy_coeff > 0 else None, **kwargs)
                (loss * (units[i] / mb_units)).backward()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v * mb.n_tokens
                # The minibatch's aggregated loss, summed over minibatches (token-mean:
                # the token-weighted mean of micro-batch losses, as before).
                # (mb_tokens / mb_units is exactly 1.0 for token-mean: loss * n_tokens as before)
                weight = units[i] * (mb_tokens / mb_units)
                sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * weight
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm) * mb_tokens
            self.optimizer.step()
        self.model.eval()
        denom = max(total_tokens, 1)
        metrics = {f"actor/{k}": v / denom for k, v in sums.items()}
        for k in ("importance_weight_max",):
            if f"actor/{k}" in metrics:  # a max does not average; report the mean of maxima
                metrics[f"actor/{k}_mean"] = metrics.pop(f"actor/{k}")
        metrics["actor/entropy"] = entropy_sum / denom
        metrics["actor/trained_tokens"] = float(total_tokens)
        metrics["actor/micro_batches"] = float(len(mbs))
        elapsed = time.perf_counter() - t0
        metrics["actor/step_time_s"] = elapsed
        n_all = sum(it.length for it in items)
        metrics["actor/tokens_per_s"] = n_all / elapsed if elapsed > 0 else 0.0
        return StepResult(metrics, total_tokens)

    def _m2po_keeps(self, mbs: list[TensorBatch], prox: list[torch.Tensor | None]):
        """M2PO keep masks over all trained tokens of the step (None: M2PO off, or
        pi_prox only known during training, loglinear)."""
        if self.cfg.m2_threshold is None or any(p is None for p in prox):
            return [None] * len(mbs)
        with torch.no_grad():
            flat = [(p - mb.behav_logprobs_BT)[mb.mask_BT].square() for p, mb in zip(prox, mbs)]
            keep_flat = m2po_keep_flat(torch.cat(flat), self.cfg.m2_threshold)
            keeps, start = [], 0
            for f, mb in zip(flat, mbs):
                keep = torch.zeros_like(mb.mask_BT)
                keep[mb.mask_BT] = keep_flat[start:start + f.numel()]
                start += f.numel()
                keeps.append(keep)
        return keeps


def _split(ids: list[int], n: int) -> list[list[int]]:
    n = max(1, min(n, len(ids)))
    return [ids[i::n] for i in range(n)]
