"""Building each role's objects from its config section: the one place that wires
models, tokenizers, tasks, engines and weights loaders into the roles.

Consumes a resolved :class:`~tapioca.config.schema.TrainConfig` (:mod:`tapioca.runtime.run`)
and the role's name and member index; emits a role ready for a
:class:`~tapioca.bus.runner.RoleRunner` (or, for `tapioca proxy`, the proxy's service).
Each role gets its section (:mod:`tapioca.config.sections`) and the runtime objects
built here: the feeder its tokenized records, a rollout worker its engine and weights
loader (the proxy the same pair), the reward scorer its task's reward function, the
trainer its actor and the critic / reference / teacher its token-level advantages need.
Roles never import each other or this module; the launcher, `tapioca role`,
`tapioca proxy` and `tapioca train-offline` build through here.

What the policy is (:class:`~tapioca.config.policy.PolicySpec`: vision tower, MoE shape,
adapter, ...) is resolved once per role here (:func:`run_policy`, from ``model.path``'s
config.json) and carried in the role's section; the helpers below ask it, never the
model directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..bus.role import Role
from ..config.policy import PolicySpec, policy_of_dir, resolve_policy
from ..config.schema import TrainConfig, kv_tokens_needed
from ..config.sections import (
    EvalSection,
    TrainerSection,
    advantage_section,
    archive_section,
    eval_section,
    feeder_section,
    proxy_section,
    reward_section,
    rollout_section,
    trainer_section,
)
from ..schemas.errors import ConfigError

log = logging.getLogger(__name__)

ROLES = ("feeder", "rollout", "reward", "advantage", "trainer", "archiver", "evaluator")


def run_policy(cfg: TrainConfig) -> PolicySpec:
    """The run's policy, read from ``model.path`` (resolved by the launcher) with the run's
    adapter: what every section of this process carries."""
    return resolve_policy(cfg)


def set_torch_threads(n: int) -> None:
    """Intra-op threads of this process's PyTorch (at least 1)."""
    import torch

    torch.set_num_threads(max(1, n))


def _tokenizer(path: str):
    from ..models.tokenizer import load_tokenizer

    if not path:
        raise ConfigError("model.path is empty; `tapioca train` creates the tiny model, or set "
                          "model.path to a local Hugging Face directory (e.g. "
                          "runs/<experiment>/<trial>/model, or one made by `tapioca model-init DIR`)")
    # The char tokenizer must not be reloaded as Qwen's byte-level one (see load_tokenizer).
    return load_tokenizer(path)


# ---------------------------------------------------------------- images (docs/vlm.md)


def image_store(vlm):
    """The run's image store (``vlm.image_store``)."""
    from ..media.store import open_image_store

    return open_image_store(vlm.image_store)


def vision_prompts(policy: PolicySpec, tokenizer, vlm, *, budget=None):
    """Prompts with images for the policy (None when it has no vision tower)."""
    from ..models.vision import VisionPrompts

    if policy.vision is None:
        return None
    return VisionPrompts(policy.path, tokenizer, image_store(vlm), max_pixels=vlm.max_image_pixels,
                         max_bytes=vlm.max_image_bytes, inline_max_bytes=vlm.inline_image_max_bytes,
                         budget=budget, spec=policy.vision)


def image_loader(model_path: str, vlm, *, budget=None):
    """Refs -> checked bytes and the processor's tensors (models/vision.py ``ImageLoader``)
    under the run's image rule (``vlm.max_image_pixels`` / ``max_image_bytes``)."""
    from ..media.images import ImageRule
    from ..models.vision import ImageLoader, ImageProcessor

    return ImageLoader(image_store(vlm), ImageProcessor.from_dir(model_path), rule=ImageRule.of(vlm),
                       budget=budget)


def decoding_budget(vlm, retry_after_s: int = 5):
    """The proxy's bound on decoded pixels in flight (``vlm.max_decoding_pixels``)."""
    from ..media.images import PixelBudget

    return PixelBudget(vlm.max_decoding_pixels, wait_s=vlm.decoding_wait_s, retry_after_s=retry_after_s)


