"""Trainer as a plain function of events, on a real tiny model: steps of B groups,
weights files + WeightsEvent, ProgressEvent (trained and rejected groups),
de-duplication, the tail gate, the commit floor, restart from the checkpoint, and the
token-level parts (GAE with a critic, KL to a reference, batch normalisation,
distillation, the critic's checkpoint). No broker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tapioca.bus.role import Source
from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import (
    ActorConfig,
    AdvantageConfig,
    CriticConfig,
    DistillConfig,
    ModelConfig,
)
from tapioca.config.sections import TrainerSection
from tapioca.config.weights import WeightsConfig
from tapioca.models.factory import build_tiny_model
from tapioca.runtime.builders import build_token_models
from tapioca.schemas.errors import BadEventError, ConfigError
from tapioca.schemas.events import (
    MetricsEvent,
    ProgressEvent,
    SampleEvent,
    SampleSequence,
    WeightsEvent,
)
from tapioca.trainers.batching import flatten_groups
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.trainer import Trainer
from tapioca.weights.files import sha256_file

VOCAB = 16
TOPIC = "t.samples.v1"
B = 2
ETA = 1


def make_trainer(run_dir: Path, seed: int = 0, eta: int = ETA, **actor_kw) -> Trainer:
    model = build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=seed)
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2), **actor_kw)
    actor = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    section = TrainerSection(actor=actor_cfg, model=ModelConfig(), max_head_offpolicyness=eta,
                             prompts_per_step=B, total_train_steps=100, temperature=1.0,
                             run_dir=str(run_dir), seed=0, stop_at_reward=None)
    return Trainer(section, actor=actor)


def sample(gid: str, min_version: int = 0, n: int = 2, estimator: str = "grpo") -> SampleEvent:
    seqs = []
    for i in range(n):
        out = [(3 + 5 * i + j) % VOCAB for j in range(3)]
        seqs.append(SampleSequence(traj_id=f"{gid}:{i}", output_ids=out,
                                   behav_logprobs=[-2.7] * 3,
                                   output_versions=[min_version + (j > 0) for j in range(3)],
                                   reward=float(i == 0), advantage=1.0 if i == 0 else -1.0))
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[1, 2, 4],
                       sequences=seqs, min_version=min_version, max_version=min_version + 1,
                       estimator=estimator)


def src(offset: int, partition: int = 0) -> Source:
    return Source(topic=TOPIC, partition=partition, offset=offset)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}


@pytest.fixture
def trainer(tmp_path):
    t = make_trainer(tmp_path)
    yield t
    t.sink.close()


def progress_of(out) -> list[ProgressEvent]:
    return [e for e in out if isinstance(e, ProgressEvent)]


def weights_of(out) -> list[WeightsEvent]:
    ws = [e for e in out if isinstance(e, WeightsEvent)]
    # Bytes only: the trainer's verdicts are on progress.v1 (the old fields stay unset).
    assert all(not (w.group_ids or w.rejected_group_ids or w.groups_rejected or w.rollbacks)
               for w in ws)
    return ws


def start(t: Trainer):
    state = t.init_state()
    # The version-0 weights and progress at start.
    (hello,) = weights_of(hello_out := list(t.on_tick(state, 0.0)))
    (prog,) = progress_of(hello_out)
    assert hello.version == 0 and prog.version == 0 and prog.group_ids == []
    assert Path(hello.path).exists() and sha256_file(hello.path) == hello.sha256
    assert list(t.on_tick(state, 0.0)) == []
    return state


def test_one_step_after_B_groups(trainer):
    state = start(trainer)
    before = params(trainer)
    assert list(trainer.handle(sample("g0"), state, src(0))) == []
    assert state.progress.version == 0
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    out = list(trainer.handle(sample("g1"), state, src(1)))
    weights = weights_of(out)
    metrics = [e for e in out if isinstance(e, MetricsEvent)]
    assert len(weights) == 1 and len(metrics) == 1 and len(progress_of(out)) == 1
    w, (p,) = weights[0], progress_of(out)
    assert w.version == 1 and state.progress.version == 1 and p.version == 1
    assert p.group_ids == ["g0", "g1"]
    assert Path(w.path).is_file()
    assert sha256_file(w.path) == w.sha256
    assert w.num_bytes == Path(w.path).stat().st_size
    assert metrics[0].step == 1 and metrics[0].policy_version == 1
    assert metrics[0].metrics["reward/mean"] == pytest.approx(0.5)
    assert metrics[0].metrics["actor/trained_tokens"] == 12.0
    after = params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_duplicate_group_is_not_trained_again(trainer):
    state = start(trainer)
    trainer.handle(sample("g0"), state, src(0))
    trainer.handle(sample("g1"), state, src(1))
    assert state.progress.version == 1
    # Redelivered after training, and a duplicate of a buffered group.
    assert list(trainer.handle(sample("g0"), state, src(2))) == []
    assert list(trainer.handle(sample("g2"), state, src(3))) == []
    assert list(trainer.handle(sample("g2"), state, src(4))) == []
    assert state.duplicates == 2
    assert [s.group_id for s, _ in state.buffer] == ["g2"]
    out = list(trainer.handle(sample("g3"), state, src(5)))
    (w,) = progress_of(out)
    assert w.version == 2 and w.group_ids == ["g2", "g3"]
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert m.metrics["trainer/duplicates"] == 2.0


def test_tail_gate_rejects_over_stale_group(trainer):
    state = start(trainer)
    trained: list[str] = []
    for k in range(4):  # two steps: version 2
        for e in trainer.handle(sample(f"g{k}", min_version=k // 2), state, src(k)):
            if isinstance(e, ProgressEvent):
                trained += e.group_ids
    assert state.progress.version == 2
    # staleness 2 - 0 = 2 > eta = 1: rejected; staleness 2 - 1 = 1: accepted.
    assert list(trainer.handle(sample("stale", min_version=0), state, src(4))) == []
    assert state.rejected_stale == 1 and "stale" in state.rejected
    assert list(trainer.handle(sample("ok", min_version=1), state, src(5))) == []
    assert [s.group_id for s, _ in state.buffer] == ["ok"]
    (announce,) = trainer.on_tick(state, 0.0)
    # A progress event, not a weights one (no new bytes): it repeats the groups of the
    # step that made the version (so the latest event per version always lists them),
    # never the rejected group.
    assert isinstance(announce, ProgressEvent)
    assert announce.version == 2 and announce.groups_rejected == 1
    assert announce.group_ids == ["g2", "g3"]
    assert announce.rejected_group_ids == ["stale"]  # the rejection is named on the log
    assert list(trainer.on_tick(state, 0.0)) == []
    # A redelivered rejected group is a duplicate, not a second rejection.
    trainer.handle(sample("stale", min_version=0), state, src(6))
    assert state.rejected_stale == 1 and state.duplicates == 1
    out = list(trainer.handle(sample("g9", min_version=2), state, src(7)))
    (w,) = progress_of(out)
    trained += w.group_ids
    assert "stale" not in trained
    assert w.groups_rejected == 1 and w.rejected_group_ids == []  # named once already
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert m.metrics["trainer/rejected_stale"] == 1.0


def test_committable_follows_checkpoints_and_holds_buffered_groups(trainer):
    state = start(trainer)
    assert trainer.committable(state, TOPIC, 0, 1) == 0
    trainer.handle(sample("g0"), state, src(10))
    assert trainer.committable(state, TOPIC, 0, 11) == 0
    trainer.handle(sample("g1"), state, src(11))  # step 1 + checkpoint
    assert trainer.committable(state, TOPIC, 0, 12) == 12
    assert trainer.committable(state, TOPIC, 1, 5) == 0  # nothing checkpointed there
    # A buffered group, then events handled past it: the commit stays at the group.
    trainer.handle(sample("g2"), state, src(12))
    trainer.handle(sample("g0"), state, src(13))  # duplicate
    assert trainer.committable(state, TOPIC, 0, 14) == 12
    # A group on another partition trains with g2: both partitions advance.
    trainer.handle(sample("g3"), state, src(4, partition=1))
    assert state.progress.version == 2
    assert trainer.committable(state, TOPIC, 0, 14) == 14
    assert trainer.committable(state, TOPIC, 1, 5) == 5


def test_a_stop_right_after_a_checkpointed_step_does_not_write_the_checkpoint_again(tmp_path, monkeypatch):
    # The last step's checkpoint (version >= total_train_steps, or every k-th) covers the
    # version already: writing it again at the stop would need the disk for two copies
    # (the 3B example's 43 GB checkpoint did not fit twice on a 64 GB disk).
    t = make_trainer(tmp_path, checkpoint_every_steps=1)
    state = start(t)
    saves = []
    real = t.actor.save_checkpoint
    monkeypatch.setattr(t.actor, "save_checkpoint", lambda path, p: (saves.append(p.version), real(path, p)))
    for k in range(2):
        t.handle(sample(f"g{k}"), state, src(k))
    assert state.progress.version == 1 and saves == [1]
    t.on_stop(state)
    assert saves == [1]
    t2 = make_trainer(tmp_path, seed=123)
    s2 = t2.init_state()
    assert s2.progress.version == 1 and s2.trained == {"g0", "g1"} and t2.checkpoints.saved_version == 1
    t2.sink.close()


def test_committable_is_the_lower_of_the_handled_offset_and_the_checkpoint(trainer):
    state = start(trainer)
    trainer.handle(sample("g0"), state, src(10))
    trainer.handle(sample("g1"), state, src(11))  # step 1 + checkpoint covering offset 12
    assert state.progress.offsets == {f"{TOPIC}:0": 12}
    assert trainer.committable(state, TOPIC, 0, 13) == 12  # read further: the checkpoint bounds
    assert trainer.committable(state, TOPIC, 0, 7) == 7  # read less (a restart): what was read
    assert trainer.committable(state, TOPIC, 1, 5) == 0  # nothing checkpointed there


def test_stop_writes_the_final_checkpoint_before_finishing_the_weight_publisher(tmp_path, monkeypatch):
    t = make_trainer(tmp_path, checkpoint_every_steps=1000)  # no periodic checkpoint: only the stop's
    state = start(t)
    for k in range(2):
        t.handle(sample(f"g{k}"), state, src(k))
    assert state.progress.version == 1
    finishing = []

    def finish_fails(final_version=None, timeout_s=600.0):
        finishing.append(final_version)
        raise OSError("the weights disk is gone (injected)")

    monkeypatch.setattr(t.payload.out, "finish", finish_fails)
    with pytest.raises(OSError, match="injected"):
        t.on_stop(state)
    assert finishing == [1]
    assert t.payload.out.slots is None  # closed anyway
    saved = params(t)
    t2 = make_trainer(tmp_path, seed=123)
    s2 = t2.init_state()
    assert s2.progress.version == 1 and s2.trained == {"g0", "g1"}
    assert all(torch.equal(v, saved[k]) for k, v in params(t2).items())
    t2.sink.close()


def test_checkpoint_offsets_never_pass_a_buffered_group(tmp_path):
    # Checkpoint while a group is buffered (done trainer keeps buffering; forced save).
    t = make_trainer(tmp_path)
    state = start(t)
    t.handle(sample("g0"), state, src(0))
    t.handle(sample("g1"), state, src(1))
    t.handle(sample("g2"), state, src(2))  # buffered
    t.handle(sample("g1"), state, src(3))  # duplicate, handled past the buffered group
    t.checkpoints.save(state)
    assert t.committable(state, TOPIC, 0, 4) == 2
    t.sink.close()


def test_restart_resumes_from_checkpoint(tmp_path):
    t1 = make_trainer(tmp_path, seed=0)
    s1 = start(t1)
    for k in range(4):
        t1.handle(sample(f"g{k}"), s1, src(k))
    assert s1.progress.version == 2
    saved = params(t1)
    t1.sink.close()

    t2 = make_trainer(tmp_path, seed=123)  # different initial weights
    fresh = params(t2)
    assert any(not torch.equal(fresh[k], saved[k]) for k in saved)
    s2 = t2.init_state()
    assert s2.progress.version == 2
    restored = params(t2)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)
    assert s2.trained == {"g0", "g1", "g2", "g3"}
    # Never past what this process has read, nor past the checkpoint.
    assert t2.committable(s2, TOPIC, 0, 2) == 2
    assert t2.committable(s2, TOPIC, 0, 9) == 4
    # Re-fed trained groups are duplicates.
    for k in range(4):
        assert list(t2.handle(sample(f"g{k}"), s2, src(k))) == []
    assert s2.duplicates == 4 and s2.buffer == []
    # It announces its current version (not a new one) at start: bytes and progress.
    hello, prog = t2.on_tick(s2, 0.0)
    assert hello.version == 2 and sha256_file(hello.path) == hello.sha256
    assert isinstance(prog, ProgressEvent) and prog.version == 2
    assert prog.group_ids == ["g2", "g3"]  # the groups of its last step, named again
    # And continues with version 3.
    t2.handle(sample("g4", min_version=2), s2, src(4))
    out = list(t2.handle(sample("g5", min_version=2), s2, src(5)))
    (w,) = progress_of(out)
    assert w.version == 3 and w.group_ids == ["g4", "g5"]
    t2.sink.close()


def test_dropped_group_counts_as_rejected_and_frees_its_slot(trainer):
    state = start(trainer)
    dropped = sample("g-dropped")
    dropped.sequences = []
    dropped.dropped_reason = "timeout after 600 s: 1 of 2 trajectories, 1 rewards"
    assert list(trainer.handle(dropped, state, src(0))) == []
    assert state.buffer == [] and "g-dropped" in state.rejected
    (announce,) = trainer.on_tick(state, 0.0)
    assert isinstance(announce, ProgressEvent) and announce.groups_rejected == 1


# ------------------------------------------------------------ token-level parts (issue 4)
# GAE with a critic, KL to a reference in the reward, batch normalisation, on-policy
# distillation, and the critic in the checkpoint. Same tiny model, no broker.

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position_embeddings=64)


def make_token_trainer(run_dir: Path, seed: int = 0, *, actor: dict | None = None,
                       **section_kwargs) -> Trainer:
    model = build_tiny_model(VOCAB, seed=seed, **TINY)
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2), **(actor or {}))
    ppo = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    section = TrainerSection(actor=actor_cfg, model=ModelConfig(), max_head_offpolicyness=ETA,
                             prompts_per_step=B, total_train_steps=100, temperature=1.0,
                             run_dir=str(run_dir), seed=0, stop_at_reward=None, **section_kwargs)
    return Trainer(section, actor=ppo, **build_token_models(section, ppo))


def full_logprobs(model: torch.nn.Module, item) -> list[float]:
    """Log-probs of an item's output tokens from the plain full-vocabulary logits: an
    independent path from the chunked gather the trainer uses."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([item.input_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    P = item.prompt_len
    return [float(logp[P - 1 + j, tok]) for j, tok in enumerate(item.input_ids[P:])]


