"""What a reader checks before it serves a LoRA version (``WeightsEvent.adapter``).

Consumes a weights event and the member's own facts: its :class:`~tapioca.config.lora.LoraSpec`
(None: a full-weights member), the base it serves (``model.path``); emits nothing, or
raises :class:`~tapioca.weights.files.WeightsRefusedError` (dead-lettered at once; the
member keeps serving its version) for:

- an adapter for another base: the event's ``base_id`` is not this member's
  (weights/base_id.py);
- other target modules: the adapter wraps modules other than the ones the run's
  ``actor.lora.target_modules`` resolve to on this member's model (peft's own resolution,
  tapioca.models.lora.resolve_targets);
- a rank over the engine's maximum (``rollout.server.max_lora_rank``), or tensors of
  another rank than the event says;
- an adapter for a member started without ``actor.lora.enabled``, and whole weights for a
  LoRA member (its engine holds the base, which a LoRA run never changes).

The file transport's ``adapter_config.json`` (checksummed with the tensors) must agree
with the event too: a server reads its rank, alpha and modules from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from ..config.lora import LoraSpec
from ..models.lora import ADAPTER_CONFIG_FILE, adapter_rank
from ..schemas.events import WeightsEvent
from .files import WeightsRefusedError


class AdapterGate:
    """One member's checks (its base identity and targets are computed once, lazily:
    a full-weights run never pays for them)."""

    def __init__(self, lora: LoraSpec | None, model_path: str, *, member: str = "this worker") -> None:
        self.lora = lora
        self.model_path = model_path
        self.member = member
        self._base_id: str | None = None
        self._targets: list[str] | None = None

    @property
    def base_id(self) -> str:
        if self._base_id is None:
            from .base_id import base_identity

            self._base_id = base_identity(self.model_path)
        return self._base_id

    @property
    def targets(self) -> list[str]:
        if self._targets is None:
            from ..models.lora import resolve_targets

            self._targets = resolve_targets(self.model_path, self.lora.target_modules)
        return self._targets

    def check(self, event: WeightsEvent) -> None:
        """Refuse an event this member must not serve (see the module docstring)."""
        a, v = event.adapter, event.version
        if a is None:
            if self.lora is not None:
                raise WeightsRefusedError(
                    f"version {v} carries whole weights, but {self.member} serves LoRA adapters "
                    "(actor.lora.enabled) on its base: start the trainer with the same actor.lora.enabled")
            return
        if self.lora is None:
            raise WeightsRefusedError(
                f"version {v} is the LoRA adapter {a.name}, but {self.member} was started without "
                "actor.lora.enabled: start the rollout workers with the trainer's config")
        if a.base_id != self.base_id:
            raise WeightsRefusedError(
                f"adapter {a.name} was trained on base {a.base_id[:12]}…, {self.member} serves base "
                f"{self.base_id[:12]}… ({self.model_path}): point model.path of the trainer and of "
                "the workers at the same model")
        if sorted(a.target_modules) != self.targets:
            raise WeightsRefusedError(
                f"adapter {a.name} wraps {sorted(a.target_modules)}; {self.member} serves adapters on "
                f"{self.targets} (actor.lora.target_modules={list(self.lora.target_modules)}): run the "
                "trainer and the workers with the same actor.lora.target_modules")
        if a.rank > self.lora.max_rank:
            raise WeightsRefusedError(
                f"adapter {a.name} has rank {a.rank}, above the engine's maximum "
                f"rollout.server.max_lora_rank={self.lora.max_rank}: raise it (and restart the "
                "servers) or lower actor.lora.rank")

    def check_tensors(self, event: WeightsEvent, tensors: Mapping[str, torch.Tensor]) -> None:
        """The fetched tensors have the rank the event says."""
        try:
            rank = adapter_rank(tensors)
        except Exception as exc:
            raise WeightsRefusedError(f"version {event.version}: {exc}") from None
        if rank != event.adapter.rank:
            raise WeightsRefusedError(f"adapter {event.adapter.name}: its tensors have rank {rank}, "
                                      f"its event says {event.adapter.rank}")

    def check_directory(self, event: WeightsEvent) -> None:
        """The (checksummed) ``adapter_config.json`` says what the event says."""
        a = event.adapter
        try:
            doc = json.loads((Path(event.path) / ADAPTER_CONFIG_FILE).read_text())
            said = (int(doc["r"]), float(doc["lora_alpha"]), sorted(doc["target_modules"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsRefusedError(f"adapter {a.name}: {event.path}/{ADAPTER_CONFIG_FILE} cannot be "
                                      f"read as a PEFT LoRA config ({exc})") from None
        if said != (a.rank, float(a.alpha), sorted(a.target_modules)):
            raise WeightsRefusedError(
                f"adapter {a.name}: its {ADAPTER_CONFIG_FILE} says rank {said[0]}, alpha {said[1]:g}, "
                f"modules {said[2]}; its event rank {a.rank}, alpha {a.alpha:g}, modules "
                f"{sorted(a.target_modules)}")
