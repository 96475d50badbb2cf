"""What a trainer version publishes: the policy's payload, full weights or a LoRA adapter.

One object per run (after torchtitan's ``ModelConverter``: the trainer publishes,
announces, rolls back to and finishes with a payload, and never asks which kind it is).
:func:`policy_payload` picks it once from the trainer's section:

- :class:`FullWeights`: every version is the whole model (``actor.full_state_dict``), a
  ``weights/v<version>.safetensors`` file when it has one, and the run leaves a Hugging
  Face directory in ``final/``;
- :class:`AdapterWeights` (``actor.lora.enabled``, docs/lora.md): every version is the
  adapter (PEFT file names), a PEFT adapter directory ``weights/<lora_name>-v<version>``
  when it has a file, for the base ``model.path`` names (its identity); its weights
  events carry a ``WeightsAdapter``, and the run leaves the adapter in ``final/``.

Consumes the actor's ``publish_state_dict`` and the trainer's state (the version; its
file's path and checksum are recorded in its progress); emits the ``WeightsEvent`` of a version (keyed by ``run_id``
by the trainer role that sends it) through the ``weights`` section's transport
(:class:`~tapioca.weights.WeightPublisher`, docs/weight-sync.md), and ``final/``
(trainers/final_model.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config.sections import TrainerSection
from ..schemas.events import WeightsAdapter, WeightsEvent
from ..weights import WeightPublisher
from ..weights.payload import version_path
from .final_model import FINAL_DIR, write_final_adapter, write_final_model
from .trainer_state import TrainerState


class FullWeights:
    """Full weights: each version is every weight of the model."""

    #: The name part of a version's file (weights/payload.py ``version_path``); "": a file.
    file_name = ""

    def __init__(self, section: TrainerSection, actor, *, weights_dir: Path, name: str) -> None:
        """``actor``: the policy (PPOActor or the sharded actor); ``weights_dir``: where
        the versions' files go; ``name``: the publisher's (the trainer's member id)."""
        self.actor = actor
        self.model_path = section.model.path
        self.dtype = getattr(torch, section.model.dtype)
        self.weights_dir = weights_dir
        # How versions reach the engines (the weights section; docs/weight-sync.md).
        self.out = WeightPublisher.from_config(
            section.weights, weights_dir, device=section.actor.device, publish_dtype=self.dtype,
            name=name, adapter=self._adapter_files())

    def _adapter_files(self):
        """What the durable writer writes for a version beyond its tensors (weights/durable.py
        ``AdapterFiles``: a PEFT directory's config); None: one safetensors file."""
        return None

    def adapter(self, version: int) -> WeightsAdapter | None:
        """What a version's event says of its adapter (None: full weights)."""
        return None

    def path(self, version: int) -> Path:
        """Where ``version``'s file (or adapter directory) is written."""
        return version_path(self.weights_dir, version, self.file_name)

    def publish(self, state: TrainerState) -> WeightsEvent:
        """The bytes of the state's version, published over the transport; its file's path
        and checksum go into the state's progress, and the durable files finished since the
        last weights event into the event (``WeightsEvent.files``)."""
        p = state.progress
        # file: written (sha256) before the event; ipc / nccl: the file, if this version
        # gets one, is written in the background after the event (the trainer polls for it).
        fields = self.out.publish(self.actor.publish_state_dict(), p.version)
        p.weights_path, p.weights_sha256 = fields["path"] or str(self.path(p.version).resolve()), fields["sha256"]
        return WeightsEvent(version=p.version, **fields, files=state.take_files(), adapter=self.adapter(p.version))

    def announce(self, state: TrainerState) -> WeightsEvent:
        """The current version's bytes again (at start; with the durable files finished):
        published anew when its file is gone, or a restarted trainer's buffers are empty."""
        p = state.progress
        fields = self.out.announcement(p.version, p.weights_path, p.weights_sha256)
        if fields is None:
            return self.publish(state)
        return WeightsEvent(version=p.version, **fields, files=state.take_files(), adapter=self.adapter(p.version))

    def misfit(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The names of a version file's tensors that do not fit the actor (a rollback's
        check): unknown, or of another shape."""
        own = self.actor.publish_state_dict()
        wrong = [k for k, t in tensors.items() if k not in own or own[k].shape != t.shape]
        return wrong or self._missing(own, tensors)

    def _missing(self, own: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> list[str]:
        return []  # a full-weights file may leave out tied weights (stored once)

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a version's tensors (as :meth:`publish` published them) into the actor."""
        self.actor.load_publish_state_dict(tensors)

    def write_final(self, run_dir: Path) -> Path:
        """``final/``: the run's result as a Hugging Face directory (trainers/final_model.py)."""
        return write_final_model(self.model_path, self.actor.full_state_dict(), run_dir / FINAL_DIR,
                                 dtype=self.dtype)


class AdapterWeights(FullWeights):
    """A LoRA run: each version is the adapter, for the frozen base ``model.path``."""

    def __init__(self, section: TrainerSection, actor, **kwargs) -> None:
        from ..models.lora import adapter_config
        from ..weights.base_id import base_identity

        self.lora = section.lora
        self.file_name = self.lora.name
        self.adapter_doc = adapter_config(rank=self.lora.rank, alpha=self.lora.alpha,
                                          targets=actor.lora_targets, base_model_path=section.model.path)
        self.base_id = base_identity(section.model.path)
        super().__init__(section, actor, **kwargs)

    def _adapter_files(self):
        from ..models.lora import adapter_config_bytes
        from ..weights.durable import AdapterFiles

        return AdapterFiles(self.lora.name, adapter_config_bytes(self.adapter_doc))

    def adapter(self, version: int) -> WeightsAdapter:
        from ..weights.adapter_files import adapter_name

        return WeightsAdapter(name=adapter_name(self.lora.name, version), peft_type=self.lora.peft_type,
                              rank=self.lora.rank, alpha=float(self.lora.alpha),
                              target_modules=list(self.actor.lora_targets), base_id=self.base_id)

    def _missing(self, own: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> list[str]:
        return sorted(set(own) ^ set(tensors))  # the adapter must be whole

    def write_final(self, run_dir: Path) -> Path:
        """``final/``: the PEFT adapter (``tapioca lora-merge`` merges it into its base)."""
        return write_final_adapter(self.actor.publish_state_dict(), self.adapter_doc, run_dir / FINAL_DIR,
                                   dtype=self.dtype)


def policy_payload(section: TrainerSection, actor, *, weights_dir: Path, name: str) -> FullWeights:
    """The run's payload: the adapter with ``actor.lora.enabled`` (``section.lora``), else full weights."""
    kind = FullWeights if section.lora is None else AdapterWeights
    return kind(section, actor, weights_dir=weights_dir, name=name)
