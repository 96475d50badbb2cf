"""Supervised trainers on the real embedded broker: SFT (rejection sampling) and DPO from a
run's logged trajectories and rewards, read from the topics and from a Parquet archive
of them; every step's MetricsEvent and every saved version's WeightsEvent published."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tapioca.bus.producer import EventProducer
from tapioca.bus.reader import TopicReader, read_events
from tapioca.config.loader import load_config
from tapioca.config.supervised import DPOConfig, SFTConfig, SupervisedDatasetConfig
from tapioca.models.factory import load_model_and_tokenizer
from tapioca.runtime.run import create_tiny_checkpoint, resolve_run
from tapioca.schemas.events import MetricsEvent, RewardEvent, TrajectoryEvent, WeightsEvent
from tapioca.trainers.supervised.data import load_pair_examples, load_sft_examples
from tapioca.weights.files import sha256_file

pytestmark = pytest.mark.integration

RUN = "logged.run0"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("supervised-int") / "model")


def _log_a_run(bus_cfg, tokenizer) -> int:
    """What a GRPO run leaves on the log: per prompt, 4 sampled answers with rewards (1 for
    the right one). Plus one group of another run, which must be ignored. Returns the
    number of right answers of RUN."""
    rng = random.Random(0)
    right = 0
    with EventProducer(bus_cfg, "test-rollout") as producer:
        for a in range(6):
            for b in range(4):
                prompt_ids = tokenizer(f"<bos>max({a},{b})=", add_special_tokens=False)["input_ids"]
                gid = f"g{a}{b}"
                for k in range(4):
                    answer = str(max(a, b)) if k == 0 or rng.random() < 0.2 else str(rng.randrange(10))
                    out = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                    reward = float(answer == str(max(a, b)))
                    right += int(reward == 1.0)
                    tid = f"{gid}-{k}"
                    producer.publish(TrajectoryEvent(
                        traj_id=tid, group_id=gid, prompt_id=gid, sample_index=k, group_size=4,
                        prompt_ids=prompt_ids, output_ids=out, output_logprobs=[-1.0] * len(out),
                        output_versions=[0] * len(out), run_id=RUN))
                    producer.publish(RewardEvent(traj_id=tid, group_id=gid, reward=reward, run_id=RUN))
        producer.publish(TrajectoryEvent(traj_id="other", group_id="gz", prompt_id="gz", sample_index=0,
                                         group_size=1, prompt_ids=[1, 5], output_ids=[6, 2],
                                         output_logprobs=[-1.0, -1.0], output_versions=[0, 0],
                                         run_id="another.run"))
        producer.publish(RewardEvent(traj_id="other", group_id="gz", reward=1.0, run_id="another.run"))
    return right


def _cfg(cls, tiny, tmp_path, bus_cfg, *overrides):
    """A resolved supervised run (as `tapioca sft|dpo` resolve it before training)."""
    return resolve_run(load_config(cls, None, [
        f"model.path={tiny}", f"run_dir={tmp_path}", "trial_name=t", "actor.torch_threads=1",
        f"bus.bootstrap_servers={bus_cfg.bootstrap_servers}", f"bus.topic_prefix={bus_cfg.topic_prefix}",
        "train_dataset.source=topics", f"train_dataset.run_id={RUN}", "train_dataset.read_idle_s=0.5",
        *overrides]), prepare=True)


def test_sft_and_dpo_from_a_runs_topics_publish_weights_and_metrics(bus_cfg, tiny, tmp_path):
    from tapioca.trainers.supervised.dpo import train_dpo
    from tapioca.trainers.supervised.sft import train_sft

    tokenizer = load_model_and_tokenizer(tiny)[1]
    right = _log_a_run(bus_cfg, tokenizer)

    sft = train_sft(_cfg(SFTConfig, tiny, tmp_path, bus_cfg, "total_train_steps=30", "save_every_steps=10",
                         "actor.optimizer.lr=2e-3", "train_dataset.batch_size=8", "train_dataset.min_reward=1.0"))
    # Rejection sampling: exactly the right answers of this run became examples.
    assert sft.data["data/examples"] == right and sft.data["data/skipped_below_min_reward"] == 96 - right
    losses = [h["sft/loss"] for h in sft.history]
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]

    dpo = train_dpo(_cfg(DPOConfig, tiny, tmp_path, bus_cfg, "total_train_steps=20", "save_every_steps=20",
                         "actor.optimizer.lr=1e-3", "train_dataset.batch_size=8"))
    assert dpo.data["data/examples"] >= 20  # groups with one right and some wrong answers
    assert dpo.history[-1]["dpo/margin"] > dpo.history[0]["dpo/margin"]

    weights = [e for e in read_events(bus_cfg, "weights") if isinstance(e, WeightsEvent)]
    by_run = {(e.run_id, e.version): e for e in weights}
    assert sorted(v for r, v in by_run if r == "sft.t") == [10, 20, 30]
    assert sorted(v for r, v in by_run if r == "dpo.t") == [20]
    latest = by_run[("sft.t", 30)]
    assert sha256_file(latest.path) == latest.sha256 and Path(latest.path).stat().st_size == latest.num_bytes
    metrics = [e for e in read_events(bus_cfg, "metrics") if isinstance(e, MetricsEvent)]
    assert [m.step for m in metrics if m.run_id == "sft.t"] == list(range(1, 31))
    assert {m.source for m in metrics if m.run_id == "dpo.t"} == {"dpo"}
    assert metrics[0].metrics["sft/loss"] == pytest.approx(losses[0])


def test_archive_of_the_topics_gives_the_same_examples(bus_cfg, tiny, tmp_path):
    from tapioca.bus.archive import ArchiveWriter

    tokenizer = load_model_and_tokenizer(tiny)[1]
    _log_a_run(bus_cfg, tokenizer)
    # Archive the two topics the way the archiver does: every record with its coordinates.
    writer = ArchiveWriter(tmp_path / "archive")
    for name in ("trajectories", "rewards"):
        with TopicReader(bus_cfg, name) as reader:
            for rec in reader.records(idle_s=0.5):
                writer.add(rec.source, rec.event, rec.raw)
    writer.flush_all()

    def examples(source: str):
        ds = SupervisedDatasetConfig(source=source, path=str(tmp_path / "archive"), run_id=RUN,
                                  read_idle_s=0.5, topic_prefix=bus_cfg.topic_prefix)
        sft, _ = load_sft_examples(ds, tokenizer, bus=bus_cfg)
        pairs, _ = load_pair_examples(ds, tokenizer, bus=bus_cfg)
        return ([(e.prompt_ids, e.response_ids) for e in sft],
                [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs])

    from_topics, from_archive = examples("topics"), examples("archive")
    assert from_archive == from_topics and len(from_archive[0]) > 0 and len(from_archive[1]) > 0
