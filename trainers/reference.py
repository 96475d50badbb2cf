"""Frozen causal LMs that score the sampled tokens: the KL reference and the KD teacher.

Consumes a :class:`~tapioca.trainers.batching.TensorBatch` (the sampled sequences,
right padded); emits ``logprobs_BT`` of ``labels_BT`` under the frozen model at the
rollout temperature, the same quantity and layout as the rollout's behaviour
log-probs, so the two compare token by token. Never trained: no optimizer, no
gradients, ``eval()`` mode throughout.

The reference defaults to the initial policy: the trainer copies the policy's weights
when it is built, before any checkpoint is loaded (``ref.path`` names another
directory). A LoRA run's initial policy is its frozen base, which the policy already
holds: :class:`AdapterOffReference` scores with the policy's own model, adapters
switched off, instead of a second copy (the memory of one base model saved: 15 GB for
a 7B model in bf16). A teacher always comes from a directory (``distill.teacher_path``) and must
share the policy's vocabulary: distillation compares the two models' log-probs of the
same token ids.

With ``tree_training`` (``actor.enable_tree_training``) the model also gets the packed
forward (:class:`~tapioca.models.packed.PackedCausalLM`) and scores a
:class:`~tapioca.trainers.packing.PackedBatch` (a prefix tree: each shared prompt
computed once) through it; a right-padded batch still goes through the HF forward.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from ..models.forward import autocast_context, causal_token_logprobs, packed_token_logprobs
from ..schemas.errors import ConfigError
from .batching import TensorBatch
from .packing import PackedBatch

log = logging.getLogger(__name__)


class FrozenLogprobModel:
    """Per-token log-probs of sampled tokens under a frozen model (reference / teacher)."""

    def __init__(self, model: torch.nn.Module, *, temperature: float, chunk_tokens: int = 4096,
                 autocast_dtype: str = "", device: str | torch.device = "cpu",
                 name: str = "reference", tree_training: bool = False,
                 attention_backend: str = "auto") -> None:
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.autocast_dtype = autocast_dtype
        self.device = torch.device(device)
        self.name = name
        self.packed = self._packed_forward(attention_backend) if tree_training else None

    def _packed_forward(self, attention_backend: str):
        """The packed forward of this model for prefix trees (None, with a warning, for a
        family it does not run: the padded HF forward scores every batch then)."""
        from ..models.packed import PackedCausalLM, unsupported_reason
        from .prefix_packing import check_packed_tree_backend

        reason = unsupported_reason(self.model)
        if reason is not None:
            log.warning("%s model: tree training does not apply (%s); it scores padded batches", self.name, reason)
            return None
        packed = PackedCausalLM(self.model, attention_backend=attention_backend,
                                autocast_dtype=self.autocast_dtype)
        check_packed_tree_backend(packed)
        return packed

    @classmethod
    def copy_of(cls, policy: torch.nn.Module, **kwargs) -> "FrozenLogprobModel":
        """A frozen copy of ``policy``'s current weights (the initial policy when called
        before training)."""
        return cls(copy.deepcopy(policy), **kwargs)

    @classmethod
    def from_path(cls, path: str | Path, *, vocab_size: int, dtype: str = "float32",
                  **kwargs) -> "FrozenLogprobModel":
        """Load a local HF causal-LM directory; its vocabulary must be ``vocab_size``."""
        from transformers import AutoModelForCausalLM

        name = kwargs.get("name", "reference")
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{name} model: no config.json in {path}; point the {name} path "
                              "to a local Hugging Face model directory")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     local_files_only=True)
        if model.config.vocab_size != vocab_size:
            raise ConfigError(
                f"{name} model at {path} has vocab_size {model.config.vocab_size}, the policy "
                f"{vocab_size}: log-probs of the same token ids are only comparable with the "
                "same tokenizer; use a model of the policy's family")
        return cls(model, **kwargs)

    @torch.no_grad()
    def logprobs(self, batch: TensorBatch) -> torch.Tensor:
        """``[B, T-1]`` log-probs of ``batch.labels_BT`` (0 where the label is -100)."""
        return self._logprobs(batch)

    def _logprobs(self, batch: TensorBatch) -> torch.Tensor:
        with autocast_context(self.device, self.autocast_dtype):
            if isinstance(batch, PackedBatch) and self.packed is not None:
                lp_M, _ = packed_token_logprobs(
                    self.packed, batch.input_ids_N, batch.position_ids_N, batch.seqs, batch.rows_M,
                    batch.labels_M, temperature=self.temperature, chunk_tokens=self.chunk_tokens)
                return batch.to_padded(lp_M).float()
            logp_BT, _ = causal_token_logprobs(
                self.model, batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT,
                temperature=self.temperature, chunk_tokens=self.chunk_tokens)
        return logp_BT.float()


class AdapterOffReference(FrozenLogprobModel):
    """The KL reference of a LoRA run: the policy's own model (shared, not copied, never
    put in eval mode or frozen here) with every adapter off while it scores."""

    def __init__(self, model: torch.nn.Module, *, temperature: float, chunk_tokens: int = 4096,
                 autocast_dtype: str = "", device: str | torch.device = "cpu",
                 name: str = "reference", tree_training: bool = False,
                 attention_backend: str = "auto") -> None:
        # tree_training / attention_backend: config/lora.py refuses tree training in a
        # LoRA run, so this reference always scores padded batches (self.packed None).
        del tree_training, attention_backend
        self.packed = None
        self.model = model
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.autocast_dtype = autocast_dtype
        self.device = torch.device(device)
        self.name = name
        # What a copy would have cost: the base's weights (the adapter is not in a copy's).
        self.saved_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                               if not p.requires_grad)

    @torch.no_grad()
    def logprobs(self, batch: TensorBatch) -> torch.Tensor:
        from ..models.lora import adapter_disabled

        with adapter_disabled(self.model):
            return self._logprobs(batch)