def request_images(policy: PolicySpec, vlm, *, pixels: bool, budget=None):
    """``(refs, given=None) -> RequestImages`` for an engine of the policy: the bytes
    (``given``: sha256 -> bytes of images not stored yet, else the image store's), each
    admitted by the run's image rule, and (``pixels``: an in-process engine runs the
    tower) the processor's tensors; None for a policy without a vision tower."""
    from ..engines.base import RequestImages

    if policy.vision is None:
        return None
    loader = image_loader(policy.path, vlm, budget=budget)

    def prepare(refs, given=None) -> RequestImages:
        shas = [r.sha256 for r in refs]
        if pixels:
            pv, grids = loader.pixels(refs, given)
            return RequestImages(shas, grids, pv)
        grids, blobs = loader.grids(refs, given)
        return RequestImages(shas, grids, None, [(r.mime, b) for r, b in zip(refs, blobs)])

    return prepare


# ---------------------------------------------------------------- engines and weights


def engine_kwargs(rollout, tokenizer, *, seed: int, decode: Callable[[list[int]], str]) -> dict:
    """The in-process engines' settings from ``rollout`` (both engines take them)."""
    return dict(device=rollout.device, max_batch_size=rollout.max_batch_size,
                interruptible=rollout.interruptible, seed=seed, decode=decode,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0,
                max_prefill_tokens=rollout.max_prefill_tokens)


def paged_engine_kwargs(rollout) -> dict:
    """The paged engine's own settings from ``rollout`` (a regeneration builds its engine
    with the same ones, runtime/regenerate.py)."""
    return dict(kv_block_size_tokens=rollout.kv_block_size_tokens, kv_cache_tokens=rollout.kv_cache_tokens,
                kv_cache_memory_fraction=rollout.kv_cache_memory_fraction,
                cuda_graphs=rollout.cuda_graphs, prefix_caching=rollout.prefix_caching)


def in_process_engine(hf_model, tokenizer, rollout, *, seed: int,
                      decode: Callable[[list[int]], str], record_routes: bool = False,
                      kv_need_tokens: int = 0):
    """The in-process engine for a loaded transformers model: :class:`PagedEngine` for the
    architectures it runs (unless ``rollout.paged`` is off), else :class:`TorchEngine`.
    ``record_routes``: results carry their routed experts (the paged engine only).
    ``kv_need_tokens``: the KV-cache tokens its callers need at most (0: unknown; the
    cache is then sized by ``rollout.kv_cache_memory_fraction`` alone)."""
    from ..engines.model_runner import unsupported_reason
    from ..engines.paged_engine import PagedEngine
    from ..engines.torch_engine import TorchEngine
    from ..models.families import in_process_reason

    cannot = in_process_reason(hf_model.config)
    if cannot is not None:
        raise ConfigError(cannot)

    common = engine_kwargs(rollout, tokenizer, seed=seed, decode=decode)
    reason = unsupported_reason(hf_model) if rollout.paged else "rollout.paged is off"
    if reason is None:
        return PagedEngine(hf_model, **paged_engine_kwargs(rollout), kv_cache_need_tokens=kv_need_tokens,
                           sleep_mode=bool(rollout.enable_sleep_mode), record_routes=record_routes, **common)
    if record_routes:
        raise ConfigError(
            f"routed experts are recorded by the paged engine (Qwen3-MoE), which cannot run model "
            f"family {getattr(hf_model.config, 'model_type', '?')!r} ({reason}); turn off "
            "rollout.return_routed_experts / actor.moe.router_replay=R3, or use rollout.engine=vllm or "
            "sglang with a server that returns routed experts")
    log.info("model family %r: TorchEngine instead of the paged engine: %s",
             getattr(hf_model.config, "model_type", "?"), reason)
    return TorchEngine(hf_model, **common)


