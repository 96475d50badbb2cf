"""Knowledge distillation from a teacher on a fixed dataset (``tapioca distill``).

Consumes :class:`SeqExample` lists, from the same sources as SFT (see
:mod:`tapioca.trainers.supervised.data`), and a frozen teacher (``teacher_path``, a local
HF directory sharing the student's tokenizer). On every trained response token the
loss is::

    loss = kd_coef * KL(teacher ‖ student) + nll_coef * NLL(dataset token)

both token means over the step's trained tokens, KL over the full vocabulary at
softmax temperature ``temperature`` (:func:`forward_kl_from_hidden`: chunked over
tokens, so no ``[B, T, V]`` fp32 logits of either model). Emits what every supervised
trainer emits (:mod:`tapioca.trainers.supervised.loop`), with ``distill/kl``,
``distill/nll`` and ``distill/loss`` per step.

Vocabularies padded to different sizes (e.g. 151,936 vs 152,064 rows in one model
family) are compared on their shared first ``V`` rows, which must cover the tokenizer:
the KL renormalises both models over those rows. The NLL is the student's own
distribution over its full LM head (the loss the student is evaluated by).
"""

from __future__ import annotations

import torch

from ...algorithms.logprobs import gather_logprobs_entropy
from ...algorithms.supervised import forward_kl_from_hidden
from ...config.supervised import DistillConfig
from ...models.forward import last_hidden
from ...schemas.errors import ConfigError
from ..batching import pack
from .data import SeqExample, load_sft_examples
from .loop import (
    StepProgress,
    SupervisedSummary,
    SupervisedTrainerBase,
    pad_batch,
    setup_supervised,
)


class DistillTrainer(SupervisedTrainerBase[SeqExample]):
    kind = "distill"

    def __init__(self, cfg: DistillConfig, model, tokenizer, examples, *, teacher: torch.nn.Module,
                 data_metrics=None) -> None:
        super().__init__(cfg, model, tokenizer, examples, data_metrics=data_metrics)
        self.teacher = teacher.to(self.device).requires_grad_(False).eval()
        self.kd_cfg = cfg
        v_s = model.get_output_embeddings().weight.shape[0]
        v_t = teacher.get_output_embeddings().weight.shape[0]
        self.vocab = min(v_s, v_t)
        if self.vocab < len(tokenizer):
            raise ConfigError(f"teacher ({v_t} rows) and student ({v_s} rows) share only {self.vocab} "
                              f"vocabulary rows, fewer than the tokenizer's {len(tokenizer)} tokens; "
                              "the teacher must use the student's tokenizer")

    def _kl_nll(self, batch: list[SeqExample], *, grad_nll: bool):
        """Per-token KL ``[N]`` and logprobs ``[N]`` of one micro-batch's trained tokens."""
        seqs = [(ex.prompt_ids + ex.response_ids, len(ex.prompt_ids), ex.response_mask) for ex in batch]
        ids_BT, attn_BT, labels_BT, mask_BT = pad_batch(seqs, self.pad_token_id, self.device)
        with self.autocast():
            h_s_NH = last_hidden(self.model, ids_BT, attn_BT)[:, :-1][mask_BT]
            with torch.no_grad():
                h_t_NH = last_hidden(self.teacher, ids_BT, attn_BT)[:, :-1][mask_BT]
        w_s_VH = self.model.get_output_embeddings().weight
        w_t_VH = self.teacher.get_output_embeddings().weight
        chunk = self.cfg.actor.logprob_chunk_tokens
        # Only the KL compares the two heads, so only it is cut to the shared rows.
        kl_N = forward_kl_from_hidden(h_s_NH, w_s_VH[: self.vocab], h_t_NH, w_t_VH[: self.vocab],
                                      temperature=self.kd_cfg.temperature, chunk_tokens=chunk)
        with torch.set_grad_enabled(grad_nll and torch.is_grad_enabled()):
            logprobs_N, _ = gather_logprobs_entropy(h_s_NH, w_s_VH, labels_BT[mask_BT],
                                                    chunk_tokens=chunk, compute_entropy=False)
        return kl_N, logprobs_N

    def accumulate(self, batch: list[SeqExample]) -> dict[str, float]:
        c = self.kd_cfg
        total = sum(sum(ex.response_mask) for ex in batch) or 1
        kl_sum = nll_sum = 0.0
        for mb in pack([ex.length for ex in batch], self.cfg.actor.mb_max_tokens):
            kl_N, logprobs_N = self._kl_nll([batch[i] for i in mb], grad_nll=c.nll_coef > 0)
            loss = (c.kd_coef * kl_N.sum() - c.nll_coef * logprobs_N.sum()) / total
            if loss.requires_grad:
                loss.backward()
            kl_sum += float(kl_N.detach().sum())
            nll_sum -= float(logprobs_N.detach().sum())
        kl, nll = kl_sum / total, nll_sum / total
        return {"distill/kl": kl, "distill/nll": nll, "distill/loss": c.kd_coef * kl + c.nll_coef * nll,
                "distill/trained_tokens": float(total)}

    @torch.no_grad()
    def evaluate(self, examples: list[SeqExample]) -> dict[str, float]:
        """Token-mean KL(teacher ‖ student) and NLL of the current student on ``examples``."""
        self.model.eval()
        kl_N, logprobs_N = self._kl_nll(examples, grad_nll=False)
        return {"kl": float(kl_N.mean()), "nll": float(-logprobs_N.mean())}


def train_distill(cfg: DistillConfig, *, progress: StepProgress | None = None) -> SupervisedSummary:
    """Distil ``teacher_path`` into the student (``model.path``, or the tiny model)."""
    from ...models.factory import load_model_and_tokenizer

    model, tokenizer = setup_supervised(cfg)
    teacher, _ = load_model_and_tokenizer(cfg.teacher_path, dtype=cfg.teacher_dtype or cfg.model.dtype,
                                          device=cfg.actor.device)
    examples, stats = load_sft_examples(cfg.train_dataset, tokenizer, bus=cfg.bus, seed=cfg.seed)
    return DistillTrainer(cfg, model, tokenizer, examples, teacher=teacher,
                          data_metrics=stats.metrics()).fit(progress)
