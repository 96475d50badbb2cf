"""Which model features combine: one table, checked once at load and once at start.

Consumes a :class:`~tapioca.config.schema.TrainConfig` and its policy
(:class:`~tapioca.config.policy.PolicySpec`: vision-language or not, mixture-of-experts
or not, its adapter, its module names), resolved once from ``model.path``'s
``config.json`` (or, for the tiny model a run creates, from ``model.arch``); emits nothing
but a :class:`ConfigError` naming the first row of :data:`FEATURE_TABLE` the config
trips, with what to do instead.

Every rule "feature A does not run with feature B" is a row here, and only here: its
name, the features involved, a predicate ``when(cfg, policy)`` (true: the combination is
present) and the one-line message. :meth:`TrainConfig.__post_init__` checks the table
with what the config alone tells (the tiny model's arch; a ``model.path`` is not read at
load), and ``runtime/run.py`` (``resolve_run(prepare=True)``, before any role starts)
checks it again with the policy of the model directory. An engine or trainer that
refuses the same combination for a direct caller keeps its guard as defence and names
the row. docs/configuration.md's table is generated from this one
(``python -m tapioca.config.features``; tests/unit/test_features.py compares them).

Adding a model feature: a field of :class:`~tapioca.config.policy.PolicySpec` where it is
a fact of the model, its fields in a config section (a spec such as
:class:`~tapioca.config.lora.LoraSpec` where roles share it), a row here for each feature
it does not run with yet, its code in its own module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..schemas.errors import ConfigError
from .policy import PolicySpec

# ------------------------------------------------------------------ the predicates


def _tp_or_cp(cfg: Any) -> bool:
    return cfg.fsdp.tensor_parallel_size > 1 or cfg.fsdp.context_parallel_size > 1


def _routes(cfg: Any) -> bool:
    return cfg.actor.moe.router_replay != "disabled" or cfg.rollout.return_routed_experts


def _token_models(cfg: Any) -> bool:
    return cfg.advantage.estimator == "gae" or cfg.actor.kl_ctl > 0 or cfg.distill.kd_weight > 0


def _vision(cfg: Any, policy: PolicySpec) -> bool:
    return policy.vision is not None or cfg.train_dataset.type == "visual"


def _unknown_targets(cfg: Any, policy: PolicySpec) -> bool:
    lora = policy.adapter
    if lora is None or list(lora.target_modules) == ["all-linear"] or not policy.known:
        return False
    names = policy.modules
    return names is not None and bool(names.unmatched(list(lora.target_modules)))


def _unknown_targets_message(cfg: Any, policy: PolicySpec) -> str:
    names = policy.modules
    assert names is not None and policy.adapter is not None
    return (f"actor.lora.target_modules names {names.unmatched(list(policy.adapter.target_modules))}, which match "
            f"no module of the model (its linear layers: {', '.join(sorted(names.linear))}): name those, "
            "or use actor.lora.target_modules=[all-linear]")


@dataclass(frozen=True)
class FeatureRule:
    name: str
    # The features involved, as the config spells them (or "model: ..." for a fact).
    features: tuple[str, ...]
    when: Callable[[Any, PolicySpec], bool]
    # The message: a str.format template over ``cfg`` and ``policy``, or a function of them.
    message: str | Callable[[Any, PolicySpec], str]
    # What to do instead, as the docs' table shows it (Markdown; the message says it too).
    instead: str

    def text(self, cfg: Any, policy: PolicySpec) -> str:
        msg = self.message(cfg, policy) if callable(self.message) else self.message.format(cfg=cfg, policy=policy)
        return f"{msg} (feature table: {self.name})"


_VLM = "model: vision-language"

# One row per rule; the first row a config trips is the one reported.
FEATURE_TABLE: tuple[FeatureRule, ...] = (
    FeatureRule(
        "vlm_x_tensor_context_parallel", (_VLM, "fsdp.tensor_parallel_size / context_parallel_size > 1"),
        lambda c, p: p.vision is not None and _tp_or_cp(c),
        "a vision-language policy does not run with tensor / context parallelism (the parallel forward "
        "has no vision tower and shards 1-D positions): set fsdp.tensor_parallel_size=1 and "
        "fsdp.context_parallel_size=1 (docs/vlm.md)",
        "`fsdp.tensor_parallel_size=1`, `fsdp.context_parallel_size=1`"),
    FeatureRule(
        "vlm_x_fsdp", (_VLM, "fsdp.world_size > 1"),
        lambda c, p: p.vision is not None and c.fsdp.world_size > 1,
        "a vision-language policy does not run with the FSDP2 trainer (its micro-batches carry no "
        "images): set fsdp.world_size=1 (docs/vlm.md)",
        "`fsdp.world_size=1`"),
    FeatureRule(
        "vlm_x_tree_training", (_VLM, "actor.enable_tree_training"),
        lambda c, p: p.vision is not None and c.actor.enable_tree_training,
        "a vision-language policy does not run with tree training (prefix trees merge sequences by "
        "token, and a placeholder token is the same whatever its image): set "
        "actor.enable_tree_training=false (docs/vlm.md)",
        "`actor.enable_tree_training=false`"),
    FeatureRule(
        "vlm_x_router_replay", (_VLM, "actor.moe.router_replay / rollout.return_routed_experts"),
        lambda c, p: p.vision is not None and _routes(c),
        "a vision-language policy does not run with routing replay (the vision-language models are "
        "dense; no MoE layer records routes): set actor.moe.router_replay=disabled and "
        "rollout.return_routed_experts=false (docs/vlm.md)",
        "`actor.moe.router_replay=disabled`, `rollout.return_routed_experts=false`"),
    FeatureRule(
        "vlm_x_critic_reference_teacher",
        (_VLM, "advantage.estimator=gae / actor.kl_ctl > 0 / distill.kd_weight > 0"),
        lambda c, p: p.vision is not None and _token_models(c),
        "a vision-language policy trains without a critic, reference or teacher model for now (they "
        "would score its tokens without the images): use an outcome estimator (grpo, ...) with "
        "actor.kl_ctl=0 and no distillation (docs/vlm.md)",
        "an outcome estimator (`grpo`, ...), `actor.kl_ctl=0`, `distill.kd_weight=0`"),
    FeatureRule(
        "vlm_x_lora", (_VLM, "actor.lora.enabled"),
        lambda c, p: p.adapter is not None and _vision(c, p),
        "actor.lora.enabled on a vision-language model is not supported yet (no engine loads an adapter "
        "beside a vision tower): train it with actor.lora.enabled=false (docs/lora.md)",
        "`actor.lora.enabled=false`"),
    FeatureRule(
        "lora_x_moe", ("model: mixture-of-experts", "actor.lora.enabled"),
        lambda c, p: p.adapter is not None and p.moe is not None,
        "actor.lora.enabled on a mixture-of-experts model ({policy.model_type}) is not supported yet: peft "
        "wraps the fused expert tensors and the router as adapters that the packed forward does not "
        "route and no engine loads (the rollout would refuse every version); train it with "
        "actor.lora.enabled=false (docs/lora.md)",
        "`actor.lora.enabled=false`"),
    FeatureRule(
        "lora_x_unknown_target_modules", ("actor.lora.enabled", "actor.lora.target_modules"),
        _unknown_targets, _unknown_targets_message,
        "module names of the model (`q_proj`, ...) or `actor.lora.target_modules=[all-linear]`"),
    FeatureRule(
        "lora_x_critic", ("actor.lora.enabled", "advantage.estimator=gae"),
        lambda c, p: p.adapter is not None and c.advantage.estimator == "gae",
        "advantage.estimator=gae trains a critic initialised from the policy's backbone, which a LoRA "
        "run does not copy yet: use an estimator without a critic (grpo, rloo, ...) or "
        "actor.lora.enabled=false",
        "an estimator without a critic (`grpo`, `rloo`, ...)"),
    FeatureRule(
        "lora_x_tensor_context_parallel",
        ("actor.lora.enabled", "fsdp.tensor_parallel_size / context_parallel_size > 1"),
        lambda c, p: p.adapter is not None and _tp_or_cp(c),
        lambda c, p: (f"actor.lora.enabled with {c.fsdp.describe()}: the tensor / context parallel plan splits "
                      "plain linear layers, not peft's adapter wrappers; train the adapter data parallel "
                      "(fsdp.tensor_parallel_size=1, fsdp.context_parallel_size=1)"),
        "`fsdp.tensor_parallel_size=1`, `fsdp.context_parallel_size=1`"),
    FeatureRule(
        "lora_x_tree_training", ("actor.lora.enabled", "actor.enable_tree_training"),
        lambda c, p: p.adapter is not None and c.actor.enable_tree_training,
        "actor.lora.enabled with actor.enable_tree_training: prefix-tree packing is not tested with peft's "
        "adapter layers yet; set actor.enable_tree_training=false",
        "`actor.enable_tree_training=false`"),
    FeatureRule(
        "router_replay_x_dense_model", ("model: dense (no MoE layer)", "actor.moe.router_replay"),
        lambda c, p: p.known and p.moe is None and c.actor.moe.router_replay != "disabled",
        "actor.moe.router_replay={cfg.actor.moe.router_replay} replays the routes of MoE layers, but the model "
        "({policy.model_type}) has none: set actor.moe.router_replay=disabled (docs/models.md)",
        "`actor.moe.router_replay=disabled`"),
    FeatureRule(
        "router_replay_x_tree_training", ("actor.moe.router_replay", "actor.enable_tree_training"),
        # A prefix tree computes a shared prefix once; its recorded routes are per
        # sequence, and mapping them onto tree rows is not built.
        lambda c, p: c.actor.moe.router_replay != "disabled" and c.actor.enable_tree_training,
        "actor.moe.router_replay={cfg.actor.moe.router_replay} replays per-sequence routes, which "
        "actor.enable_tree_training does not map onto its shared prefixes: set one off",
        "`actor.moe.router_replay=disabled` or `actor.enable_tree_training=false`"),
    FeatureRule(
        "moe_router_losses_x_dense_model",
        ("model: dense (no MoE layer)", "actor.moe.aux_loss_coeff / z_loss_coeff"),
        lambda c, p: p.known and p.moe is None and bool(c.actor.moe.aux_loss_coeff or c.actor.moe.z_loss_coeff),
        "actor.moe.aux_loss_coeff / z_loss_coeff are set but the model ({policy.model_type}) has no "
        "MoE layer: set them to 0",
        "`actor.moe.aux_loss_coeff=0`, `actor.moe.z_loss_coeff=0`"),
    FeatureRule(
        "freeze_router_x_dense_model", ("model: dense (no MoE layer)", "actor.moe.freeze_router"),
        lambda c, p: p.known and p.moe is None and c.actor.moe.freeze_router,
        "actor.moe.freeze_router is set but the model ({policy.model_type}) has no MoE router: unset it",
        "`actor.moe.freeze_router=false`"),
    FeatureRule(
        "sglang_x_images", ("rollout.engine=sglang", "train_dataset.type=visual"),
        lambda c, p: c.rollout.engine == "sglang" and c.train_dataset.type == "visual",
        "rollout.engine=sglang sends token ids only (images are not wired into its adapter yet), but "
        "train_dataset.type=visual puts an image in every prompt: use rollout.engine=torch or vllm "
        "(docs/vlm.md)",
        "`rollout.engine=torch` or `vllm`"),
    FeatureRule(
        "servers_x_fast_transport", ("rollout.engine=vllm / sglang", "weights.transport=ipc / nccl"),
        lambda c, p: c.rollout.engine != "torch" and c.weights.transport != "file",
        "rollout.engine={cfg.rollout.engine} reloads weights from safetensors files (device-to-device "
        "updates to servers are not wired yet), but weights.transport={cfg.weights.transport}: set "
        "weights.transport=file",
        "`weights.transport=file`"),
    FeatureRule(
        "torch_engine_x_server_tensor_parallel", ("rollout.engine=torch", "rollout.server.tensor_parallel_size > 1"),
        lambda c, p: c.rollout.engine == "torch" and c.rollout.server.tensor_parallel_size > 1,
        "rollout.server.tensor_parallel_size={cfg.rollout.server.tensor_parallel_size} needs an inference "
        "server: the in-process torch engine is one GPU per rollout worker; set rollout.engine=vllm or "
        "sglang (docs/distributed.md, inference beyond one GPU)",
        "`rollout.engine=vllm` or `sglang`"),
    FeatureRule(
        "vllm_x_nucleus_sampling", ("rollout.engine=vllm", "gconfig.top_p < 1 / top_k > 0"),
        lambda c, p: c.rollout.engine == "vllm" and not (c.gconfig.top_p == 1 and c.gconfig.top_k == 0),
        "rollout.engine=vllm with gconfig.top_p={cfg.gconfig.top_p}, top_k={cfg.gconfig.top_k}: vLLM's "
        "logprobs are renormalised over the top-p/top-k nucleus and Tapioca's behaviour logprobs are "
        "not (engines/base.py); set gconfig.top_p=1 and gconfig.top_k=0, or use rollout.engine=torch "
        "or sglang",
        "`gconfig.top_p=1`, `gconfig.top_k=0`, or `rollout.engine=torch` / `sglang`"),
)

RULES_BY_NAME = {rule.name: rule for rule in FEATURE_TABLE}


def refused_feature(cfg: Any, policy: PolicySpec) -> FeatureRule | None:
    """The first row of the table that ``cfg`` (a TrainConfig) with ``policy`` trips, None
    when none."""
    return next((rule for rule in FEATURE_TABLE if rule.when(cfg, policy)), None)


def check_features(cfg: Any, policy: PolicySpec) -> None:
    """Raise :class:`ConfigError` with the message of the first row ``cfg`` trips."""
    rule = refused_feature(cfg, policy)
    if rule is not None:
        raise ConfigError(rule.text(cfg, policy))


def markdown_table() -> str:
    """The table as docs/configuration.md shows it (between its feature-table markers)."""
    lines = ["| Row | Does not run with | Instead |", "|---|---|---|"]
    for rule in FEATURE_TABLE:
        features = " × ".join(f"`{f}`" if not f.startswith("model:") else f for f in rule.features)
        lines.append(f"| `{rule.name}` | {features} | {rule.instead} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
