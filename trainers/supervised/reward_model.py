"""Bradley-Terry reward-model training (``tapioca rm``).

Consumes :class:`PairExample` lists, from the same sources as DPO (see
:mod:`tapioca.trainers.supervised.data`). The model is the policy's backbone with a
one-label sequence-classification head: ``AutoModelForSequenceClassification`` with
``num_labels=1`` loaded from ``model.path`` (a causal-LM checkpoint: the backbone's
weights load, the ``score`` head starts random; for Qwen2 this is
``Qwen2ForSequenceClassification``). The reward of a sequence is the head applied to
the hidden state of its last real token (taken from the attention mask, so a pad token
equal to eos does not shift it).

Emits what every supervised trainer emits (:mod:`tapioca.trainers.supervised.loop`), with
``rm/loss`` (``-log σ(r_c - r_r)``, mean over the step's pairs), ``rm/accuracy``
(share of pairs with ``r_c > r_r``), ``rm/margin``; ``final/`` holds the
sequence-classification model and tokenizer.
"""

from __future__ import annotations

import torch

from ...algorithms.preference import bradley_terry_loss
from ...config.supervised import RewardModelConfig
from ...schemas.errors import ConfigError, TapiocaError
from ..batching import pack
from .data import PairExample, load_pair_examples
from .loop import (
    StepProgress,
    SupervisedSummary,
    SupervisedTrainerBase,
    mean,
    pad_batch,
    setup_supervised,
)


def load_reward_model(path: str, *, dtype: str = "float32", device: str = "cpu"):
    """``(model, tokenizer)``: a one-label sequence classifier on the backbone at ``path``."""
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not (Path(path) / "config.json").is_file():
        raise TapiocaError(f"no model at {path} (config.json missing); set model.path to a local "
                           "Hugging Face directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized" is the point here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=getattr(torch, dtype), local_files_only=True)
    except ValueError as exc:
        raise ConfigError(f"{path}: transformers has no sequence-classification class for this "
                          f"architecture ({exc}); use a qwen2 / qwen3 / llama backbone") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
    if not hasattr(model, "score"):
        raise ConfigError(f"{type(model).__name__} has no `score` head; use a qwen2 / qwen3 / llama backbone")
    return model.to(device), tokenizer


def sequence_rewards(model: torch.nn.Module, input_ids_BT: torch.Tensor,
                     attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """``rewards_B``: the score head on the hidden state of each sequence's last real token."""
    hidden_BTH = model.base_model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).last_hidden_state
    last_B = attention_mask_BT.sum(-1) - 1
    pooled_BH = hidden_BTH[torch.arange(hidden_BTH.shape[0], device=hidden_BTH.device), last_B]
    return model.score(pooled_BH).squeeze(-1).float()


class RewardModelTrainer(SupervisedTrainerBase[PairExample]):
    kind = "rm"

    def __init__(self, cfg: RewardModelConfig, model, tokenizer, examples, *, data_metrics=None) -> None:
        super().__init__(cfg, model, tokenizer, examples, data_metrics=data_metrics)
        self.center = cfg.center_rewards_coefficient

    def _rewards(self, pairs: list[PairExample]) -> tuple[torch.Tensor, torch.Tensor]:
        sides = [p.side(True) for p in pairs] + [p.side(False) for p in pairs]
        seqs = [(s.prompt_ids + s.response_ids, len(s.prompt_ids), s.response_mask) for s in sides]
        ids_BT, attn_BT, _, _ = pad_batch(seqs, self.pad_token_id, self.device)
        with self.autocast():
            r_2B = sequence_rewards(self.model, ids_BT, attn_BT)
        return r_2B[: len(pairs)], r_2B[len(pairs):]

    def accumulate(self, batch: list[PairExample]) -> dict[str, float]:
        total = len(batch)
        losses, correct, margins = [], [], []
        for mb in pack([2 * p.length for p in batch], self.cfg.actor.mb_max_tokens):
            rc_B, rr_B = self._rewards([batch[i] for i in mb])
            losses_B, correct_B = bradley_terry_loss(rc_B, rr_B, center_rewards_coefficient=self.center)
            (losses_B.sum() / total).backward()
            losses += losses_B.detach().tolist()
            correct += correct_B.float().tolist()
            margins += (rc_B - rr_B).detach().tolist()
        return {"rm/loss": mean(losses), "rm/accuracy": mean(correct), "rm/margin": mean(margins),
                "rm/pairs": float(total)}

    @torch.no_grad()
    def evaluate(self, pairs: list[PairExample]) -> dict[str, float]:
        """Accuracy (``r_c > r_r``) and mean margin of the current model on ``pairs``."""
        self.model.eval()
        rc_B, rr_B = self._rewards(pairs)
        return {"accuracy": float((rc_B > rr_B).float().mean()), "margin": float((rc_B - rr_B).mean())}


def train_reward_model(cfg: RewardModelConfig, *, progress: StepProgress | None = None) -> SupervisedSummary:
    """Train a Bradley-Terry reward model as configured (resumes from its checkpoint)."""
    setup_supervised(cfg, load_policy=False)
    model, tokenizer = load_reward_model(cfg.model.path, dtype=cfg.actor.param_dtype, device=cfg.actor.device)
    examples, stats = load_pair_examples(cfg.train_dataset, tokenizer, bus=cfg.bus, seed=cfg.seed)
    return RewardModelTrainer(cfg, model, tokenizer, examples, data_metrics=stats.metrics()).fit(progress)
