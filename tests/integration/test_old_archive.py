"""An archive written before progress.v1 replays and trains after it.

The fixture (tests/fixtures/archive_before_progress_v1/, made by
tests/fixtures/make_archive_before_progress_v1.py with the tree at 9fb2035) is a real
run's Parquet archive: its weights events carry the trainer's verdicts of that time
(``group_ids``, ``groups_rejected``, ``rejected_group_ids``, ...), including
re-announcements of a version sent only to name rejections, and its prompt events
``weights_offset``. Beside it, the run's config as that launcher wrote it, in the old key
names (``actor.lr``, ``actor.adam_betas``, ``actor.weight_transport``, ...).

Against the real embedded broker: every record decodes; ``tapioca replay`` republishes
all of them to a new prefix, where they read back as they were; the rollout workers'
follow rule takes the old weights events (the re-announcements are repeats, not
conflicts); and ``tapioca train-offline`` trains from the archive with the old config,
from its samples and from its trajectories + rewards, publishing bytes on weights.v1
and the verdicts on progress.v1."""

from __future__ import annotations

import logging
import math
import uuid
from collections import Counter
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from tapioca.bus import BusConfig, read_events
from tapioca.bus.archive import count_records, iter_events
from tapioca.ops.cli import app
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import ProgressEvent, PromptEvent, SampleEvent, WeightsEvent
from tapioca.weights.follow import WeightsFollow

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ARCHIVE = FIXTURES / "archive_before_progress_v1"
CONFIG = FIXTURES / "archive_before_progress_v1.yaml"


def _json(result) -> dict:
    assert result.exit_code == 0, (result.output, result.exception)
    return orjson.loads(result.stdout.strip().splitlines()[-1])


def _cli(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=True)


def test_the_fixture_is_in_the_old_shape():
    weights = [e for _, e in iter_events(ARCHIVE, topic="weights")]
    # Verdicts on the weights events, and a version announced again to name rejections.
    assert [e.version for e in weights] == [0, 1, 1, 2, 2]
    assert all(e.group_ids for e in weights if e.version) and weights[2].rejected_group_ids
    assert weights[2].sha256 == weights[1].sha256 and weights[2].groups_rejected > weights[1].groups_rejected
    prompts = [e for _, e in iter_events(ARCHIVE, topic="prompts")]
    assert any(p.weights_offset >= 0 for p in prompts)
    assert all(p.progress_offset == -1 for p in prompts)  # the field did not exist
    assert not list(iter_events(ARCHIVE, topic="progress"))
    assert "weight_transport" in CONFIG.read_text() and "\n  optimizer:" not in CONFIG.read_text()


def test_the_old_weights_events_follow_as_repeats_not_conflicts():
    """The rollout workers' rule (weights/follow.py) over the old weights topic: each
    version loads once; its re-announcements agree with its bytes."""
    follow = WeightsFollow("a rollout worker")
    loaded = []
    for source, event in iter_events(ARCHIVE, topic="weights"):
        assert follow.offer(event, source) == []
        if follow.head is not None:
            assert follow.load_head(lambda e: loaded.append(e.version)) == []
    assert loaded == [1, 2] and follow.loaded_version == 2 and follow.dead_lettered == 0


def test_replay_republishes_every_old_record_as_it_was(broker):
    prefix = f"re{uuid.uuid4().hex[:10]}"
    stats = _json(_cli("-b", broker.bootstrap, "--prefix", "oldrun", "replay", str(ARCHIVE),
                       "--to-prefix", prefix, "-o", "json"))
    assert stats["published"] == count_records(ARCHIVE)
    dest = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=prefix)
    archived = Counter(e.type for _, e in iter_events(ARCHIVE))
    for name in ("prompts", "trajectories", "rewards", "samples", "weights", "metrics"):
        events = read_events(dest, name, idle_s=0.3)
        assert len(events) == archived[events[0].type], name
    by_id = {e.event_id: e for _, e in iter_events(ARCHIVE, topic=["weights", "prompts"])}
    for e in read_events(dest, "weights", idle_s=0.3) + read_events(dest, "prompts", idle_s=0.3):
        assert e == by_id[e.event_id]  # the deprecated fields too
    assert read_events(dest, "progress", idle_s=0.3) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("oldarchive") / "model")


