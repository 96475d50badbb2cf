"""Direct preference optimisation (``tapioca dpo``), sigmoid or IPO, with TRL's formulas.

Consumes :class:`PairExample` lists (prompt, chosen, rejected) from a dataset or from a
run's logs (best vs worst trajectory of each group; tied groups skipped), see
:mod:`tapioca.trainers.supervised.data`. Emits what every supervised trainer emits
(:mod:`tapioca.trainers.supervised.loop`); per step ``dpo/loss``, ``dpo/margin`` (mean
implicit reward margin ``β[(π_c - ref_c) - (π_r - ref_r)]``), ``dpo/accuracy`` (share of
pairs with a positive margin), ``dpo/chosen_reward``, ``dpo/rejected_reward``.

The reference model is a frozen copy of the initial policy (``model.path``, copied
before any checkpoint is loaded, so a resumed run keeps the same reference), or
``ref_model_path``. Reference log-probabilities are computed once per pair and cached:
the reference never changes. Sequence log-probabilities are sums over the response's
trained tokens (sigmoid) or their mean (IPO, as TRL does).
"""

from __future__ import annotations

import copy

import torch

from ...algorithms.preference import dpo_loss
from ...algorithms.supervised import sequence_logprobs
from ...config.supervised import DPOConfig
from ...schemas.errors import ConfigError
from ..batching import pack
from .data import PairExample, load_pair_examples
from .loop import (
    StepProgress,
    SupervisedSummary,
    SupervisedTrainerBase,
    mean,
    pad_batch,
    setup_supervised,
    token_logprobs,
)


class DPOTrainer(SupervisedTrainerBase[PairExample]):
    kind = "dpo"

    def __init__(self, cfg: DPOConfig, model: torch.nn.Module, tokenizer, examples: list[PairExample],
                 *, ref_model: torch.nn.Module | None = None, data_metrics=None) -> None:
        # The reference is copied before the base class loads a checkpoint into `model`.
        self.ref_model = (ref_model if ref_model is not None else copy.deepcopy(model))
        self.ref_model.requires_grad_(False).eval()
        super().__init__(cfg, model, tokenizer, examples, data_metrics=data_metrics)
        self.ref_model.to(self.device)
        v_ref = self.ref_model.get_output_embeddings().weight.shape[0]
        if v_ref != model.get_output_embeddings().weight.shape[0]:
            raise ConfigError("ref_model_path has a different vocabulary size from the policy; "
                              "the reference must share the policy's tokenizer")
        self.dpo_cfg = cfg
        self._ref_cache: dict[int, tuple[float, float]] = {}

    def _seq_logps(self, model: torch.nn.Module,
                   pairs: list[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) sequence log-probs ``[B]``; one forward over both sides."""
        sides = [p.side(True) for p in pairs] + [p.side(False) for p in pairs]
        seqs = [(s.prompt_ids + s.response_ids, len(s.prompt_ids), s.response_mask) for s in sides]
        ids_BT, attn_BT, labels_BT, mask_BT = pad_batch(seqs, self.pad_token_id, self.device)
        with self.autocast():
            logprobs_BT = token_logprobs(model, ids_BT, attn_BT, labels_BT,
                                         chunk_tokens=self.cfg.actor.logprob_chunk_tokens)
        logps_2B = sequence_logprobs(logprobs_BT, mask_BT, average=self.dpo_cfg.loss_type == "ipo")
        return logps_2B[: len(pairs)], logps_2B[len(pairs):]

    def _ref_logps(self, pairs: list[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [p for p in pairs if id(p) not in self._ref_cache]
        if missing:
            with torch.no_grad():
                c, r = self._seq_logps(self.ref_model, missing)
            for p, lc, lr in zip(missing, c.tolist(), r.tolist()):
                self._ref_cache[id(p)] = (lc, lr)
        vals = [self._ref_cache[id(p)] for p in pairs]
        return (torch.tensor([v[0] for v in vals], device=self.device),
                torch.tensor([v[1] for v in vals], device=self.device))

    def accumulate(self, batch: list[PairExample]) -> dict[str, float]:
        c = self.dpo_cfg
        total = len(batch)
        losses, margins, chosen_r, rejected_r = [], [], [], []
        # Both sides of a pair are in one micro-batch: count each pair twice.
        for mb in pack([2 * p.length for p in batch], self.cfg.actor.mb_max_tokens):
            pairs = [batch[i] for i in mb]
            ref_c, ref_r = self._ref_logps(pairs)
            pol_c, pol_r = self._seq_logps(self.model, pairs)
            losses_B, rc_B, rr_B = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=c.beta,
                                            loss_type=c.loss_type, label_smoothing=c.label_smoothing)
            (losses_B.sum() / total).backward()
            losses += losses_B.detach().tolist()
            chosen_r += rc_B.tolist()
            rejected_r += rr_B.tolist()
            margins += (rc_B - rr_B).tolist()
        return {"dpo/loss": mean(losses), "dpo/margin": mean(margins),
                "dpo/accuracy": mean([float(m > 0) for m in margins]),
                "dpo/chosen_reward": mean(chosen_r), "dpo/rejected_reward": mean(rejected_r),
                "dpo/pairs": float(total)}

    @torch.no_grad()
    def evaluate(self, pairs: list[PairExample]) -> dict[str, float]:
        """Mean implicit-reward margin and accuracy of the current policy on ``pairs``."""
        self.model.eval()
        ref_c, ref_r = self._ref_logps(pairs)
        pol_c, pol_r = self._seq_logps(self.model, pairs)
        margin_B = self.dpo_cfg.beta * ((pol_c - ref_c) - (pol_r - ref_r))
        return {"margin": float(margin_B.mean()), "accuracy": float((margin_B > 0).float().mean()),
                "logp_chosen_minus_rejected": float((pol_c - pol_r).mean())}


def train_dpo(cfg: DPOConfig, *, progress: StepProgress | None = None) -> SupervisedSummary:
    """Run DPO as configured (creates the run directory; resumes from its checkpoint)."""
    model, tokenizer = setup_supervised(cfg)
    ref = None
    if cfg.ref_model_path:
        from ...models.factory import load_model_and_tokenizer

        ref, _ = load_model_and_tokenizer(cfg.ref_model_path, dtype=cfg.actor.param_dtype,
                                          device=cfg.actor.device)
    examples, stats = load_pair_examples(cfg.train_dataset, tokenizer, bus=cfg.bus, seed=cfg.seed)
    return DPOTrainer(cfg, model, tokenizer, examples, ref_model=ref, data_metrics=stats.metrics()).fit(progress)
