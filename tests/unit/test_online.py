"""Online mode without a broker (issue 22): its config (``agent.mode: online``, the
admission switch, the singleton-advantage warnings), the roles `tapioca train` starts,
the trainer's tail gate for late rewards, and how late a group's rewards came
(``SampleEvent.reward_delay_s``). The proxy's side is in tests/unit/test_proxy_online.py,
the whole loop in tests/e2e/test_online_rl.py."""

from __future__ import annotations

import logging

import pytest

from tapioca.bus.role import DeadLetter, Source
from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import (
    ActorConfig,
    AdvantageConfig,
    AgentConfig,
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    NormConfig,
    ProxyConfig,
    RewardNormConfig,
    TrainConfig,
    admission_of,
)
from tapioca.config.sections import AdvantageSection, TrainerSection, proxy_section
from tapioca.consumers.advantage import AdvantageProcessor
from tapioca.models.factory import build_tiny_model
from tapioca.ops.run_setup import role_counts
from tapioca.schemas.errors import BadEventError, ConfigError
from tapioca.schemas.events import (
    RewardEvent,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
)
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.trainer import Trainer

OFF = NormConfig(mean_level="none", std_level="none")  # AReaL's adv_norm: null


def trained(out) -> dict[int, list[str]]:
    """Version -> the groups the trainer's outputs say trained it: the event that names
    them (WeightsEvent here; ProgressEvent once the verdicts move to progress.v1)."""
    found: dict[int, list[str]] = {}
    for e in out:
        if type(e).__name__ in ("WeightsEvent", "ProgressEvent") and getattr(e, "group_ids", None):
            found.setdefault(e.version, list(e.group_ids))
    return found


def online(**kw) -> TrainConfig:
    fields = dict(agent=AgentConfig(mode="online"), gconfig=GenerationConfig(n_samples=1),
                  advantage=AdvantageConfig(adv_norm=OFF))
    fields.update(kw)
    return TrainConfig(**fields)


# ---------------------------------------------------------------------- config


def test_online_mode_runs_the_proxy_advantage_and_trainer_only():
    cfg = online(archive=TrainConfig().archive)
    assert cfg.agent.enabled  # online implies agent mode
    assert [r for r, _ in role_counts(cfg)] == ["trainer", "advantage", "proxy"]
    # agent.workers does not matter: nothing plays the dataset's prompts.
    assert role_counts(online(agent=AgentConfig(mode="online", workers=3))) == role_counts(cfg)
    with pytest.raises(ConfigError, match="agent.mode='x': use batch"):
        AgentConfig(mode="x")


def test_admission_switch():
    assert admission_of(ProxyConfig(), AgentConfig()) == "wait"
    assert admission_of(ProxyConfig(), AgentConfig(mode="online")) == "reject"
    untrained = ProxyConfig(admission="serve_untrained")
    assert admission_of(untrained, AgentConfig(mode="online")) == "serve_untrained"
    assert proxy_section(online(proxy=untrained)).admission == "serve_untrained"
    assert proxy_section(online()).online and not proxy_section(TrainConfig()).online
    with pytest.raises(ConfigError, match="would hold a live user"):
        online(proxy=ProxyConfig(admission="wait"))
    with pytest.raises(ConfigError, match="proxy.admission='later'"):
        ProxyConfig(admission="later")


def test_late_reward_cap_is_checked_against_eta_and_the_mode():
    online(actor=ActorConfig(late_reward_max_offpolicyness=8))
    with pytest.raises(ConfigError, match="must exceed rollout.max_head_offpolicyness=2"):
        online(actor=ActorConfig(late_reward_max_offpolicyness=2))
    with pytest.raises(ConfigError, match="applies to agent.mode=online"):
        TrainConfig(actor=ActorConfig(late_reward_max_offpolicyness=8))
    with pytest.raises(ConfigError, match="recompute_logprob"):
        online(actor=ActorConfig(late_reward_max_offpolicyness=8, recompute_logprob=False))


def test_warnings_name_settings_that_zero_singleton_advantages(caplog):
    # GRPO's preset subtracts the group mean: one sample is its own mean, advantage 0.
    (w,) = online(advantage=AdvantageConfig()).singleton_warnings()
    assert "n_samples=1 with advantage.estimator=grpo" in w and "adv_norm=" in w
    (w,) = online(advantage=AdvantageConfig(adv_norm=OFF, reward_norm=RewardNormConfig())
                  ).singleton_warnings()
    assert "reward_norm" in w
    # A batch mean over one sequence per step zeroes it too.
    (w,) = online(advantage=AdvantageConfig(estimator="reinforce_pp"),
                  train_dataset=DatasetConfig(prompts_per_step=1)).singleton_warnings()
    assert "one sequence per training step" in w
    assert online(advantage=AdvantageConfig(estimator="reinforce_pp")).singleton_warnings() == []
    # AReaL's online settings (reward_norm: null, adv_norm: null) warn about nothing, nor
    # does a GRPO run with real groups.
    assert online().singleton_warnings() == [] and TrainConfig().singleton_warnings() == []
    # The advantage processor says it at start too (its own log).
    with caplog.at_level(logging.WARNING, logger="tapioca.consumers.advantage"):
        AdvantageProcessor(AdvantageSection(advantage=AdvantageConfig(), max_new_tokens=8,
                                            n_samples=1))
    assert "every advantage is exactly 0" in caplog.text


# ---------------------------------------------------------------------- the advantage processor