@dataclass(frozen=True)
class EngineBundle:
    """An inference engine and what its callers need besides: ``load_weights(event)``
    (fetch over the event's transport, verify, load) and the model's context length
    (None if unknown)."""

    engine: Any
    load_weights: Callable[[Any], None]
    max_context_tokens: int | None


def build_engine(model, rollout, *, policy: PolicySpec, seed: int, tokenizer, log_dir: str,
                 member: int = 0, name: str = "rollout", record_routes: bool = False,
                 kv_need_tokens: int = 0) -> EngineBundle:
    """The engine of ``rollout.engine`` for ``model`` (ModelConfig) and its weights loader:
    the in-process engine (:func:`in_process_engine`) with the transport loader of
    weights/receiver.py, or a vLLM / SGLang server adapter (launching the server when
    ``rollout.server.urls`` is empty) that reloads verified files (the same module). Shared
    by the rollout workers, the proxy and the evaluator. ``record_routes``: results carry
    their routed experts. ``policy`` (the section's): with an adapter, the engine serves
    the run's LoRA adapters on its base (a launched server gets its LoRA flags); a server
    adapter reads its limits, vision tokens and MoE layers from it."""
    lora = policy.adapter

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    eos = tokenizer.eos_token_id
    if rollout.engine == "torch":
        from ..models.factory import load_model_and_tokenizer
        from ..weights import make_weight_loader

        set_torch_threads(rollout.torch_threads)
        hf_model, _ = load_model_and_tokenizer(model.path, dtype=model.dtype, device=rollout.device)
        context = getattr(hf_model.config, "max_position_embeddings", None)
        engine = in_process_engine(hf_model, tokenizer, rollout, seed=seed, decode=decode,
                                   record_routes=record_routes, kv_need_tokens=kv_need_tokens)
        del hf_model  # the engine holds what it needs (the paged engine keeps no model object)
        # Fetch over the event's transport (file / ipc / nccl), verify, copy at a step boundary.
        return EngineBundle(engine, make_weight_loader(engine, rollout.device, member=f"{name}-{member}",
                                                       lora=lora, model_path=model.path), context)

    from ..engines.server_launch import launch_server
    from ..engines.sglang_engine import SGLangEngine
    from ..engines.vllm_engine import VLLMEngine
    from ..weights import make_server_weight_loader

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
            log_path=Path(log_dir) / f"{rollout.engine}-server-{member}.log", lora=lora,
            return_routed_experts=record_routes))
        urls = [launched[0].url]
    cls = VLLMEngine if rollout.engine == "vllm" else SGLangEngine
    try:
        engine = cls(urls, config=srv, model_path=model.path, max_inflight_per_server=per_server,
                     eos_token_ids=[eos] if isinstance(eos, int) else list(eos or ()),
                     seed=seed, launched=launched, return_routed_experts=record_routes,
                     policy=policy)
    except BaseException:
        for server in launched:
            server.stop()
        raise
    return EngineBundle(engine, make_server_weight_loader(engine, rollout.engine, lora=lora,
                                                          model_path=model.path),
                        engine.max_context_tokens)


# ---------------------------------------------------------------- the trainer's models


