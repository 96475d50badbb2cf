"""One decoupled-PPO training step on a causal LM (single process, CPU or one GPU).

Proximal logprobs are recomputed with the weights before the update
(``actor.recompute_logprob``; otherwise the behaviour logprobs stand in). Logprobs
come from hidden states in chunks (:func:`gather_logprobs_entropy`), never from the
full-vocabulary fp32 logits of a whole batch. Gradients accumulate over token-balanced
micro-batches, each scaled by its share of the batch's trained tokens, so the loss is
a token mean over the whole batch (``token-mean`` aggregation).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from tapioca.algorithms.logprobs import gather_logprobs_entropy
from tapioca.algorithms.ppo_loss import decoupled_ppo_loss
from tapioca.config.schema import ActorConfig
from tapioca.trainers.batching import SeqItem, TensorBatch, micro_batches, to_tensors


@dataclass
class StepResult:
    metrics: dict[str, float]
    n_tokens: int


class PPOActor:
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

    def _autocast(self):
        if not self.cfg.autocast_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.cfg.autocast_dtype))

    def logprobs(self, batch: TensorBatch, *, entropy: bool = False):
        """Per-token logprobs (and entropy) of ``labels_BT`` under the current weights."""
        with self._autocast():
            return self._logprobs(batch, entropy)

    def _logprobs(self, batch: TensorBatch, entropy: bool):
        body = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        hidden_BTH = body(input_ids=batch.input_ids_BT,
                          attention_mask=batch.attention_mask_BT).last_hidden_state
        head = self.model.get_output_embeddings()
        return gather_logprobs_entropy(
            hidden_BTH[:, :-1], head.weight, batch.labels_BT,
            temperature=self.temperature, chunk_tokens=self.cfg.logprob_chunk_tokens,
            compute_entropy=entropy)

    def train_step(self, items: list[SeqItem]) -> StepResult:
        t0 = time.perf_counter()
        self.model.train()
        mbs = [to_tensors(mb, self.pad_token_id, self.device)
               for mb in micro_batches(items, self.cfg.mb_max_tokens)]
        total_tokens = sum(mb.n_tokens for mb in mbs)
        # Proximal policy = the weights before this update.
        prox, entropy_sum = [], 0.0
        with torch.no_grad():
            for mb in mbs:
                if self.cfg.recompute_logprob:
                    lp, ent = self.logprobs(mb, entropy=True)
                    prox.append(lp.detach())
                    entropy_sum += float((ent * mb.mask_BT).sum())
                else:
                    prox.append(mb.behav_logprobs_BT)
        minibatches = _split(list(range(len(mbs))), self.cfg.ppo_n_minibatches)
        sums: dict[str, float] = {}
        for mb_ids in minibatches:
            mb_tokens = sum(mbs[i].n_tokens for i in mb_ids) or 1
            self.optimizer.zero_grad(set_to_none=True)
            for i in mb_ids:
                mb = mbs[i]
                if mb.n_tokens == 0:
                    continue
                logp, _ = self.logprobs(mb)
                loss, stats = decoupled_ppo_loss(
                    logp, prox[i], mb.behav_logprobs_BT, mb.advantages_BT, mb.mask_BT,
                    eps_clip=self.cfg.eps_clip, eps_clip_higher=self.cfg.eps_clip_higher,
                    c_clip=self.cfg.c_clip, behav_imp_weight_cap=self.cfg.behav_imp_weight_cap)
                share = mb.n_tokens / mb_tokens
                (loss * share).backward()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v * mb.n_tokens
                sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * mb.n_tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
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


def _split(ids: list[int], n: int) -> list[list[int]]:
    n = max(1, min(n, len(ids)))
    return [ids[i::n] for i in range(n)]