def step_metrics(t: Trainer, state, gids: list[str], offset: int) -> dict[str, float]:
    out = []
    for k, g in enumerate(gids):
        out += list(t.handle(sample(g, min_version=state.progress.version,
                                    estimator=t.cfg.advantage.estimator), state, src(offset + k)))
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    return m.metrics


def test_default_config_leaves_scalar_advantages(trainer):
    # Today's behaviour: no token-level part is active, items keep their scalar advantage.
    assert not trainer.token_adv.active and trainer.critic is None
    assert trainer.token_adv.reference is None and trainer.token_adv.teacher is None


def test_gae_critic_value_loss_falls_on_repeated_batches(tmp_path):
    t = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="gae"),
                           critic=CriticConfig(lr=3e-3),
                           actor={"discount": 1.0, "gae_lambda": 0.95})
    assert t.critic is not None and t.token_adv.active
    state = start(t)
    losses = []
    for step in range(8):  # the same two groups' contents, under new ids
        m = step_metrics(t, state, [f"a{step}", f"b{step}"], 2 * step)
        losses.append(m["critic/value_loss"])
        assert all(math.isfinite(m[k]) for k in ("critic/value_loss", "critic/value_mean",
                                                    "critic/return_mean", "adv/token_mean"))
    # The value head starts at 0, so the first loss is 0.5 * mean(R^2) over the 12 trained
    # tokens. With V = 0 the GAE return is sum_k (gamma*lambda)^k r_{t+k}: sequences with
    # reward 1 (one per group) get [0.95^2, 0.95, 1], those with reward 0 get zeros:
    # 0.5 * 2 * (0.95^4 + 0.95^2 + 1) / 12 = (0.81450625 + 0.9025 + 1) / 12 = 0.2264171875.
    assert losses[0] == pytest.approx(0.2264171875, abs=1e-6)
    # Measured here: 0.226, 0.202, 0.163, 0.129, 0.102, 0.086, 0.069, 0.067.
    assert losses[-1] < 0.5 * losses[0], losses
    assert "critic/explained_var" in m
    # gae preset: batch mean and std over the tokens.
    assert abs(m["adv/token_mean"]) < 1e-5
    t.sink.close()


