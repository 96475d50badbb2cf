"""Supervised fine-tuning (``tapioca sft``): masked NLL over response tokens only.

Consumes :class:`SeqExample` lists from a dataset (chat ``messages`` or
``prompt`` + ``response``) or from a run's logs (rejection-sampling fine-tuning:
trajectories with ``reward >= train_dataset.min_reward``), see
:mod:`tapioca.trainers.supervised.data`. Emits what every supervised trainer emits
(:mod:`tapioca.trainers.supervised.loop`): weights + ``WeightsEvent`` per saved version,
metrics + ``MetricsEvent`` per step (``sft/loss`` is the token-mean NLL of the step).

The loss is a token mean over the whole step: each micro-batch's mean NLL is weighted
by its share of the step's trained tokens, so micro-batching does not change it.
Prompt tokens and tokens with loss mask 0 (tool output in logged trajectories) are
never trained.
"""

from __future__ import annotations

from ...algorithms.supervised import masked_nll
from ...config.supervised import SFTConfig
from ..batching import pack
from .data import SeqExample, load_sft_examples
from .loop import (
    StepHook,
    StepProgress,
    SupervisedSummary,
    SupervisedTrainerBase,
    pad_batch,
    setup_supervised,
    token_logprobs,
)


class SFTTrainer(SupervisedTrainerBase[SeqExample]):
    kind = "sft"

    def accumulate(self, batch: list[SeqExample]) -> dict[str, float]:
        total = sum(sum(ex.response_mask) for ex in batch) or 1
        nll_sum = 0.0
        for mb in pack([ex.length for ex in batch], self.cfg.actor.mb_max_tokens):
            seqs = [(batch[i].prompt_ids + batch[i].response_ids, len(batch[i].prompt_ids),
                     batch[i].response_mask) for i in mb]
            ids_BT, attn_BT, labels_BT, mask_BT = pad_batch(seqs, self.pad_token_id, self.device)
            with self.autocast():
                logprobs_BT = token_logprobs(self.model, ids_BT, attn_BT, labels_BT,
                                             chunk_tokens=self.cfg.actor.logprob_chunk_tokens)
            n = int(mask_BT.sum())
            loss = masked_nll(logprobs_BT, mask_BT)
            (loss * (n / total)).backward()
            nll_sum += float(loss.detach()) * n
        return {"sft/loss": nll_sum / total, "sft/trained_tokens": float(total),
                "sft/examples": float(len(batch))}


def train_sft(cfg: SFTConfig, *, progress: StepProgress | None = None,
              hook: StepHook | None = None) -> SupervisedSummary:
    """Run SFT as configured (creates the run directory; resumes from its checkpoint);
    ``hook``: see :data:`~tapioca.trainers.supervised.loop.StepHook` (the held-out
    evaluation of runtime/sft_eval.py)."""
    model, tokenizer = setup_supervised(cfg)
    examples, stats = load_sft_examples(cfg.train_dataset, tokenizer, bus=cfg.bus, seed=cfg.seed)
    return SFTTrainer(cfg, model, tokenizer, examples, data_metrics=stats.metrics()).fit(progress, hook)
