"""The ``weights``, ``actor.optimizer``, ``actor.lora`` and ``actor.moe`` sections, and the
renamed keys they replace.

The old dotted names (``actor.lr``, ``actor.weight_transport``, AReaL's flat
``actor.use_lora`` / ``actor.lora_rank`` / ..., ``actor.moe_aux_loss_coeff``,
``actor.router_replay``, ...) are read for one release, in a file and on the command
line, each with a one-line warning that names the new key (config/loader.py). The
optimizer section carries AReaL's names and its lr schedule (trainers/optim.py
``lr_factor``), which the RL actor and the supervised loop follow.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tapioca.config.loader import RENAMED_KEYS, load_config
from tapioca.config.lora import LoraConfig
from tapioca.config.moe import MoeConfig
from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import ActorConfig, TrainConfig
from tapioca.config.sections import trainer_section
from tapioca.config.supervised import SFTConfig
from tapioca.config.weights import WeightsConfig
from tapioca.schemas.errors import ConfigError

OLD_TO_NEW = [
    ("actor.lr=1e-3", "actor.optimizer.lr", 1e-3),
    ("actor.weight_decay=0.1", "actor.optimizer.weight_decay", 0.1),
    ("actor.max_grad_norm=0.5", "actor.optimizer.gradient_clipping", 0.5),
    ("actor.weight_transport=ipc", "weights.transport", "ipc"),
    ("actor.weight_bucket_bytes=8192", "weights.bucket_bytes", 8192),
    ("actor.weight_buffer_slots=3", "weights.buffer_slots", 3),
    ("actor.weight_file_every_versions=0", "weights.file_every_versions", 0),
    ("actor.weight_nccl_host=10.0.0.5", "weights.nccl_host", "10.0.0.5"),
    ("actor.weight_nccl_port=29555", "weights.nccl_port", 29555),
    ("actor.weight_nccl_backend=gloo", "weights.nccl_backend", "gloo"),
    ("actor.weight_transfer_timeout_s=5", "weights.transfer_timeout_s", 5.0),
    # actor.lora (AReaL's flat names)
    ("actor.use_lora=true", "actor.lora.enabled", True),
    ("actor.peft_type=lora", "actor.lora.peft_type", "lora"),
    ("actor.lora_rank=8", "actor.lora.rank", 8),
    ("actor.lora_alpha=4", "actor.lora.alpha", 4),
    ("actor.target_modules=[q_proj,v_proj]", "actor.lora.target_modules", ["q_proj", "v_proj"]),
    # actor.moe (on an MoE model: the feature table refuses the router switches on a dense one)
    ("actor.moe_router_dtype=fp64", "actor.moe.router_dtype", "fp64"),
    ("actor.moe_aux_loss_coeff=0.01", "actor.moe.aux_loss_coeff", 0.01),
    ("actor.moe_z_loss_coeff=0.001", "actor.moe.z_loss_coeff", 0.001),
    ("actor.freeze_moe_router=true", "actor.moe.freeze_router", True),
    ("actor.router_replay=R3", "actor.moe.router_replay", "R3"),
    ("actor.router_replay_missing=reject", "actor.moe.router_replay_missing", "reject"),
]
MOE = ["model.arch=qwen3_moe"]


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _deprecations(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_the_table_covers_every_old_actor_field():
    old_fields = {"lr", "weight_decay", "adam_betas", "max_grad_norm", "weight_transport",
                  "weight_bucket_bytes", "weight_buffer_slots", "weight_file_every_versions",
                  "weight_nccl_host", "weight_nccl_port", "weight_nccl_backend",
                  "weight_transfer_timeout_s",
                  "use_lora", "peft_type", "lora_rank", "lora_alpha", "target_modules",
                  "moe_router_dtype", "moe_aux_loss_coeff", "moe_z_loss_coeff", "freeze_moe_router",
                  "router_replay", "router_replay_missing"}
    assert {k.split(".", 1)[1] for k in RENAMED_KEYS} == old_fields
    assert not old_fields & {f for f in ActorConfig.__dataclass_fields__}


@pytest.mark.parametrize("override, new_key, value", OLD_TO_NEW)
def test_an_old_name_on_the_command_line_sets_the_new_key_with_one_warning(caplog, override, new_key,
                                                                           value):
    context = MOE if new_key.startswith("actor.moe.") else []
    with caplog.at_level(logging.WARNING, logger="tapioca.config.loader"):
        cfg = load_config(TrainConfig, None, [*context, override])
    assert _get(cfg, new_key) == value
    new_override = f"{new_key}={override.split('=', 1)[1]}"
    assert cfg == load_config(TrainConfig, None, [*context, new_override])
    (warning,) = _deprecations(caplog)
    old = override.split("=")[0]
    assert "\n" not in warning and old in warning and f"use {new_key}" in warning


def test_old_names_in_a_yaml_file_are_read_too(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("actor:\n  lr: 2.0e-3\n  adam_betas: [0.8, 0.95]\n  max_grad_norm: 0.7\n"
                    "  eps_clip: 0.3\n  weight_transport: nccl\n  weight_nccl_port: 29600\n")
    with caplog.at_level(logging.WARNING, logger="tapioca.config.loader"):
        cfg = load_config(TrainConfig, path, ["actor.lr=3e-3"])
    opt = cfg.actor.optimizer
    # The command line still overrides the file (both in the old names here).
    assert (opt.lr, opt.beta1, opt.beta2, opt.gradient_clipping) == (3e-3, 0.8, 0.95, 0.7)
    assert cfg.actor.eps_clip == 0.3 and (cfg.weights.transport, cfg.weights.nccl_port) == ("nccl", 29600)
    # One line for the file, naming each old key; the command line's actor.lr is not named again.
    (warning,) = _deprecations(caplog)
    assert f"in {path}" in warning and warning.count(": use ") == 5 and warning.count("actor.lr:") == 1
    assert "actor.adam_betas: use actor.optimizer.beta1 and actor.optimizer.beta2" in warning


def test_new_names_warn_nothing_and_the_new_key_of_another_layer_is_overridden(tmp_path, caplog):
    path = tmp_path / "new.yaml"
    path.write_text("actor:\n  optimizer:\n    lr: 2.0e-3\nweights:\n  transport: ipc\n")
    with caplog.at_level(logging.WARNING, logger="tapioca.config.loader"):
        cfg = load_config(TrainConfig, path)
        assert not _deprecations(caplog)
        assert (cfg.actor.optimizer.lr, cfg.weights.transport) == (2e-3, "ipc")
        # An old name on the command line wins over the file's new one, as any override does.
        assert load_config(TrainConfig, path, ["actor.lr=1e-4"]).actor.optimizer.lr == 1e-4


def test_both_names_in_one_layer_and_bad_values_are_refused():
    both = "on the command line sets both actor.lr .* and actor.optimizer.lr: remove actor.lr"
    with pytest.raises(ConfigError, match=both):
        load_config(TrainConfig, None, ["actor.lr=1e-3", "actor.optimizer.lr=2e-3"])
    with pytest.raises(ConfigError, match="actor.adam_betas .* must be a list of 2 values"):
        load_config(TrainConfig, None, ["actor.adam_betas=0.9"])
    with pytest.raises(ConfigError, match="weights.transport='tcp'"):
        load_config(TrainConfig, None, ["actor.weight_transport=tcp"])


def test_the_flat_lora_and_moe_names_of_a_yaml_file_fill_the_sections(tmp_path, caplog):
    lora = tmp_path / "lora.yaml"
    lora.write_text("actor:\n  use_lora: true\n  peft_type: lora\n  lora_rank: 8\n  lora_alpha: 16\n"
                    "  target_modules: [q_proj, v_proj]\n  eps_clip: 0.3\n")
    moe = tmp_path / "moe.yaml"
    moe.write_text("model:\n  arch: qwen3_moe\nactor:\n  moe_router_dtype: none\n  moe_aux_loss_coeff: 0.001\n"
                   "  moe_z_loss_coeff: 0.0001\n  freeze_moe_router: true\n  router_replay: R2\n"
                   "  router_replay_missing: reject\n")
    with caplog.at_level(logging.WARNING, logger="tapioca.config.loader"):
        a = load_config(TrainConfig, lora).actor
        # The command line's new key overrides the file's old one (two layers: no conflict).
        b = load_config(TrainConfig, moe, ["actor.moe.router_replay=R3"]).actor
    assert a.lora == LoraConfig(enabled=True, rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    assert a.eps_clip == 0.3 and a.moe == MoeConfig()
    assert b.moe == MoeConfig(router_dtype="none", aux_loss_coeff=0.001, z_loss_coeff=0.0001, freeze_router=True,
                              router_replay="R3", router_replay_missing="reject")
    assert b.lora == LoraConfig()
    warnings = _deprecations(caplog)
    # One line a file, naming its old keys (5 in lora.yaml, 6 in moe.yaml).
    assert [w.count(": use ") for w in warnings] == [5, 6] and all(f" in {tmp_path}" in w for w in warnings)
    assert any("actor.use_lora" in w and "use actor.lora.enabled" in w for w in warnings)
    assert any("actor.freeze_moe_router" in w and "use actor.moe.freeze_router" in w for w in warnings)


def test_an_old_lora_or_moe_name_beside_its_new_key_is_refused():
    with pytest.raises(ConfigError, match="sets both actor.use_lora .* and actor.lora.enabled: remove "
                                          "actor.use_lora"):
        load_config(TrainConfig, None, ["actor.use_lora=true", "actor.lora.enabled=true"])
    with pytest.raises(ConfigError, match="sets both actor.router_replay .* and actor.moe.router_replay"):
        load_config(TrainConfig, None, [*MOE, "actor.router_replay=R2", "actor.moe.router_replay=R2"])
    # An old name beside other keys of the new section is no conflict: it joins them.
    cfg = load_config(TrainConfig, None, ["actor.use_lora=true", "actor.lora.rank=8"])
    assert (cfg.actor.lora.enabled, cfg.actor.lora.rank) == (True, 8)


@pytest.mark.parametrize("section, kw, message", [
    (LoraConfig, {"peft_type": "dora"}, r"actor.lora.peft_type='dora': only lora"),
    (LoraConfig, {"rank": 0}, "actor.lora.rank must be >= 1"),
    (LoraConfig, {"alpha": 0}, "actor.lora.alpha must be > 0"),
    (LoraConfig, {"target_modules": []}, "actor.lora.target_modules must name modules"),
    (LoraConfig, {"target_modules": ["q_proj", ""]}, "actor.lora.target_modules must name modules"),
    (MoeConfig, {"router_dtype": "bf16"}, r"actor.moe.router_dtype='bf16': use fp32, fp64 or none"),
    (MoeConfig, {"aux_loss_coeff": -0.1}, "actor.moe.aux_loss_coeff and actor.moe.z_loss_coeff must be >= 0"),
    (MoeConfig, {"z_loss_coeff": -0.1}, "actor.moe.aux_loss_coeff and actor.moe.z_loss_coeff must be >= 0"),
    (MoeConfig, {"router_replay": "R1"}, r"actor.moe.router_replay='R1': use disabled, R2 .* or R3"),
    (MoeConfig, {"router_replay_missing": "drop"}, r"actor.moe.router_replay_missing='drop': use live"),
])
def test_the_lora_and_moe_sections_check_their_own_values(section, kw, message):
    with pytest.raises(ConfigError, match=message):
        section(**kw)


def test_the_lora_and_moe_sections_keep_the_flat_fields_defaults_and_the_actor_its_rules():
    # The defaults of the flat fields they replace (AReaL's LoRA defaults: rank 32, alpha 16).
    assert LoraConfig() == LoraConfig(enabled=False, peft_type="lora", rank=32, alpha=16,
                                      target_modules=["all-linear"])
    assert MoeConfig() == MoeConfig(router_dtype="fp32", aux_loss_coeff=0.0, z_loss_coeff=0.0, freeze_router=False,
                                    router_replay="disabled", router_replay_missing="live")
    assert (ActorConfig().lora, ActorConfig().moe) == (LoraConfig(), MoeConfig())
    # Rules between a section and the other actor fields stay the actor's.
    with pytest.raises(ConfigError, match="unset it with actor.lora.enabled"):
        ActorConfig(lora=LoraConfig(enabled=True), recompute_swiglu=True)
    ActorConfig(lora=LoraConfig(enabled=False), recompute_swiglu=True)
    with pytest.raises(ConfigError, match="actor.moe.router_replay=R3 runs in the packed forward"):
        ActorConfig(moe=MoeConfig(router_replay="R3"), packed_sequences=False)
    with pytest.raises(ConfigError, match=r"router losses \(actor.moe.aux_loss_coeff / z_loss_coeff\)"):
        ActorConfig(moe=MoeConfig(z_loss_coeff=0.01), enable_tree_training=True)


def test_the_supervised_trainers_read_the_old_optimizer_names_but_have_no_weights_section(caplog):
    with caplog.at_level(logging.WARNING, logger="tapioca.config.loader"):
        cfg = load_config(SFTConfig, None, ["actor.lr=2e-3", "actor.max_grad_norm=0.5"])
    assert (cfg.actor.optimizer.lr, cfg.actor.optimizer.gradient_clipping) == (2e-3, 0.5)
    (warning,) = _deprecations(caplog)
    assert "actor.lr: use actor.optimizer.lr; actor.max_grad_norm: use actor.optimizer.gradient_clipping" in warning
    # An old key whose new home the config lacks stays what it was: unknown.
    with pytest.raises(ConfigError, match="weight_transport"):
        load_config(SFTConfig, None, ["actor.weight_transport=ipc"])


def test_the_trainer_gets_the_weights_section_and_the_defaults_are_todays():
    cfg = load_config(TrainConfig, None, ["weights.transport=ipc", "weights.bucket_bytes=8192"])
    assert trainer_section(cfg).weights == WeightsConfig(transport="ipc", bucket_bytes=8192)
    opt = OptimizerConfig()
    # Tapioca's defaults before the section existed (actor.lr 5e-4, weight_decay 0, AdamW's
    # betas and eps, max_grad_norm 1.0, no schedule).
    assert (opt.type, opt.lr, opt.weight_decay, opt.betas, opt.eps, opt.gradient_clipping) == \
        ("adam", 5e-4, 0.0, (0.9, 0.999), 1e-8, 1.0)
    assert (opt.lr_scheduler_type, opt.warmup_steps_proportion, opt.min_lr_ratio) == ("constant", 0.0, 0.0)


@pytest.mark.parametrize("kw, message", [
    ({"type": "sgd"}, "only adam"), ({"lr": 0.0}, "lr must be > 0"),
    ({"beta2": 1.0}, "beta1 and beta2"), ({"eps": 0.0}, "eps"),
    ({"gradient_clipping": 0.0}, "gradient_clipping"), ({"lr_scheduler_type": "step"}, "constant, linear"),
    ({"warmup_steps_proportion": 1.0}, "warmup_steps_proportion"), ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
])
def test_optimizer_values_are_checked(kw, message):
    with pytest.raises(ConfigError, match=message):
        OptimizerConfig(**kw)


def test_lr_schedules_by_hand():
    from tapioca.trainers.optim import lr_factor

    # cosine, 10 steps, warm-up int(0.2 * 10) = 2, floor 0.1: steps 0, 1 rise as 0/2, 1/2;
    # step 2 starts the decay (done 0, factor 1); step 6: done 4/8, cos(pi/2) = 0, so
    # 0.1 + 0.9 * 0.5 = 0.55; step 10: done 1, cos(pi) = -1, the floor 0.1.
    cos = OptimizerConfig(lr_scheduler_type="cosine", warmup_steps_proportion=0.2, min_lr_ratio=0.1)
    assert [lr_factor(s, 10, cos) for s in (0, 1, 2, 6, 10)] == pytest.approx([0, 0.5, 1, 0.55, 0.1])
    # linear, no warm-up, floor 0: 1 - s/10.
    lin = OptimizerConfig(lr_scheduler_type="linear")
    assert [lr_factor(s, 10, lin) for s in (0, 5, 9)] == pytest.approx([1, 0.5, 0.1])
    # constant with warm-up int(0.25 * 8) = 2 steps.
    const = OptimizerConfig(warmup_steps_proportion=0.25)
    assert [lr_factor(s, 8, const) for s in (0, 1, 2, 7)] == pytest.approx([0, 0.5, 1, 1])


def _tiny_actor(cfg: ActorConfig, **kw):
    from tapioca.models.factory import build_tiny_model
    from tapioca.trainers.ppo_actor import PPOActor

    model = build_tiny_model(20, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=32, max_position_embeddings=32, seed=0)
    return PPOActor(model, cfg, temperature=1.0, pad_token_id=0, **kw)


def test_the_rl_actor_steps_at_the_scheduled_lr():
    from tapioca.algorithms.errors import AlgorithmInputError
    from tapioca.trainers.batching import SeqItem

    items = [SeqItem(group_id="g", input_ids=[1, 2, 3, 4], prompt_len=2, behav_logprobs=[-2.0, -2.0],
                     versions=[6, 6], loss_mask=[1, 1], advantage=1.0, reward=1.0)]
    cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2, lr_scheduler_type="cosine",
                                                warmup_steps_proportion=0.2, min_lr_ratio=0.1))
    actor = _tiny_actor(cfg, total_train_steps=10)
    # The step after 6 versions of 10: 1e-2 * 0.55 (test_lr_schedules_by_hand).
    result = actor.train_step(items, policy_version=6)
    assert result.metrics["actor/lr"] == pytest.approx(5.5e-3)
    assert [g["lr"] for g in actor.optimizer.param_groups] == pytest.approx([5.5e-3])
    with pytest.raises(AlgorithmInputError, match="needs total_train_steps"):
        _tiny_actor(cfg).train_step(items, policy_version=6)
    # No schedule: the configured lr, whatever the version.
    plain = _tiny_actor(ActorConfig(optimizer=OptimizerConfig(lr=1e-2)))
    assert plain.train_step(items, policy_version=6).metrics["actor/lr"] == 1e-2
    assert torch.isfinite(torch.tensor(result.metrics["actor/loss"]))


def test_the_supervised_loop_steps_at_the_scheduled_lr(tmp_path, monkeypatch):
    from tapioca.runtime.run import create_tiny_checkpoint, resolve_run
    from tapioca.trainers.supervised.sft import train_sft

    monkeypatch.delenv("TAPIOCA_BOOTSTRAP", raising=False)  # publish nothing
    tiny = create_tiny_checkpoint(tmp_path / "model")
    cfg = resolve_run(load_config(SFTConfig, None, [
        f"model.path={tiny}", f"run_dir={tmp_path}", "trial_name=t", "total_train_steps=4",
        "train_dataset.batch_size=4", "actor.optimizer.lr=1e-3",
        "actor.optimizer.lr_scheduler_type=linear"]), prepare=True)
    summary = train_sft(cfg)
    # linear over 4 steps: 1 - s/4 for s = 0..3.
    assert [h["actor/lr"] for h in summary.history] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