def test_gae_turn_level_step_runs(tmp_path):
    t = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="gae"),
                           actor={"gae_timestep_unit": "turn", "discount": 0.9})
    state = start(t)
    s0, s1 = sample("g0", estimator="gae"), sample("g1", estimator="gae")
    for s in (s0, s1):
        for q in s.sequences:
            q.turn_boundaries = [0, 2]  # two turns: tokens 0-1 and token 2
    items = flatten_groups([s0, s1])
    t.token_adv.compute(items)
    for it in items:  # every token of a turn shares its advantage
        assert it.token_advantages[0] == it.token_advantages[1]
    t.handle(s0, state, src(0))
    out = list(t.handle(s1, state, src(1)))
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert math.isfinite(m.metrics["critic/value_loss"])
    t.sink.close()


def test_kl_ctl_adds_the_future_kl_penalty_to_the_group_advantage(tmp_path):
    t = make_token_trainer(tmp_path, actor={"kl_ctl": 0.1, "kl_estimator": "k1"})
    ref = t.token_adv.reference
    assert ref is not None and t.critic is None
    # The reference is a frozen copy of the initial policy, not the policy object.
    assert ref.model is not t.actor.model
    assert all(not p.requires_grad for p in ref.model.parameters())
    items = flatten_groups([sample("g0"), sample("g1")])
    t.token_adv.compute(items)
    for it in items:
        ref_lp = full_logprobs(t.actor.model, it)  # policy == reference before training
        kl = [b - r for b, r in zip(it.behav_logprobs, ref_lp)]  # k1, behaviour vs ref
        for j in range(len(kl)):
            future_penalty = sum(-0.1 * k for k in kl[j:])
            assert it.token_advantages[j] == pytest.approx(it.advantage + future_penalty, abs=1e-4)
    state = start(t)
    m = step_metrics(t, state, ["g0", "g1"], 0)
    assert math.isfinite(m["actor/kl_ref"]) and m["actor/kl_ref"] != 0.0
    # After a step the policy moved but the reference did not.
    assert any(not torch.equal(a, b) for a, b in zip(t.actor.model.parameters(),
                                                     ref.model.parameters()))
    t.sink.close()