def build_token_models(section: TrainerSection, actor) -> dict[str, Any]:
    """The models the trainer's token-level advantages need besides the policy, as
    keyword arguments of :class:`~tapioca.trainers.trainer.Trainer`: the critic
    (``estimator: gae``) from the policy's backbone (or ``critic.path``), the reference
    (``actor.kl_ctl > 0``) as a frozen copy of the policy's current weights (or
    ``ref.path``), the teacher (``distill.kd_weight > 0``) from ``distill.teacher_path``.
    Called before a checkpoint is loaded into the policy (the trainer loads it in
    ``init_state``), so the copied reference is the initial policy."""
    from ..trainers.critic import Critic, build_value_model
    from ..trainers.reference import FrozenLogprobModel

    a, adv = section.actor, section.advantage
    device = actor.device
    # Defence for direct callers: refused at start by config/features.py's row
    # vlm_x_critic_reference_teacher.
    if section.policy.vision is not None and (adv.estimator == "gae" or a.kl_ctl > 0
                                              or section.distill.kd_weight > 0):
        raise ConfigError("a vision-language policy trains without a critic, reference or teacher "
                          "model for now (they would score its tokens without the images): use an "
                          "outcome estimator (grpo, ...) with actor.kl_ctl=0 and no distillation")
    frozen = dict(temperature=section.temperature, chunk_tokens=a.logprob_chunk_tokens,
                  autocast_dtype=a.autocast_dtype, device=device,
                  tree_training=a.enable_tree_training, attention_backend=a.attention_backend)
    vocab = actor.model.get_output_embeddings().weight.shape[0]
    models: dict[str, Any] = {}
    if adv.estimator == "gae":
        model = build_value_model(actor.model, path=section.critic.path,
                                  init_from_policy=section.critic.init_critic_from_actor,
                                  dtype=a.weights_dtype)
        models["critic"] = Critic(model, section.critic, pad_token_id=actor.pad_token_id,
                                  device=device, autocast_dtype=a.autocast_dtype)
    if a.kl_ctl > 0 and not section.ref.path and section.lora is not None:
        # A LoRA run's reference is its base: the policy's model with the adapter off.
        from ..trainers.reference import AdapterOffReference

        models["reference"] = AdapterOffReference(actor.model, name="reference", **frozen)
        log.info("KL reference: the base model with the adapter off (%.2f GB not copied)",
                 models["reference"].saved_bytes / 1e9)
    elif a.kl_ctl > 0:
        models["reference"] = (
            FrozenLogprobModel.from_path(section.ref.path, vocab_size=vocab, dtype=a.weights_dtype,
                                         name="reference", **frozen)
            if section.ref.path else
            FrozenLogprobModel.copy_of(actor.model, name="reference", **frozen))
    if section.distill.kd_weight > 0:  # DistillConfig requires teacher_path with kd_weight
        models["teacher"] = FrozenLogprobModel.from_path(
            section.distill.teacher_path, vocab_size=vocab, dtype=a.weights_dtype, name="teacher",
            **frozen)
    return models


def build_actor(cfg: TrainConfig, sec: TrainerSection):
    """The policy's actor: :class:`PPOActor` in this process, or the FSDP2 actor over
    ``fsdp.world_size`` ranks (ranks > 0 serve rank 0 and exit inside)."""
    import torch

    set_torch_threads(sec.actor.torch_threads)
    torch.manual_seed(sec.seed)
    if sec.fsdp.world_size > 1:
        if sec.policy.vision is not None:  # defence: config/features.py's row vlm_x_fsdp
            raise ConfigError("the FSDP2 trainer does not train vision-language models yet (its "
                              "micro-batches carry no images): set fsdp.world_size=1 (docs/vlm.md)")
        from ..trainers.fsdp_actor import build_sharded_actor

        return build_sharded_actor(cfg, sec)
    from ..models.factory import load_model_and_tokenizer
    from ..trainers.ppo_actor import PPOActor

    model, tokenizer = load_model_and_tokenizer(sec.model.path, dtype=sec.actor.weights_dtype,
                                                device=sec.actor.device)
    return PPOActor(model, sec.actor, temperature=sec.temperature,
                    pad_token_id=tokenizer.pad_token_id or 0, device=sec.actor.device,
                    total_train_steps=sec.total_train_steps, policy=sec.policy, lora_seed=sec.seed,
                    images=trainer_images(sec), freeze_vision_encoder=sec.vlm.freeze_vision_encoder)


def trainer_images(sec: TrainerSection):
    """The trainer's image loader (refs -> the processor's tensors), None for a policy
    without a vision tower."""
    if sec.policy.vision is None:
        return None
    return image_loader(sec.policy.path, sec.vlm)


