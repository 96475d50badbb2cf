"""The critic of PPO with GAE: a value model, its values and its clipped-value-loss step.

Consumes the step's :class:`~tapioca.trainers.batching.SeqItem` list. :meth:`Critic.values`
emits ``values_BT`` (the value of the state before each sampled token, in the
``[B, T-1]`` layout of ``labels_BT``); :meth:`Critic.train_step` takes items that carry
``token_values`` (the values used for GAE) and ``token_returns`` (the GAE returns) and
makes one optimizer step with the clipped value loss. It has its own AdamW and
learning rate (``critic.lr``); the trainer checkpoints both with the policy.

The value model is a ``transformers`` token-classification model with one label
(``Qwen2ForTokenClassification`` etc.) built from the policy's config. Its backbone
starts from the policy checkpoint's weights (``critic.init_critic_from_actor``, AReaL's
name) and its value head starts at zero, so ``V = 0`` before the first update: the
first advantages are the plain returns instead of noise from a random head.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..algorithms.gae import clipped_value_loss, explained_variance
from ..config.schema import CriticConfig
from ..models.forward import autocast_context, decoder_body
from ..schemas.errors import ConfigError
from .batching import SeqItem, TensorBatch, micro_batches, to_tensors


def _value_config(config: Any) -> Any:
    config = config.__class__.from_dict(config.to_dict())
    config.num_labels = 1
    # Dropout on the value head would add noise to both the targets and the fit.
    config.classifier_dropout = 0.0
    return config


def build_value_model(policy: torch.nn.Module | None = None, *, path: str = "",
                      init_from_policy: bool = True, dtype: str = "float32") -> torch.nn.Module:
    """A one-label token-classification model: from ``path`` (a local HF directory) or
    from ``policy``'s config; backbone weights from that checkpoint when
    ``init_from_policy``; value head zero. Leaves the caller's torch RNG untouched."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        if path:
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(f"critic.path={path!r} has no config.json; point it to a "
                                  "local Hugging Face model directory (or leave it empty)")
            config = _value_config(AutoConfig.from_pretrained(path, local_files_only=True))
            if init_from_policy:
                model = AutoModelForTokenClassification.from_pretrained(
                    path, config=config, dtype=torch_dtype, local_files_only=True)
            else:
                model = AutoModelForTokenClassification.from_config(config, dtype=torch_dtype)
        else:
            if policy is None:
                raise ConfigError("build_value_model needs the policy model or critic.path")
            model = AutoModelForTokenClassification.from_config(_value_config(policy.config),
                                                                 dtype=torch_dtype)
            if init_from_policy:
                model.base_model.load_state_dict(decoder_body(policy).state_dict())
    head = _value_head(model)
    with torch.no_grad():
        head.weight.zero_()
        if getattr(head, "bias", None) is not None:
            head.bias.zero_()
    return model


def _value_head(model: torch.nn.Module) -> torch.nn.Linear:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ConfigError(f"{type(model).__name__} has no 'score'/'classifier' head; use a "
                      "Qwen2 / Qwen3 / Llama model for the critic")


class Critic:
    def __init__(self, model: torch.nn.Module, cfg: CriticConfig, *, pad_token_id: int,
                 device: str | torch.device = "cpu", autocast_dtype: str = "") -> None:
        self.model = model.to(device)
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
            betas=tuple(cfg.adam_betas))
        self.model.eval()

    def _forward(self, batch: TensorBatch) -> torch.Tensor:
        with autocast_context(self.device, self.autocast_dtype):
            out = self.model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT)
        # Position t has read tokens 0..t: the state before the token labels_BT[:, t].
        return out.logits[:, :-1, 0].float()

    @torch.no_grad()
    def values(self, batch: TensorBatch) -> torch.Tensor:
        """``[B, T-1]`` values before the update (0 off the trained tokens)."""
        self.model.eval()
        return torch.where(batch.mask_BT, self._forward(batch), 0.0)

    def train_step(self, items: list[SeqItem]) -> dict[str, float]:
        """One optimizer step (per minibatch) of the clipped value loss; token mean over
        the batch, gradients accumulated over token-balanced micro-batches."""
        missing = [it.group_id for it in items if it.token_values is None or it.token_returns is None]
        if missing:
            raise ValueError(f"critic step: items of groups {missing[:3]} carry no values/returns; "
                             "compute token advantages with the critic first")
        self.model.train()
        mbs = [to_tensors(mb, self.pad_token_id, self.device)
               for mb in micro_batches(items, self.cfg.mb_max_tokens)]
        total = sum(mb.n_tokens for mb in mbs)
        sums = {"value_loss": 0.0, "value_clip_frac": 0.0, "grad_norm": 0.0}
        n = max(1, min(self.cfg.ppo_n_minibatches, len(mbs)))
        for group in (list(range(len(mbs)))[i::n] for i in range(n)):
            tokens = sum(mbs[i].n_tokens for i in group) or 1
            self.optimizer.zero_grad(set_to_none=True)
            for i in group:
                mb = mbs[i]
                if mb.n_tokens == 0:
                    continue
                loss, stats = clipped_value_loss(self._forward(mb), mb.old_values_BT, mb.returns_BT,
                                                 mb.mask_BT, eps_clip=self.cfg.eps_clip)
                (loss * (mb.n_tokens / tokens)).backward()
                for k in ("value_loss", "value_clip_frac"):
                    sums[k] += stats[k] * mb.n_tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            sums["grad_norm"] += float(grad_norm) * tokens
            self.optimizer.step()
        self.model.eval()
        metrics = {f"critic/{k}": v / max(total, 1) for k, v in sums.items()}
        old = torch.cat([torch.tensor(it.token_values) for it in items])
        ret = torch.cat([torch.tensor(it.token_returns) for it in items])
        mask = torch.cat([torch.tensor(it.loss_mask, dtype=torch.bool) for it in items])
        ev = explained_variance(old[None], ret[None], mask[None])
        if math.isfinite(ev):  # undefined when every return is equal: left out, not 0
            metrics["critic/explained_var"] = ev
        metrics["critic/trained_tokens"] = float(total)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