def test_tree_training_builds_a_packed_reference_that_scores_the_same_kl(tmp_path):
    """actor.enable_tree_training through the builders: the reference gets the packed
    forward and scores prefix trees (the group's prompt once); the token advantages are
    those of the padded reference forward."""
    flat = make_token_trainer(tmp_path / "flat", actor={"kl_ctl": 0.1})
    tree = make_token_trainer(tmp_path / "tree", actor={"kl_ctl": 0.1, "enable_tree_training": True})
    assert flat.token_adv.reference.packed is None and not flat.token_adv.tree_training
    assert tree.token_adv.reference.packed is not None and tree.token_adv.tree_training
    items_f, items_t = (flatten_groups([sample("g0"), sample("g1", n=3)]) for _ in range(2))
    flat.token_adv.compute(items_f)
    tree.token_adv.compute(items_t)
    for a, b in zip(items_f, items_t, strict=True):
        assert b.token_advantages == pytest.approx(a.token_advantages, abs=1e-5)
    flat.sink.close()
    tree.sink.close()


def test_batch_normalisation_gives_zero_mean_unit_std_token_advantages(tmp_path):
    t = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="reinforce_pp"))
    assert t.token_adv.center and t.token_adv.scale
    samples = [sample("g0"), sample("g1", n=3)]
    samples[1].sequences[2].reward = 0.25
    samples[1].sequences[2].advantage = 0.25
    items = flatten_groups(samples)
    t.token_adv.compute(items)
    toks = torch.tensor([a for it in items for a in it.token_advantages])
    assert abs(float(toks.mean())) < 1e-6
    assert float(toks.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    # lite_ppo: batch std only (the group mean is the processor's): the RMS becomes 1
    # and signs are kept.
    t2 = make_token_trainer(tmp_path / "lite", advantage=AdvantageConfig(estimator="lite_ppo"))
    assert not t2.token_adv.center and t2.token_adv.scale
    items = flatten_groups([sample("g0"), sample("g1")])
    t2.token_adv.compute(items)
    toks = torch.tensor([a for it in items for a in it.token_advantages])
    assert float(toks.square().mean().sqrt()) == pytest.approx(1.0, abs=1e-4)
    assert [a > 0 for a in toks.tolist()] == [it.advantage > 0 for it in items for _ in it.loss_mask]
    state = start(t)
    m = step_metrics(t, state, ["g0", "g1"], 0)
    assert abs(m["adv/token_mean"]) < 1e-5
    t.sink.close()
    t2.sink.close()


@pytest.fixture
def teacher_dir(tmp_path):
    path = tmp_path / "teacher"
    build_tiny_model(VOCAB, seed=7, **TINY).save_pretrained(path)
    return path


def test_distillation_with_a_teacher(tmp_path, teacher_dir):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    # Pure KD: rl_weight 0, A_t = logp_teacher - logp_student (the behaviour logp).
    t = make_token_trainer(tmp_path, distill=DistillConfig(teacher_path=str(teacher_dir),
                                                          kd_weight=1.0, rl_weight=0.0))
    items = flatten_groups([sample("g0"), sample("g1")])
    metrics = t.token_adv.compute(items)
    for it in items:
        t_lp = full_logprobs(teacher, it)
        expected = [tl - b for tl, b in zip(t_lp, it.behav_logprobs)]
        assert it.token_advantages == pytest.approx(expected, abs=1e-4)
    assert math.isfinite(metrics["distill/reverse_kl"])
    # RL + KD: A = 1 * A_rl + 0.5 * A_kd.
    t2 = make_token_trainer(tmp_path / "mix", distill=DistillConfig(
        teacher_path=str(teacher_dir), kd_weight=0.5, rl_weight=1.0))
    items = flatten_groups([sample("g0"), sample("g1")])
    t2.token_adv.compute(items)
    for it in items:
        t_lp = full_logprobs(teacher, it)
        expected = [it.advantage + 0.5 * (tl - b) for tl, b in zip(t_lp, it.behav_logprobs)]
        assert it.token_advantages == pytest.approx(expected, abs=1e-4)
    state = start(t)
    m = step_metrics(t, state, ["g0", "g1"], 0)
    assert math.isfinite(m["distill/reverse_kl"]) and math.isfinite(m["distill/teacher_logp"])
    t.sink.close()
    t2.sink.close()


def test_teacher_with_another_vocabulary_is_a_config_error(tmp_path):
    path = tmp_path / "big-teacher"
    build_tiny_model(VOCAB + 4, seed=7, **TINY).save_pretrained(path)
    with pytest.raises(ConfigError, match="vocab_size"):
        make_token_trainer(tmp_path, distill=DistillConfig(teacher_path=str(path), kd_weight=1.0))
    with pytest.raises(ConfigError, match="teacher_path"):
        DistillConfig(kd_weight=1.0)


def critic_params(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.critic.model.state_dict().items()}


def test_critic_checkpoint_restore_is_exact(tmp_path):
    kw = dict(advantage=AdvantageConfig(estimator="gae"), critic=CriticConfig(lr=1e-2))
    t1 = make_token_trainer(tmp_path, seed=0, **kw)
    s1 = start(t1)
    for k in range(4):
        t1.handle(sample(f"g{k}", estimator="gae"), s1, src(k))
    assert s1.progress.version == 2
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("critic_v*.safetensors"))
    assert ckpts == ["critic_v000002.safetensors"]  # older versions are removed
    saved = critic_params(t1)

    t2 = make_token_trainer(tmp_path, seed=123, **kw)  # other initial weights
    assert any(not torch.equal(v, saved[k]) for k, v in critic_params(t2).items())
    s2 = t2.init_state()
    assert s2.progress.version == 2
    assert all(torch.equal(v, saved[k]) for k, v in critic_params(t2).items())
    o1, o2 = t1.critic.optimizer.state_dict(), t2.critic.optimizer.state_dict()
    assert o1["state"].keys() == o2["state"].keys()
    assert all(torch.equal(o1["state"][i]["exp_avg_sq"], o2["state"][i]["exp_avg_sq"])
               for i in o1["state"])
    # The next step is the same from memory and from the checkpoint.
    for t, s in ((t1, s1), (t2, s2)):
        t.handle(sample("g4", min_version=2, estimator="gae"), s, src(4))
        t.handle(sample("g5", min_version=2, estimator="gae"), s, src(5))
        assert s.progress.version == 3
    assert all(torch.equal(v, critic_params(t1)[k]) for k, v in critic_params(t2).items())
    assert all(torch.equal(v, params(t1)[k]) for k, v in params(t2).items())
    t1.sink.close()
    t2.sink.close()