def test_train_offline_from_the_old_archive_with_the_old_config(broker, tiny, tmp_path, caplog,
                                                                one_torch_thread):
    prefix = f"off{uuid.uuid4().hex[:10]}"
    with caplog.at_level(logging.WARNING, logger="tapioca.config.loader"):
        result = _json(_cli("-b", broker.bootstrap, "--prefix", prefix, "train-offline",
                            "--config", str(CONFIG), "--from-archive", str(ARCHIVE),
                            "--max-steps", "2", "-o", "json", f"model.path={tiny}",
                            f"run_dir={tmp_path / 'runs'}", "actor.torch_threads=1"))
    # The old names were read, each with its warning naming the new key.
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"deprecated config keys in {CONFIG} " in warned and "actor.lr: use actor.optimizer.lr" in warned
    assert "use weights.transport" in warned
    assert result["steps"] == 2 and result["final_version"] == 2
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    dest = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=prefix)
    weights = [e for e in read_events(dest, "weights") if isinstance(e, WeightsEvent)]
    assert [w.version for w in weights] == [0, 1, 2]
    assert all(not w.group_ids and not w.rejected_group_ids for w in weights)  # bytes only
    progress = [e for e in read_events(dest, "progress") if isinstance(e, ProgressEvent)]
    # Every progress event of a version names the groups that made it.
    by_version = {p.version: p.group_ids for p in progress}
    trained = [g for v in sorted(by_version) for g in by_version[v]]
    samples = {e.group_id: e for _, e in iter_events(ARCHIVE, topic="samples")}
    assert sorted(by_version) == [0, 1, 2] and by_version[0] == []
    assert len(trained) == len(set(trained)) == 8
    assert all(g in samples and not samples[g].dropped_reason for g in trained)
    # The filtered groups the trainer read are named as rejected.
    rejected = {g for p in progress for g in p.rejected_group_ids}
    assert rejected and all(samples[g].dropped_reason for g in rejected)
    assert not rejected & set(trained)

    # From the trajectories and rewards, through this config's advantage processor.
    again = _json(_cli("-b", broker.bootstrap, "--prefix", prefix, "train-offline",
                       "--config", str(CONFIG), "--from-archive", str(ARCHIVE),
                       "--source", "trajectories", "--trial", "again", "--max-steps", "1",
                       "-o", "json", f"model.path={tiny}", f"run_dir={tmp_path / 'runs'}",
                       "actor.torch_threads=1"))
    assert again["steps"] == 1 and math.isfinite(again["losses"][0])


def test_a_new_feeder_counts_nothing_of_the_old_prompt_events_as_progress():
    """A feeder restarted on the old log recovers its groups and freed count from the
    old prompt events; their weights_offset counted weights.v1, so no progress.v1
    offset is taken as counted."""
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.config.sections import feeder_section
    from tapioca.producers.feeder import PromptFeeder, PromptRecord

    cfg = load_config(TrainConfig, CONFIG)
    prompts = [e for _, e in iter_events(ARCHIVE, topic="prompts") if isinstance(e, PromptEvent)]
    feeder = PromptFeeder(feeder_section(cfg), records=[PromptRecord(f"p{i}", [1, 2], "q", "t")
                                                        for i in range(100)])
    state = feeder.init_state()
    feeder.recover(state, prompts)
    last = max(prompts, key=lambda e: e.group_index)
    assert (state.next_group_index, state.freed) == (last.group_index + 1, last.freed_groups)
    assert state.counted_through == -1
    assert all(isinstance(e, SampleEvent) for _, e in iter_events(ARCHIVE, topic="samples"))