# ---------------------------------------------------------------- the roles


def build_feeder(cfg: TrainConfig) -> Role:
    from ..models.tokenizer import prompt_encoder
    from ..producers.feeder import PromptFeeder, tokenize_records
    from ..tasks.datasets import dataset_rows

    sec = feeder_section(cfg, run_policy(cfg))
    task, rows = dataset_rows(sec.train_dataset, sec.seed)
    tokenizer = _tokenizer(sec.model_path)
    vision = vision_prompts(sec.policy, tokenizer, sec.vlm)
    records = tokenize_records(rows, vision.encode if vision else prompt_encoder(tokenizer), task)
    return PromptFeeder(sec, records=records)


def build_rollout(cfg: TrainConfig, member: int = 0) -> Role:
    from ..producers.rollout import RolloutWorker

    sec = rollout_section(cfg, run_policy(cfg))
    tokenizer = _tokenizer(sec.model.path)
    bundle = build_engine(sec.model, sec.rollout, policy=sec.policy, seed=sec.seed * 1000 + member,
                          tokenizer=tokenizer, log_dir=os.path.join(cfg.run_path, "logs"),
                          member=member, record_routes=sec.record_routes,
                          kv_need_tokens=kv_tokens_needed(sec.rollout.max_batch_size,
                                                          sec.gconfig.max_new_tokens, sec.gconfig.n_samples))
    return RolloutWorker(sec, engine=bundle.engine, load_weights=bundle.load_weights,
                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         member_id=f"rollout-{member}",
                         images=request_images(sec.policy, sec.vlm, pixels=sec.rollout.engine == "torch"))


def trajectory_reward_fn(scorer: str) -> Callable[[Any], float]:
    """The built-in scorer's ``reward_fn(trajectory)``: ``reward.scorer`` names one task
    for every trajectory, or ``auto`` lets each trajectory's own ``task`` decide
    (:func:`tapioca.tasks.base.task_reward`), against its ``task_data`` answer."""
    from ..tasks.base import task_reward

    fixed = None if scorer == "auto" else task_reward(scorer)
    per_task: dict[str, Callable[[str, Any], float]] = {}

    def reward_fn(event) -> float:
        answer = str(event.task_data.get("answer", ""))
        fn = fixed
        if fn is None:
            fn = per_task.get(event.task) or per_task.setdefault(event.task, task_reward(event.task))
        return fn(event.output_text, answer)

    return reward_fn


def build_reward(cfg: TrainConfig) -> Role:
    from ..consumers.reward_scorer import RewardScorer

    sec = reward_section(cfg)
    if sec.reward.scorer == "none":
        raise ConfigError("reward.scorer is none: this run has no built-in scorer process "
                          "(rewards come from an external service, docs/reward-services.md); "
                          "set reward.scorer to auto or a task name to run one")
    return RewardScorer(sec, reward_fn=trajectory_reward_fn(sec.reward.scorer))


def build_advantage(cfg: TrainConfig) -> Role:
    from ..consumers.advantage import AdvantageProcessor

    return AdvantageProcessor(advantage_section(cfg))


def build_trainer(cfg: TrainConfig) -> Role:
    from ..trainers.trainer import Trainer

    sec = trainer_section(cfg, run_policy(cfg))
    actor = build_actor(cfg, sec)
    return Trainer(sec, actor=actor, **build_token_models(sec, actor))


def build_archiver(cfg: TrainConfig) -> Role:
    from ..consumers.archiver import Archiver

    return Archiver(archive_section(cfg))