def test_gae_samples_on_a_non_gae_trainer_are_dead_lettered_and_it_goes_on(trainer):
    state = start(trainer)
    s0, s1 = sample("g0"), sample("g1")
    s1.estimator = "gae"  # advantages 0: only a gae trainer can train these
    trainer.handle(s0, state, src(0))
    with pytest.raises(BadEventError, match="estimator gae, but this trainer's estimator is grpo"):
        trainer.handle(s1, state, src(1))
    assert state.progress.version == 0
    # Counted, its group rejected (its slot freed, named on the next announcement).
    assert state.dead_lettered == state.dead_lettered_config == 1
    assert "g1" in state.rejected
    (announce,) = trainer.on_tick(state, 0.0)
    assert announce.rejected_group_ids == ["g1"] and announce.groups_rejected == 1
    # The trainer goes on: the next good group makes the step.
    out = list(trainer.handle(sample("g2"), state, src(2)))
    (w,) = progress_of(out)
    assert w.version == 1 and w.group_ids == ["g0", "g2"]


def test_samples_of_another_estimator_or_normalisation_are_dead_lettered(tmp_path):
    t = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="lite_ppo"))
    state = start(t)
    with pytest.raises(BadEventError, match="estimator grpo, but this trainer's estimator is "
                       "lite_ppo.*same advantage section"):
        t.handle(sample("g0"), state, src(0))  # a grpo processor's group
    # Same estimator, but the processor normalised differently (its adv_norm or eps).
    own = AdvantageConfig(estimator="lite_ppo").norm().spec()
    assert own == "mean=group std=batch leave1out=0 unbiased=0 eps=1e-06"
    other = sample("g1", estimator="lite_ppo")
    other.adv_norm = own.replace("eps=1e-06", "eps=0.001")
    with pytest.raises(BadEventError, match="normalised as 'mean=group std=batch leave1out=0 "
                       "unbiased=0 eps=0.001'.*gives 'mean=group std=batch"):
        t.handle(other, state, src(1))
    assert state.dead_lettered_config == 2 and state.rejected == {"g0", "g1"}
    # Matching spec, or none (events from before the field existed): accepted.
    for k, spec in enumerate((own, "")):
        ok = sample(f"ok{k}", estimator="lite_ppo")
        ok.adv_norm = spec
        t.handle(ok, state, src(2 + k))
    assert state.progress.version == 1 and state.trained == {"ok0", "ok1"}
    t.sink.close()


