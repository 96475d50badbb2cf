"""Building each role from its config section: the one place that wires models,
tokenizers, tasks and engines into the roles. Roles themselves never import each
other; the launcher and `tapioca role` go through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from tapioca.bus.role import Role
from tapioca.config.schema import DatasetConfig, TrainConfig
from tapioca.config.sections import (
    advantage_section,
    feeder_section,
    reward_section,
    rollout_section,
    trainer_section,
)
from tapioca.schemas.errors import ConfigError

ROLES = ("feeder", "rollout", "reward", "advantage", "trainer", "archiver")


def set_torch_threads(n: int) -> None:
    """Intra-op threads of this process's PyTorch (at least 1); shared by the role
    builders and `tapioca proxy`."""
    import torch

    torch.set_num_threads(max(1, n))


def _tokenizer(path: str):
    from tapioca.models.tokenizer import load_tokenizer

    if not path:
        raise ConfigError("model.path is empty; `tapioca train` creates the tiny model, or set "
                          "model.path to a local Hugging Face directory")
    return load_tokenizer(path)


def dataset_rows(ds: DatasetConfig, seed: int) -> tuple[str, Iterable[dict[str, Any]]]:
    """(task name, rows with prompt_id, messages|prompt, answer) for a dataset config."""
    from tapioca.tasks.base import get_task

    if ds.type == "synthetic":
        return "synthetic", get_task("synthetic", **ds.task_options).iter_records(ds.split, seed)
    if ds.type == "gsm8k":
        return "gsm8k", get_task("gsm8k", path=ds.path or None, **ds.task_options).iter_records(ds.split, seed)
    from tapioca.tasks.datasets import read_records

    def rows():
        for i, row in enumerate(read_records(ds.path)):
            if ds.prompt_key not in row:
                raise ConfigError(f"dataset row {i} of {ds.path} has no {ds.prompt_key!r}; set "
                                  "train_dataset.prompt_key to the prompt column")
            yield {"prompt_id": str(row.get("id", i)), "prompt": str(row[ds.prompt_key]),
                   "answer": str(row.get(ds.answer_key, ""))}

    return "math", rows()


def prompt_encoder(tokenizer) -> Callable[[dict[str, Any]], tuple[list[int], str]]:
    def encode(row: dict[str, Any]) -> tuple[list[int], str]:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in messages)
        return tokenizer(text, add_special_tokens=False)["input_ids"], text

    return encode


def build_feeder(cfg: TrainConfig) -> Role:
    from tapioca.producers.feeder import PromptFeeder, tokenize_records

    sec = feeder_section(cfg)
    task, rows = dataset_rows(sec.train_dataset, sec.seed)
    records = tokenize_records(rows, prompt_encoder(_tokenizer(sec.model_path)), task)
    return PromptFeeder(records, n_samples=sec.n_samples,
                        prompts_per_step=sec.train_dataset.prompts_per_step,
                        max_head_offpolicyness=sec.max_head_offpolicyness,
                        max_epochs=sec.train_dataset.max_epochs, shuffle=sec.train_dataset.shuffle,
                        seed=sec.seed, run_tag=cfg.bus_run_id)


def in_process_engine(hf_model, tokenizer, rollout, *, seed: int,
                      decode: Callable[[list[int]], str]):
    """The in-process engine for a loaded transformers model: :class:`PagedEngine` for the
    architectures it runs (unless ``rollout.paged`` is off), else :class:`TorchEngine`."""
    import logging

    from tapioca.engines.model_runner import unsupported_reason
    from tapioca.engines.paged_engine import PagedEngine
    from tapioca.engines.torch_engine import TorchEngine

    common = dict(device=rollout.device, max_batch_size=rollout.max_batch_size,
                  interruptible=rollout.interruptible, seed=seed, decode=decode,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0,
                  max_prefill_tokens=rollout.max_prefill_tokens)
    reason = unsupported_reason(hf_model) if rollout.paged else "rollout.paged is off"
    if reason is None:
        return PagedEngine(hf_model, kv_block_size_tokens=rollout.kv_block_size_tokens,
                           kv_cache_tokens=rollout.kv_cache_tokens,
                           kv_cache_memory_fraction=rollout.kv_cache_memory_fraction,
                           cuda_graphs=rollout.cuda_graphs, prefix_caching=rollout.prefix_caching,
                           **common)
    logging.getLogger(__name__).info("TorchEngine instead of the paged engine: %s", reason)
    return TorchEngine(hf_model, **common)


@dataclass
class EngineBundle:
    """An inference engine and what its callers need besides: ``load_weights(event)``
    (fetch over the event's transport, verify, load) and the model's context length
    (None if unknown)."""

    engine: Any
    load_weights: Callable[[Any], None]
    max_context_tokens: int | None


def build_engine(model, rollout, *, seed: int, tokenizer, log_dir: str, member: int = 0,
                 name: str = "rollout") -> EngineBundle:
    """The engine of ``rollout.engine`` for ``model`` (ModelConfig): the in-process engine
    (:func:`in_process_engine`), or a vLLM / SGLang server adapter (launching the server
    when ``rollout.server.urls`` is empty). Shared by the rollout workers and the proxy."""
    from pathlib import Path

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    eos = tokenizer.eos_token_id
    if rollout.engine == "torch":
        from tapioca.models.factory import load_model_and_tokenizer
        from tapioca.models.weight_sync import make_weight_loader

        set_torch_threads(rollout.torch_threads)
        hf_model, _ = load_model_and_tokenizer(model.path, dtype=model.dtype, device=rollout.device)
        context = getattr(hf_model.config, "max_position_embeddings", None)
        engine = in_process_engine(hf_model, tokenizer, rollout, seed=seed, decode=decode)
        del hf_model  # the engine holds what it needs (the paged engine keeps no model object)
        # Fetch over the event's transport (file / ipc / nccl), verify, copy at a step boundary.
        return EngineBundle(engine, make_weight_loader(engine, rollout.device,
                                                       member=f"{name}-{member}"), context)

    from tapioca.engines.server_launch import launch_server
    from tapioca.engines.sglang_engine import SGLangEngine
    from tapioca.engines.vllm_engine import VLLMEngine
    from tapioca.models.weight_files import WeightsChecksumError, sha256_file

    if not rollout.interruptible:
        raise ConfigError(f"rollout.engine={rollout.engine} always continues in-flight requests "
                          "across weight updates; set rollout.interruptible=true")
    srv = rollout.server
    per_server = srv.max_inflight_per_server or rollout.max_batch_size
    launched = []
    urls = list(srv.urls)
    if not urls:
        launched.append(launch_server(
            rollout.engine, srv, model_path=model.path, device=rollout.device, dtype=model.dtype,
            max_num_seqs=per_server, threads=rollout.torch_threads,
            log_path=Path(log_dir) / f"{rollout.engine}-server-{member}.log"))
        urls = [launched[0].url]
    cls = VLLMEngine if rollout.engine == "vllm" else SGLangEngine
    try:
        engine = cls(urls, config=srv, model_path=model.path, max_inflight_per_server=per_server,
                     eos_token_ids=[eos] if isinstance(eos, int) else list(eos or ()),
                     seed=seed, launched=launched)
    except BaseException:
        for server in launched:
            server.stop()
        raise

    def load_server_weights(event) -> None:
        if event.transport != "file" or not event.path:
            raise ConfigError(
                f"weights version {event.version} comes over {event.transport!r}; the "
                f"{rollout.engine} adapter reloads safetensors files only (device-to-device "
                "updates to servers are not wired yet): set actor.weight_transport=file")
        # The server reads the file itself; it is checked here first, as the torch path does.
        if not Path(event.path).exists():
            raise WeightsChecksumError(f"weights file {event.path} does not exist; is the run "
                                       "directory shared with this process and the server?")
        actual = sha256_file(event.path)
        if actual != event.sha256:
            raise WeightsChecksumError(f"weights file {event.path} has sha256 {actual[:12]}…, the "
                                       f"event announced {event.sha256[:12]}…; not loading it")
        engine.update_weights(event.path, event.version)

    return EngineBundle(engine, load_server_weights, engine.max_context_tokens)


def build_rollout(cfg: TrainConfig, member: int = 0) -> Role:
    import os

    from tapioca.engines.base import SamplingParams
    from tapioca.producers.rollout import RolloutWorker

    sec = rollout_section(cfg)
    tokenizer = _tokenizer(sec.model.path)
    bundle = build_engine(sec.model, sec.rollout, seed=sec.seed * 1000 + member,
                          tokenizer=tokenizer, log_dir=os.path.join(cfg.run_path, "logs"),
                          member=member)
    g = sec.gconfig
    sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                              max_new_tokens=g.max_new_tokens, stop_strings=tuple(g.stop))
    return RolloutWorker(bundle.engine, bundle.load_weights, sampling=sampling,
                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         member_id=f"rollout-{member}")


def build_reward(cfg: TrainConfig) -> Role:
    from tapioca.consumers.reward_scorer import RewardScorer
    from tapioca.tasks.base import get_task

    sec = reward_section(cfg)
    if sec.reward.scorer == "none":
        raise ConfigError("reward.scorer is none: this run has no built-in scorer process "
                          "(rewards come from an external service, docs/reward-services.md); "
                          "set reward.scorer to auto or a task name to run one")
    fixed = None if sec.reward.scorer == "auto" else get_task(sec.reward.scorer)

    from tapioca.tasks.math_reward import math_reward

    tasks: dict[str, Any] = {}

    def reward_fn(event) -> float:
        answer = str(event.task_data.get("answer", ""))
        if fixed is not None:
            return fixed.reward(event.output_text, answer)
        if not event.task or event.task == "math":
            return math_reward(event.output_text, answer)
        if event.task not in tasks:
            tasks[event.task] = get_task(event.task)
        return tasks[event.task].reward(event.output_text, answer)

    return RewardScorer(reward_fn, scorer=sec.reward.scorer, timeout_s=sec.reward.timeout_s)


def build_advantage(cfg: TrainConfig) -> Role:
    from tapioca.consumers.advantage import AdvantageProcessor

    return AdvantageProcessor.from_section(advantage_section(cfg))


def build_trainer(cfg: TrainConfig) -> Role:
    from tapioca.models.factory import load_model_and_tokenizer
    from tapioca.trainers.ppo_actor import PPOActor
    from tapioca.trainers.trainer import Trainer

    sec = trainer_section(cfg)
    set_torch_threads(sec.actor.torch_threads)
    import torch

    torch.manual_seed(sec.seed)
    if sec.fsdp.world_size > 1:  # FSDP2 over N ranks; ranks > 0 serve rank 0 and exit in here
        from tapioca.trainers.fsdp_actor import build_sharded_actor

        return Trainer(build_sharded_actor(cfg, sec), sec)
    model, tokenizer = load_model_and_tokenizer(sec.model.path, dtype=sec.actor.param_dtype,
                                                device=sec.actor.device)
    actor = PPOActor(model, sec.actor, temperature=sec.temperature,
                     pad_token_id=tokenizer.pad_token_id or 0, device=sec.actor.device)
    return Trainer(actor, sec)


def build_archiver(cfg: TrainConfig) -> Role:
    from tapioca.config.sections import archive_section
    from tapioca.consumers.archiver import ALL_TOPICS, Archiver

    sec = archive_section(cfg)
    a = sec.archive
    return Archiver(sec.dir, topics=tuple(a.topics) or ALL_TOPICS, roll_bytes=a.roll_bytes,
                    roll_interval_s=a.roll_interval_s, compression=a.compression)


def build_role(name: str, cfg: TrainConfig, member: int = 0) -> Role:
    if name == "feeder":
        return build_feeder(cfg)
    if name == "rollout":
        return build_rollout(cfg, member)
    if name == "reward":
        return build_reward(cfg)
    if name == "advantage":
        return build_advantage(cfg)
    if name == "trainer":
        return build_trainer(cfg)
    if name == "archiver":
        return build_archiver(cfg)
    raise ConfigError(f"unknown role {name!r}; roles are {', '.join(ROLES)}")