def build_eval_parts(sec: EvalSection, *, log_dir: str, member: int = 0):
    """What an evaluation runs on, for `tapioca eval` and the evaluator role: the held-out
    prompts with their task's reward (producers/eval_run.py), the tokenizer's decode, and
    an engine of ``rollout.engine`` with its weights loader (:func:`build_engine`, as a
    rollout worker builds it). Returns ``(task, bundle, decode)``."""
    from ..models.tokenizer import prompt_encoder
    from ..producers.eval_run import load_eval_task

    tokenizer = _tokenizer(sec.model.path)
    task = load_eval_task(sec.valid_dataset, prompt_encoder(tokenizer),
                          max_prompts=sec.eval.max_prompts)
    # The evaluated model's own policy; it serves full weights (no adapter).
    bundle = build_engine(sec.model, sec.rollout, policy=policy_of_dir(sec.model.path),
                          seed=sec.seed * 1000 + 900 + member,
                          tokenizer=tokenizer, log_dir=log_dir, member=member, name="evaluator",
                          kv_need_tokens=kv_tokens_needed(sec.rollout.max_batch_size,
                                                          sec.sampling.max_new_tokens, sec.sampling.n_samples))
    return task, bundle, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def build_evaluator(cfg: TrainConfig, member: int = 0, *, renice: bool = True) -> Role:
    """The evaluator role (producers/evaluator.py): its own engine on ``valid_dataset``,
    at ``evaluator.nice`` (``renice``: this process's priority is lowered, once)."""
    from ..producers.evaluator import EVAL_DIR, Evaluator
    from ..tasks.datasets import dataset_rows
    from ..trainers.metrics_sink import MetricsSink

    sec = eval_section(cfg)
    if sec.rollout.engine != "torch" and sec.rollout.server.urls:
        raise ConfigError(
            f"rollout.server.urls names the rollout workers' {sec.rollout.engine} servers; the "
            "evaluator loads the versions it evaluates into its engine and would change the "
            "weights they generate with: leave rollout.server.urls empty (each role, the "
            "evaluator too, launches its own server) or use rollout.engine=torch")
    if renice and sec.evaluator.nice:
        os.nice(sec.evaluator.nice)
    task, bundle, decode = build_eval_parts(sec, log_dir=os.path.join(cfg.run_path, "logs"),
                                            member=member)
    train_prompts = None
    if sec.evaluator.freq_epochs is not None:  # an epoch is train prompts / prompts_per_step
        train_prompts = sum(1 for _ in dataset_rows(cfg.train_dataset, None)[1])
    return Evaluator(sec, engine=bundle.engine, load_weights=bundle.load_weights, task=task,
                     decode=decode, sink=MetricsSink(Path(cfg.run_path) / EVAL_DIR),
                     member_id=f"evaluator-{member}", train_prompts=train_prompts)


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
    if name == "evaluator":
        return build_evaluator(cfg, member)
    raise ConfigError(f"unknown role {name!r}; roles are {', '.join(ROLES)}")


def build_proxy_service(cfg: TrainConfig, *, member: int = 0):
    """The agent proxy's :class:`~tapioca.producers.proxy.ProxyService` for ``cfg``: the
    engine of ``rollout.engine`` (in-process, or a vLLM / SGLang server) with its weights
    loader, the tokenizer, the run's bus. Its threads start with the HTTP server."""
    from ..producers.proxy import ProxyService

    sec = proxy_section(cfg, run_policy(cfg))
    tokenizer = _tokenizer(sec.model.path)
    budget = decoding_budget(sec.vlm, sec.proxy.retry_after_s)
    bundle = build_engine(sec.model, sec.rollout, policy=sec.policy, seed=sec.seed * 1000 + 500 + member,
                          tokenizer=tokenizer, log_dir=os.path.join(cfg.run_path, "logs"),
                          member=member, name="proxy")
    return ProxyService(sec, engine=bundle.engine, tokenizer=tokenizer, bus=cfg.bus,
                        load_weights=bundle.load_weights,
                        max_context_tokens=bundle.max_context_tokens,
                        # One budget for both: the checks' decodes and the processor's.
                        vision=vision_prompts(sec.policy, tokenizer, sec.vlm, budget=budget),
                        images=request_images(sec.policy, sec.vlm, pixels=sec.rollout.engine == "torch",
                                              budget=budget))