def _rollback(t: Trainer, state, target: int):
    from tapioca.schemas.events import ControlEvent

    path = t.run_dir / "weights" / f"v{target:06d}.safetensors"
    cmd = ControlEvent(command_id="c1", command="rollback", target="trainer",
                       args={"version": target, "sha256": sha256_file(path)})
    return t.on_control(cmd, state)


def test_rollback_resets_the_critic_optimizer_without_its_checkpoint(tmp_path, caplog):
    t = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="gae"))
    state = start(t)
    for k in range(4):
        t.handle(sample(f"g{k}", min_version=k // 2, estimator="gae"), state, src(k))
    assert state.progress.version == 2 and t.critic.optimizer.state
    before = critic_params(t)
    with caplog.at_level("WARNING", logger="tapioca.trainers.rollback"):
        ok, message, (weights, prog) = _rollback(t, state, 1)  # only critic_v000002.safetensors is kept
    assert ok and weights.version == 3 and weights.rollback_of == 1
    assert prog.version == 3 and prog.rollbacks == 1 and prog.group_ids == []
    # Checkpointed with the version: a restarted trainer re-announces v3 with rollbacks 1,
    # so the head gate does not count the rollback as a trained step after a restart.
    t2 = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="gae"))
    s2 = t2.init_state()
    assert s2.progress.version == 3 and s2.progress.rollbacks == 1
    (again,) = progress_of(t2.on_tick(s2, 0.0))
    assert again.version == 3 and again.rollbacks == 1
    t2.sink.close()
    assert "critic keeps its weights" in message and "no critic checkpoint of that version" in caplog.text
    assert not t.critic.optimizer.state and not t.actor.optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in critic_params(t).items())
    t.sink.close()