def test_reward_delay_is_measured_from_the_producers_clocks():
    role = AdvantageProcessor(AdvantageSection(advantage=AdvantageConfig(adv_norm=OFF),
                                               max_new_tokens=8, n_samples=1))
    state = role.init_state()
    t = TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0,
                        group_size=1, prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0],
                        output_versions=[0], produced_at=1000.0, session_id="sess-1")
    r = RewardEvent(traj_id="g:0", group_id="g", reward=0.5, scorer="session",
                    produced_at=1010.5)  # 10.5 s after the session's end
    assert list(role.handle(t, state, Source("t.trajectories.v1", 0, 0))) == []
    (sample,) = role.handle(r, state, Source("t.rewards.v1", 0, 0))
    assert sample.reward_delay_s == pytest.approx(10.5)
    assert [q.advantage for q in sample.sequences] == [0.5]  # normalisation off


# ---------------------------------------------------------------------- the trainer

VOCAB, ETA = 16, 1


def online_trainer(run_dir, **actor_kw) -> Trainer:
    model = build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2), **actor_kw)
    actor = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    return Trainer(TrainerSection(actor=actor_cfg, model=ModelConfig(), max_head_offpolicyness=ETA,
                                  prompts_per_step=1, total_train_steps=100, temperature=1.0,
                                  run_dir=str(run_dir), seed=0, stop_at_reward=None,
                                  advantage=AdvantageConfig(adv_norm=OFF), online=True),
                   actor=actor)


def one(gid: str, min_version: int, delay_s: float = 0.0) -> SampleEvent:
    seq = SampleSequence(traj_id=f"{gid}:0", output_ids=[3, 4, 5], behav_logprobs=[-2.7] * 3,
                         output_versions=[min_version] * 3, reward=1.0, advantage=1.0)
    return SampleEvent(group_id=gid, prompt_id="p", prompt_ids=[1, 2], sequences=[seq],
                       min_version=min_version, max_version=min_version,
                       reward_delay_s=delay_s, adv_norm=OFF.spec(), reward_norm="none")


def run_to(trainer: Trainer, version: int):
    state = trainer.init_state()
    list(trainer.on_tick(state, 0.0))
    for k in range(version):
        trainer.handle(one(f"warm{k}", k), state, Source("t.samples.v1", 0, k))
    assert state.progress.version == version
    return state


def test_online_a_group_past_the_bound_is_dead_lettered_with_the_reason(tmp_path):
    trainer = online_trainer(tmp_path)
    try:
        state = run_to(trainer, 3)
        out = list(trainer.handle(one("late", 0, delay_s=7200), state, Source("t.samples.v1", 0, 9)))
        (letter,) = out
        assert isinstance(letter, DeadLetter) and isinstance(letter.error, BadEventError)
        assert letter.event.group_id == "late" and letter.source.offset == 9
        msg = str(letter.error)
        assert "3 versions behind" in msg and "bound of 1" in msg and "7200 s after" in msg
        assert "late_reward_max_offpolicyness" in msg
        assert "late" in state.rejected and state.dead_lettered_stale == 1
    finally:
        trainer.sink.close()


def test_online_a_late_group_within_the_cap_is_trained(tmp_path):
    trainer = online_trainer(tmp_path, late_reward_max_offpolicyness=3)
    try:
        state = run_to(trainer, 3)
        out = list(trainer.handle(one("late", 0, delay_s=7200), state, Source("t.samples.v1", 0, 9)))
        assert trained(out) == {4: ["late"]} and state.trained_late == 1
        # Past the cap: dead-lettered as before.
        (letter,) = trainer.handle(one("later", 0), state, Source("t.samples.v1", 0, 10))
        assert isinstance(letter, DeadLetter) and "bound of 3" in str(letter.error)
    finally:
        trainer.sink.close()


def test_events_from_before_the_online_fields_still_decode_and_train(tmp_path):
    """The wire only grew (session_id, delayed_reward_factor, reward_delay_s): events an
    older Tapioca wrote, without them, decode with the defaults, and the processor and the
    online trainer take them."""
    import orjson

    from tapioca.schemas.envelope import decode_event, encode_event

    def old(event, *fields):
        data = orjson.loads(encode_event(event))
        for name in fields:
            del data[name]
        return decode_event(orjson.dumps(data))

    t = old(TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0,
                            group_size=1, prompt_ids=[1], output_ids=[2, 3],
                            output_logprobs=[-1.0, -1.0], output_versions=[0, 0]),
            "session_id", "delayed_reward_factor")
    assert (t.session_id, t.delayed_reward_factor) == ("", 1.0)
    role = AdvantageProcessor(AdvantageSection(advantage=AdvantageConfig(adv_norm=OFF),
                                               max_new_tokens=8, n_samples=1))
    state = role.init_state()
    role.handle(t, state, Source("t.trajectories.v1", 0, 0))
    (sample,) = role.handle(RewardEvent(traj_id="g:0", group_id="g", reward=1.0), state,
                            Source("t.rewards.v1", 0, 0))
    legacy = old(one("legacy", 0), "reward_delay_s")
    assert legacy.reward_delay_s == 0.0
    trainer = online_trainer(tmp_path)
    try:
        state = trainer.init_state()
        list(trainer.on_tick(state, 0.0))
        out = list(trainer.handle(legacy, state, Source("t.samples.v1", 0, 0)))
        assert trained(out) == {1: ["legacy"]}
    finally:
        trainer.sink.close()
    assert sample.sequences[0].output_ids == [2, 3]
