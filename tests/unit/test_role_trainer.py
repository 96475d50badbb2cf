"""Trainer as a plain function of events, on a real tiny model: steps of B groups,
weights files + WeightsEvent, de-duplication, the tail gate, the commit floor, and
restart from the checkpoint. No broker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tapioca.bus.role import Source
from tapioca.config.schema import ActorConfig, ModelConfig
from tapioca.config.sections import TrainerSection
from tapioca.models.factory import build_tiny_model
from tapioca.models.weight_files import sha256_file
from tapioca.schemas.events import MetricsEvent, SampleEvent, SampleSequence, WeightsEvent
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.trainer import Trainer

VOCAB = 16
TOPIC = "t.samples.v1"
B = 2
ETA = 1


def make_trainer(run_dir: Path, seed: int = 0) -> Trainer:
    model = build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=seed)
    actor_cfg = ActorConfig(lr=1e-2)
    actor = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    section = TrainerSection(actor=actor_cfg, model=ModelConfig(), max_head_offpolicyness=ETA,
                             prompts_per_step=B, total_train_steps=100, temperature=1.0,
                             run_dir=str(run_dir), seed=0)
    return Trainer(actor, section)


def sample(gid: str, min_version: int = 0, n: int = 2) -> SampleEvent:
    seqs = []
    for i in range(n):
        out = [(3 + 5 * i + j) % VOCAB for j in range(3)]
        seqs.append(SampleSequence(traj_id=f"{gid}:{i}", output_ids=out,
                                   behav_logprobs=[-2.7] * 3,
                                   output_versions=[min_version + (j > 0) for j in range(3)],
                                   reward=float(i == 0), advantage=1.0 if i == 0 else -1.0))
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[1, 2, 4],
                       sequences=seqs, min_version=min_version, max_version=min_version + 1)


def src(offset: int, partition: int = 0) -> Source:
    return Source(topic=TOPIC, partition=partition, offset=offset)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.actor.model.state_dict().items()}


@pytest.fixture
def trainer(tmp_path):
    t = make_trainer(tmp_path)
    yield t
    t.sink.close()


def start(t: Trainer):
    state = t.init_state()
    (hello,) = t.on_tick(state, 0.0)  # the version-0 announcement at start
    assert isinstance(hello, WeightsEvent) and hello.version == 0 and hello.group_ids == []
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
    weights = [e for e in out if isinstance(e, WeightsEvent)]
    metrics = [e for e in out if isinstance(e, MetricsEvent)]
    assert len(weights) == 1 and len(metrics) == 1
    w = weights[0]
    assert w.version == 1 and state.progress.version == 1
    assert w.group_ids == ["g0", "g1"]
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
    (w,) = [e for e in out if isinstance(e, WeightsEvent)]
    assert w.version == 2 and w.group_ids == ["g2", "g3"]
    (m,) = [e for e in out if isinstance(e, MetricsEvent)]
    assert m.metrics["trainer/duplicates"] == 2.0


def test_tail_gate_rejects_over_stale_group(trainer):
    state = start(trainer)
    trained: list[str] = []
    for k in range(4):  # two steps: version 2
        for e in trainer.handle(sample(f"g{k}", min_version=k // 2), state, src(k)):
            if isinstance(e, WeightsEvent):
                trained += e.group_ids
    assert state.progress.version == 2
    # staleness 2 - 0 = 2 > eta = 1: rejected; staleness 2 - 1 = 1: accepted.
    assert list(trainer.handle(sample("stale", min_version=0), state, src(4))) == []
    assert state.rejected_stale == 1 and "stale" in state.rejected
    assert list(trainer.handle(sample("ok", min_version=1), state, src(5))) == []
    assert [s.group_id for s, _ in state.buffer] == ["ok"]
    (announce,) = trainer.on_tick(state, 0.0)
    assert isinstance(announce, WeightsEvent)
    # A re-announcement repeats the groups of the step that made the version (so the
    # latest event per version always lists them), never the rejected group.
    assert announce.version == 2 and announce.groups_rejected == 1
    assert announce.group_ids == ["g2", "g3"]
    assert announce.rejected_group_ids == ["stale"]  # the rejection is named on the log
    assert announce.path == state.progress.weights_path and Path(announce.path).exists()
    assert list(trainer.on_tick(state, 0.0)) == []
    # A redelivered rejected group is a duplicate, not a second rejection.
    trainer.handle(sample("stale", min_version=0), state, src(6))
    assert state.rejected_stale == 1 and state.duplicates == 1
    out = list(trainer.handle(sample("g9", min_version=2), state, src(7)))
    (w,) = [e for e in out if isinstance(e, WeightsEvent)]
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


def test_checkpoint_offsets_never_pass_a_buffered_group(tmp_path):
    # Checkpoint while a group is buffered (done trainer keeps buffering; forced save).
    t = make_trainer(tmp_path)
    state = start(t)
    t.handle(sample("g0"), state, src(0))
    t.handle(sample("g1"), state, src(1))
    t.handle(sample("g2"), state, src(2))  # buffered
    t.handle(sample("g1"), state, src(3))  # duplicate, handled past the buffered group
    t._checkpoint(state)
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
    assert t2.committable(s2, TOPIC, 0, 0) == 4
    # Re-fed trained groups are duplicates.
    for k in range(4):
        assert list(t2.handle(sample(f"g{k}"), s2, src(k))) == []
    assert s2.duplicates == 4 and s2.buffer == []
    # It announces its current version (not a new one) at start.
    (hello,) = t2.on_tick(s2, 0.0)
    assert hello.version == 2 and sha256_file(hello.path) == hello.sha256
    # And continues with version 3.
    t2.handle(sample("g4", min_version=2), s2, src(4))
    out = list(t2.handle(sample("g5", min_version=2), s2, src(5)))
    (w,) = [e for e in out if isinstance(e, WeightsEvent)]
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
    assert isinstance(announce, WeightsEvent) and announce.groups_rejected == 1
