"""Regenerate a logged trajectory of a run (`tapioca regenerate`, docs/provenance.md).

Consumes a run's resolved config (its ``config.yaml``: model, ``gconfig``, ``rollout``
engine settings), one :class:`~tapioca.schemas.events.TrajectoryEvent` and its prompt's
sampling overrides (``PromptEvent.sampling``), and the run's weights files; emits the
regenerated :class:`~tapioca.engines.base.GenResult` and its
:class:`~tapioca.engines.regenerate.Comparison` with the log.

The engine is the one the rollout workers ran -- the paged engine with the run's
``rollout`` settings (block size, CUDA graphs, prefix caching, dtype, device) -- built
from ``model.path`` and fed each version's weights file right before the step that
sampled that version's first token (engines/regenerate.py ``ScheduledEngine``). Version 0
is the initial model itself, as a rollout worker starts with it. Anything that makes
the replay impossible is a :class:`CannotRegenerateError` (exit code 2) saying why.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from ..config.schema import TrainConfig
from ..engines.base import GenRequest, SamplingParams
from ..schemas.errors import CannotRegenerateError
from ..schemas.events import TrajectoryEvent


def sampling_of(cfg: TrainConfig, traj: TrajectoryEvent, prompt_sampling: Mapping[str, Any] | None) -> SamplingParams:
    """The request the rollout worker made: the run's ``gconfig``, the prompt's overrides,
    the trajectory's seed."""
    if traj.sampling_seed is None:
        raise CannotRegenerateError(
            f"trajectory {traj.traj_id} has no sampling_seed: it was made by an engine that does not "
            "key its draws per request (TorchEngine, a vLLM / SGLang server), by the agent proxy (several "
            "requests per trajectory), or before seeds were logged; only the paged engine's rollout "
            "trajectories can be regenerated")
    base = SamplingParams.from_generation(cfg.gconfig).with_overrides(prompt_sampling)
    return replace(base, seed=traj.sampling_seed)


def weights_of(run_dir: str | Path, versions: set[int]):
    """``version -> state dict`` (None for version 0: the initial model) for the versions a
    trajectory used; every file must still be on disk (the trainer keeps its last few)."""
    from ..weights.files import WEIGHTS_DIR, saved_versions

    wdir = Path(run_dir) / WEIGHTS_DIR
    saved = dict(saved_versions(wdir))
    missing = sorted(v for v in versions if v > 0 and v not in saved)
    if missing:
        have = f"v{min(saved)}..v{max(saved)}" if saved else "none"
        raise CannotRegenerateError(
            f"the weights of version(s) {missing} are no longer in {wdir} (it holds {have}; the trainer "
            "keeps only its last versions' files, weights.keep_versions): regenerate a newer "
            "trajectory, or keep more versions on disk")

    def load(version: int):
        if version <= 0:
            return None  # the engine was built from the initial model, as the rollout's was
        from safetensors.torch import load_file

        return load_file(str(saved[version]))

    return load


def regenerate(cfg: TrainConfig, traj: TrajectoryEvent, prompt_sampling: Mapping[str, Any] | None = None,
               *, run_dir: str | Path | None = None, device: str | None = None):
    """``(GenResult, Comparison)`` of regenerating ``traj`` with the run's engine settings
    and the weights files of ``run_dir`` (default: the config's run path). ``device``
    overrides ``rollout.device`` (the same device *type* is what is promised)."""
    from ..engines.model_runner import unsupported_reason
    from ..engines.regenerate import ScheduledEngine, compare
    from ..models.factory import load_model_and_tokenizer
    from .builders import engine_kwargs, paged_engine_kwargs

    sampling = sampling_of(cfg, traj, prompt_sampling)
    rollout = cfg.rollout if device is None else replace(cfg.rollout, device=device)
    if rollout.engine != "torch" or not rollout.paged:
        raise CannotRegenerateError(
            f"the run generated with rollout.engine={rollout.engine} (paged {rollout.paged}); regeneration "
            "replays the in-process paged engine's keyed draws only")
    if cfg.actor.lora.enabled:
        raise CannotRegenerateError("a LoRA run's versions are adapters: regenerating them is not supported yet")
    if traj.images:
        raise CannotRegenerateError(f"trajectory {traj.traj_id} has images: regenerating vision-language "
                                    "trajectories is not supported yet")
    load = weights_of(run_dir or cfg.run_path, set(traj.output_versions))
    model, tokenizer = load_model_and_tokenizer(cfg.model.path, dtype=cfg.model.dtype, device=rollout.device)
    reason = unsupported_reason(model)
    if reason is not None:
        raise CannotRegenerateError(f"the paged engine cannot run this model ({reason}): its trajectories "
                                    "came from TorchEngine, which does not key draws per request")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = ScheduledEngine(model, schedule=list(traj.output_versions) or [0], weights=load,
                             **paged_engine_kwargs(rollout), **engine_kwargs(rollout, tokenizer, seed=0,
                                                                             decode=decode))
    del model
    try:
        (result,) = engine.generate([GenRequest(traj.traj_id, list(traj.prompt_ids), sampling)])
    finally:
        engine.shutdown()
    return result, compare(traj.output_ids, traj.output_logprobs, traj.output_versions, result)

