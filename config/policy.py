"""What the policy is: one :class:`PolicySpec`, resolved once and carried to the roles.

Consumes a :class:`~tapioca.config.schema.TrainConfig` and its model: ``model.path``'s
``config.json`` (read once, without transformers or torch), or, for the tiny model a run
creates, ``model.arch`` before the checkpoint is written; emits a frozen
:class:`PolicySpec`: the model type, the vision tower (a
:class:`~tapioca.models.families.VisionSpec`, or None), the mixture-of-experts shape (a
:class:`~tapioca.models.families.MoeShape`, or None), the adapter trained on it (the
run's :class:`~tapioca.config.lora.LoraSpec`, or None), the vocabulary size and the
context length.

Where it is resolved: ``runtime/run.py`` (``resolve_run(prepare=True)``: the feature
table, config/features.py, checked with it before any role starts) and
``runtime/builders.py`` (each role process resolves it once and cuts its section with
it, config/sections.py); at load, :class:`TrainConfig` checks the table with the spec the
config alone tells (``read_dir=False``). A role asks ``policy.vision``, ``policy.moe``,
``policy.adapter``, never the model directory again. The readings themselves ("is this
a vision-language / mixture-of-experts model?") are ``models/families.py``'s
:func:`~tapioca.models.families.vision_of` and :func:`~tapioca.models.families.moe_of`;
on a live model (a torch module a test builds), ``models/vision.py``'s ``vision_spec``.

Importable by every role without torch: the module names of the model (:attr:`PolicySpec.modules`,
only a LoRA run naming its target modules asks) are built on demand.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.families import (
    MoeShape,
    VisionSpec,
    moe_of,
    read_config_json,
    text_part,
    tiny_arch_doc,
    vision_of,
)
from .lora import LoraSpec, lora_spec


@dataclass(frozen=True)
class ModuleNames:
    paths: frozenset[str]  # every module path (model.layers.0.self_attn.q_proj, ...)
    linear: frozenset[str]  # the short names of its linear layers (q_proj, ...)

    def unmatched(self, targets: list[str]) -> list[str]:
        """The target names no module matches, by peft's rule for a list (the module's
        path is the name or ends with ``.name``)."""
        return [t for t in targets if not any(p == t or p.endswith("." + t) for p in self.paths)]


@dataclass(frozen=True, kw_only=True)
class PolicySpec:
    """What the policy is. ``known`` is False while the model is not read (at load, when
    ``model.path`` is set; a directory without config.json): every model fact is then
    unknown (None), and the feature table's rows that need the model stay quiet. The
    default is that unknown spec."""

    known: bool = False
    model_type: str = ""
    vision: VisionSpec | None = None
    moe: MoeShape | None = None
    # actor.lora.enabled: the adapter trained on the frozen base (None: full weights).
    adapter: LoraSpec | None = None
    vocab_size: int | None = None
    context_length: int | None = None
    # The model directory it was read from ("": none, the tiny arch before its checkpoint).
    path: str = ""

    @functools.cached_property
    def modules(self) -> ModuleNames | None:
        """The model's module names (built on the meta device, on demand: only a LoRA run
        that names its target modules asks); None when there is no directory to read."""
        if not self.path:
            return None
        from ..models.lora import module_names

        try:
            paths, linear = module_names(self.path)
        except Exception:  # noqa: BLE001 - a fact not known; the model's own load says what is wrong
            return None
        return ModuleNames(frozenset(paths), frozenset(linear))


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def policy_of_config_json(doc: dict, *, path: str = "", adapter: LoraSpec | None = None) -> PolicySpec:
    """The spec of a ``config.json`` dict (a vision-language model's decoder fields are its
    ``text_config``'s, :func:`~tapioca.models.families.text_part`)."""
    text = text_part(doc)
    return PolicySpec(known=True, model_type=str(doc.get("model_type", "")), vision=vision_of(doc),
                      moe=moe_of(doc), adapter=adapter, vocab_size=_int(text.get("vocab_size")),
                      context_length=_int(text.get("max_position_embeddings")), path=path)


def policy_of_dir(path: str, *, adapter: LoraSpec | None = None) -> PolicySpec:
    """The spec of the model directory ``path`` (its config.json); the unknown spec when
    it has none."""
    if not path or not (Path(path) / "config.json").is_file():
        return PolicySpec(adapter=adapter)
    return policy_of_config_json(read_config_json(path), path=str(path), adapter=adapter)


def policy_of_arch(model: Any, *, adapter: LoraSpec | None = None) -> PolicySpec:
    """The spec of the tiny model ``model`` (a ModelConfig) describes, before it is
    written: its family, vision tower and experts; the vocabulary, the context length and
    the vision token ids come with the checkpoint (None here)."""
    doc = tiny_arch_doc(model.arch, num_layers=model.num_layers, num_experts=model.num_experts,
                        num_experts_per_tok=model.num_experts_per_tok)
    return policy_of_config_json(doc, adapter=adapter)


def resolve_policy(cfg: Any, *, read_dir: bool = True) -> PolicySpec:
    """The policy of ``cfg`` (a TrainConfig): ``model.path``'s config.json when
    ``read_dir`` (at start; the unknown spec if it has none); the tiny model's
    ``model.arch`` when ``model.path`` is empty; else (at load) the unknown spec. Its
    adapter is the run's (:func:`~tapioca.config.lora.lora_spec`) in every case."""
    adapter = lora_spec(cfg)
    if not cfg.model.path:
        return policy_of_arch(cfg.model, adapter=adapter)
    if not read_dir:
        return PolicySpec(adapter=adapter)
    return policy_of_dir(cfg.model.path, adapter=adapter)
