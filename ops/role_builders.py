"""Building each role from its config section: the one place that wires models,
tokenizers, tasks and engines into the roles. Roles themselves never import each
other; the launcher and `tapioca role` go through here.
"""

from __future__ import annotations

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


def build_engine(model, tokenizer, rollout, *, seed: int, decode: Callable[[list[int]], str]):
    """The in-process engine of a rollout worker or proxy: :class:`PagedEngine` for the
    architectures it runs (unless ``rollout.paged`` is off), else :class:`TorchEngine`."""
    import logging

    from tapioca.engines.model_runner import unsupported_reason
    from tapioca.engines.paged_engine import PagedEngine
    from tapioca.engines.torch_engine import TorchEngine

    common = dict(device=rollout.device, max_batch_size=rollout.max_batch_size,
                  interruptible=rollout.interruptible, seed=seed, decode=decode,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0,
                  max_prefill_tokens=rollout.max_prefill_tokens)
    reason = unsupported_reason(model) if rollout.paged else "rollout.paged is off"
    if reason is None:
        return PagedEngine(model, kv_block_size_tokens=rollout.kv_block_size_tokens,
                           kv_cache_tokens=rollout.kv_cache_tokens,
                           kv_cache_memory_fraction=rollout.kv_cache_memory_fraction,
                           cuda_graphs=rollout.cuda_graphs, prefix_caching=rollout.prefix_caching,
                           **common)
    logging.getLogger(__name__).info("TorchEngine instead of the paged engine: %s", reason)
    return TorchEngine(model, **common)


def build_rollout(cfg: TrainConfig, member: int = 0) -> Role:
    from tapioca.engines.base import SamplingParams
    from tapioca.models.factory import load_model_and_tokenizer
    from tapioca.models.weight_sync import make_weight_loader
    from tapioca.producers.rollout import RolloutWorker

    sec = rollout_section(cfg)
    set_torch_threads(sec.rollout.torch_threads)
    model, tokenizer = load_model_and_tokenizer(sec.model.path, dtype=sec.model.dtype,
                                                device=sec.rollout.device)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = build_engine(model, tokenizer, sec.rollout, seed=sec.seed * 1000 + member, decode=decode)
    del model  # the engine holds what it needs (the paged engine keeps no model object)
    g = sec.gconfig
    sampling = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                              max_new_tokens=g.max_new_tokens, stop_strings=tuple(g.stop))

    # Fetch over the event's transport (file / ipc / nccl), verify, copy at a step boundary.
    load_weights = make_weight_loader(engine, sec.rollout.device, member=f"rollout-{member}")
    return RolloutWorker(engine, load_weights, sampling=sampling, decode=decode,
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