def test_rollback_restores_the_critic_checkpoint_of_that_version(tmp_path):
    t = make_token_trainer(tmp_path, advantage=AdvantageConfig(estimator="gae"),
                           actor={"checkpoint_every_steps": 2})
    state = start(t)
    for k in range(4):
        t.handle(sample(f"g{k}", min_version=k // 2, estimator="gae"), state, src(k))
    assert (tmp_path / "checkpoints" / "critic_v000002.safetensors").exists()
    at_v2 = critic_params(t)
    adam_v2 = {i: s["exp_avg"].clone() for i, s in t.critic.optimizer.state_dict()["state"].items()}
    for k in range(4, 6):  # version 3: trained, not checkpointed
        t.handle(sample(f"g{k}", min_version=2, estimator="gae"), state, src(k))
    assert state.progress.version == 3
    assert any(not torch.equal(v, at_v2[k]) for k, v in critic_params(t).items())
    ok, message, (weights, _) = _rollback(t, state, 2)
    assert ok and weights.version == 4 and "critic restored from critic_v000002.safetensors" in message
    assert all(torch.equal(v, at_v2[k]) for k, v in critic_params(t).items())
    adam = t.critic.optimizer.state_dict()["state"]
    assert adam.keys() == adam_v2.keys()
    assert all(torch.equal(adam[i]["exp_avg"], adam_v2[i]) for i in adam)
    t.sink.close()


def _wait_for_files(t: Trainer, state, versions: set[int], timeout_s: float = 30.0) -> list:
    """on_tick until the durable files of ``versions`` are announced; the events seen."""
    import time as _time

    events, announced = [], set()
    deadline = _time.monotonic() + timeout_s
    while versions and not versions <= announced:
        assert _time.monotonic() < deadline, f"files announced: {sorted(announced)}"
        for e in weights_of(t.on_tick(state, 0.0)):
            events.append(e)
            announced |= {f.version for f in e.files}
        _time.sleep(0.01)
    return events


def test_ipc_transport_announces_files_later_and_rollback_reads_them(tmp_path):
    from tapioca.weights.payload import load_verified

    t = make_token_trainer(tmp_path, weights=WeightsConfig(transport="ipc"))
    state = t.init_state()
    (hello,) = weights_of(t.on_tick(state, 0.0))
    assert hello.transport == "ipc" and hello.version == 0 and hello.path == "" and hello.tensors
    files = {f.version: f for f in hello.files}
    for k in range(4):
        out = t.handle(sample(f"g{k}", min_version=k // 2), state, src(k))
        for e in weights_of(out):
            assert e.transport == "ipc" and e.version == k // 2 + 1
            files.update((f.version, f) for f in e.files)
        # The file of each version comes after its event (background writer), listed by a
        # later event: the next step's, or a repeat of the current version (a weights
        # event, on weights.v1, whose only news is the file).
        if k % 2:
            for e in _wait_for_files(t, state, {k // 2 + 1} - set(files)):
                assert e.version == state.progress.version
                files.update((f.version, f) for f in e.files)
    for v, f in files.items():
        assert Path(f.path).name == f"v{v:06d}.safetensors" and sha256_file(f.path) == f.sha256
    assert {1, 2} <= set(files)
    at_v1 = load_verified(files[1].path, files[1].sha256)
    # Rollback from the file, published over ipc as version 3.
    from tapioca.schemas.events import ControlEvent

    ok, message, (v3, _) = t.on_control(ControlEvent(
        command_id="c", command="rollback", target="trainer",
        args={"version": 1, "sha256": files[1].sha256}), state)
    assert ok and v3.version == 3 and v3.rollback_of == 1 and v3.transport == "ipc"
    own = t.actor.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in at_v1.items())
    # A restarted trainer has no buffers: it publishes its version again at start.
    t.on_stop(state)
    t2 = make_token_trainer(tmp_path, weights=WeightsConfig(transport="ipc"))
    s2 = t2.init_state()
    (again,) = weights_of(again_out := list(t2.on_tick(s2, 0.0)))
    assert again.version == 3 and again.transport == "ipc"
    assert progress_of(again_out)[0].rollbacks == 1
    t2.on_stop(s2)


# ---------------------------------------------------------------------------
# Poison pills (issue 10): a bad sample is dead-lettered, its group rejected (slot freed),
# and the trainer goes on; a non-finite step is not applied.


def _bad(gid: str, made_at: int = 0, **changes) -> SampleEvent:
    s = sample(gid, min_version=made_at)
    for key, value in changes.items():
        if key.startswith("seq_"):
            setattr(s.sequences[0], key[4:], value)
        else:
            setattr(s, key, value)
    return s


@pytest.mark.parametrize("changes, message", [
    ({"seq_output_ids": [3, VOCAB + 5, 4]}, r"output_ids has token ids in \[3, 21\], outside"),
    ({"prompt_ids": [1, -1, 4]}, r"prompt_ids has token ids in \[-1, 4\]"),
    ({"seq_behav_logprobs": [-1e30, -1.0, -1.0]}, "behaviour logprobs in"),
    ({"seq_behav_logprobs": [0.5, -1.0, -1.0]}, "behaviour logprobs in"),
    ({"seq_reward": 1.5e308}, "reward 1.5e\\+308, beyond"),
    ({"seq_advantage": -1e12}, "advantage -1e\\+12, beyond"),
    ({"made_at": 3}, "made by policy versions 3..4, but the trainer is at version 0: its "
                     "staleness would be -3"),
    ({"min_version": 1}, "declares min_version 1 but its tokens' oldest version is 0"),
    ({"sequences": []}, "no output tokens"),
    ({"seq_turn_boundaries": [0, 7]}, "turn_boundaries outside"),
])
def test_bad_sample_is_dead_lettered_and_the_trainer_goes_on(trainer, changes, message):
    state = start(trainer)
    trainer.handle(sample("g0"), state, src(0))
    before = params(trainer)
    with pytest.raises(BadEventError, match=message):
        trainer.handle(_bad("bad", **changes), state, src(1))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    assert state.progress.version == 0 and state.dead_lettered == 1
    assert "bad" in state.rejected and [s.group_id for s, _ in state.buffer] == ["g0"]
    (announce,) = trainer.on_tick(state, 0.0)
    assert announce.rejected_group_ids == ["bad"]
    # A redelivery of the same bad sample is dead-lettered again, not counted again.
    with pytest.raises(BadEventError):
        trainer.handle(_bad("bad", **changes), state, src(1))
    assert state.rejected == {"bad"} and list(trainer.on_tick(state, 0.0)) == []
    out = list(trainer.handle(sample("g1"), state, src(2)))
    (w,) = progress_of(out)
    assert w.version == 1 and w.group_ids == ["g0", "g1"]
    assert all(torch.isfinite(v).all() for v in params(trainer).values())


def test_offline_trainer_trains_groups_made_at_versions_ahead_of_its_own(tmp_path):
    """Issue 29: offline (gate off, OFFLINE_ETA) the recorded versions are the online
    trainer's, so a group made at version 3 reaches a trainer at version 0 normally; the
    live trainer above dead-letters that same group as a forged version. A negative
    version is still refused."""
    from tapioca.trainers.offline import OFFLINE_ETA

    t = make_trainer(tmp_path, eta=OFFLINE_ETA)
    try:
        state = start(t)
        t.handle(_bad("late", made_at=3), state, src(0))
        out = list(t.handle(sample("g0"), state, src(1)))
        (w,) = progress_of(out)
        assert w.version == 1 and w.group_ids == ["late", "g0"] and state.dead_lettered == 0
        with pytest.raises(BadEventError, match="made by policy versions -1..0"):
            t.handle(_bad("negative", made_at=-1), state, src(2))
    finally:
        t.sink.close()


def test_non_finite_step_is_skipped_and_its_groups_dead_lettered(trainer, monkeypatch):
    """An advantage of 1e20 (past the arrival checks, switched off here to reach the step)
    gives an infinite gradient norm (its square overflows float32): the optimizer step is
    skipped, the batch's groups are dead-lettered and rejected, the version does not
    move, and the next batch trains."""
    from tapioca.bus.role import DeadLetter
    from tapioca.trainers import admission as admission_module

    real_check = admission_module.check_trainable
    monkeypatch.setattr(admission_module, "check_trainable", lambda event, **kw: 0)
    state = start(trainer)
    before = params(trainer)
    trainer.handle(sample("g0"), state, src(0))
    out = list(trainer.handle(_bad("g1", seq_advantage=1e20), state, src(1)))
    dead = [e for e in out if isinstance(e, DeadLetter)]
    assert sorted(d.event.group_id for d in dead) == ["g0", "g1"]
    assert [d.source.offset for d in sorted(dead, key=lambda d: d.event.group_id)] == [0, 1]
    assert all("not finite" in str(d.error) for d in dead)
    assert not [e for e in out if isinstance(e, WeightsEvent)]
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert m.metrics["trainer/skipped_steps"] == 1.0
    assert all(math.isfinite(v) for v in m.metrics.values())
    assert state.progress.version == 0 and state.skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    assert state.rejected == {"g0", "g1"} and state.buffer == []
    (announce,) = trainer.on_tick(state, 0.0)
    assert sorted(announce.rejected_group_ids) == ["g0", "g1"] and announce.version == 0
    monkeypatch.setattr(admission_module, "check_trainable", real_check)
    trainer.handle(sample("g2"), state, src(2))
    out = list(trainer.handle(sample("g3"), state, src(3)))
    (w,) = progress_of(out)
    assert w.version == 1 and w.group_ids == ["g2", "g3"]
    assert all(torch.isfinite(v).all() for v in params(trainer).values())


def test_rollback_reapplies_the_tail_gate_to_buffered_groups(trainer):
    """The tail gate's hard guarantee (docs/design.md#3-policy-versions-and-the-staleness-window):
    a group that waited in the buffer while a rollback
    bumped the version is gated again; it would otherwise train at staleness eta+1."""
    state = start(trainer)
    trainer.handle(sample("g0"), state, src(0))
    trainer.handle(sample("g1"), state, src(1))
    assert state.progress.version == 1
    trainer.handle(sample("waits", min_version=0), state, src(2))  # staleness 1 = eta: ok
    ok, _, _ = _rollback(trainer, state, 0)
    assert ok and state.progress.version == 2
    assert "waits" in state.rejected and state.buffer == []
    (announce,) = trainer.on_tick(state, 0.0)
    assert "waits" in announce.rejected_group_ids
    trainer.handle(sample("g2", min_version=1), state, src(3))
    out = list(trainer.handle(sample("g3", min_version=2), state, src(4)))
    (w,) = progress_of(out)
    assert w.group_ids == ["g2", "g3"]
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert m.metrics["trainer/staleness_max"] <= ETA


def test_step_gates_the_buffer_at_training_time(trainer):
    """The gate is re-applied when the step runs, whatever moved the version."""
    state = start(trainer)
    trainer.handle(sample("old", min_version=0), state, src(0))
    state.progress.version = 2  # e.g. a rollback's version bump, seen by the next step
    assert list(trainer.handle(sample("new", min_version=2), state, src(1))) == []
    assert "old" in state.rejected and [s.group_id for s, _ in state.buffer] == ["new"]


def test_group_without_a_shared_prompt_trains(trainer):
    """An agent group whose sessions share no first token arrives with prompt_ids=[]:
    each sequence's first token serves as its prompt instead of crashing the step."""
    state = start(trainer)
    trainer.handle(sample("g0"), state, src(0))
    empty = sample("g1")
    empty.prompt_ids = []
    out = list(trainer.handle(empty, state, src(1)))
    (w,) = progress_of(out)
    assert w.version == 1 and w.group_ids == ["g0", "g1"]
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert m.metrics["actor/trained_tokens"] == 6 + 4  # g1: first output token became prompt


def test_non_finite_minibatch_skips_only_its_groups(tmp_path, monkeypatch):
    """With actor.ppo_n_minibatches=2, a bad group's minibatch is skipped and its group
    dead-lettered; the other minibatch is applied and its group makes the version. (In a
    later minibatch the policy has moved, so the bad tokens' ratios are clipped and an
    advantage of 1e20 would pass with a zero gradient; 3.3e38 overflows the loss.)"""
    from tapioca.bus.role import DeadLetter
    from tapioca.trainers import admission as admission_module

    monkeypatch.setattr(admission_module, "check_trainable", lambda event, **kw: 0)
    model = build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    # One group (2 sequences of 6 tokens) per micro-batch, one micro-batch per minibatch.
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2), ppo_n_minibatches=2, mb_max_tokens=16)
    actor = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    t = Trainer(TrainerSection(actor=actor_cfg, model=ModelConfig(),
                               max_head_offpolicyness=ETA, prompts_per_step=B,
                               total_train_steps=100, temperature=1.0,
                               run_dir=str(tmp_path), seed=0, stop_at_reward=None), actor=actor)
    try:
        state = start(t)
        t.handle(sample("good"), state, src(0))
        out = list(t.handle(_bad("bad", seq_advantage=3.3e38), state, src(1)))
        (dead,) = [e for e in out if isinstance(e, DeadLetter)]
        (w,) = progress_of(out)
        assert dead.event.group_id == "bad" and w.version == 1 and w.group_ids == ["good"]
        assert "bad" in w.rejected_group_ids and state.rejected == {"bad"}
        (m,) = [e for e in out if isinstance(e, MetricsEvent)]
        assert m.metrics["actor/skipped_minibatches"] == 1.0
        assert all(math.isfinite(v) for v in m.metrics.values())
        assert all(torch.isfinite(v).all() for v in params(t).values())
    finally:
        t.sink.close()

