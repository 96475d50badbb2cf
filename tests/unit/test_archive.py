"""The Parquet archive format without a broker: the writer's rolling and commit floor,
atomic files, the readers' order and de-duplication, and plain-tool readability."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tapioca.bus.archive import (
    ARCHIVE_SCHEMA,
    ArchiveError,
    ArchiveWriter,
    archive_files,
    flat_fields,
    iter_events,
    iter_records,
    read_table,
)
from tapioca.bus.role import Source
from tapioca.config.schema import ArchiveConfig
from tapioca.config.sections import ArchiveSection
from tapioca.consumers.archiver import Archiver
from tapioca.schemas import (
    MetricsEvent,
    RewardEvent,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
    WeightsEvent,
)
from tapioca.schemas.envelope import decode_event, encode_event

TRAJ = "p.trajectories.v1"
REW = "p.rewards.v1"


def traj(i: int, versions=(1, 3)) -> TrajectoryEvent:
    return TrajectoryEvent(traj_id=f"g{i}:0", group_id=f"g{i}", prompt_id="p", sample_index=0,
                           group_size=1, prompt_ids=[1], output_ids=[2, 3],
                           output_logprobs=[-0.5, -0.25], output_versions=list(versions),
                           run_id="r1")


def reward(i: int, r: float = 0.5) -> RewardEvent:
    return RewardEvent(traj_id=f"g{i}:0", group_id=f"g{i}", reward=r, scorer="len", run_id="r1")


def src(topic: str, partition: int, offset: int, ts: int = 0) -> Source:
    return Source(topic, partition, offset, key=f"k{offset}", timestamp_ms=ts or 1000 + offset)


def add(w: ArchiveWriter, source: Source, event) -> Path | None:
    return w.add(source, event, encode_event(event))


def test_flat_fields_per_event_type():
    assert flat_fields(traj(0)) == {"group_id": "g0", "traj_id": "g0:0", "scorer": None,
                                    "min_version": 1, "max_version": 3, "reward": None}
    assert flat_fields(reward(0, 0.75))["reward"] == 0.75
    assert flat_fields(reward(0))["scorer"] == "len"
    seqs = [SampleSequence(traj_id=f"t{i}", output_ids=[1], behav_logprobs=[-1.0],
                           output_versions=[2], reward=float(i), advantage=0.0)
            for i in range(2)]
    s = flat_fields(SampleEvent(group_id="g", prompt_id="p", prompt_ids=[1], sequences=seqs,
                                min_version=2, max_version=4))
    # Mean of rewards 0 and 1 is 0.5; versions are the sample's own bounds.
    assert (s["min_version"], s["max_version"], s["reward"]) == (2, 4, 0.5)
    w = flat_fields(WeightsEvent(version=7, path="x", sha256="00"))
    assert (w["min_version"], w["max_version"], w["group_id"]) == (7, 7, None)
    m = flat_fields(MetricsEvent(source="t", step=1, metrics={}, policy_version=3))
    assert m["min_version"] == 3 and m["reward"] is None


def test_roll_by_size_writes_one_file_per_partition_and_commit_floor(tmp_path):
    payload = len(encode_event(traj(0)))
    # Rolls at the third payload of a partition (payload sizes vary by a few bytes).
    w = ArchiveWriter(tmp_path, roll_bytes=int(2.5 * payload), roll_interval_s=3600)
    assert add(w, src(TRAJ, 0, 10), traj(0)) is None
    assert add(w, src(TRAJ, 1, 5), traj(1)) is None
    assert add(w, src(TRAJ, 0, 11), traj(2)) is None
    # Nothing durable yet: partition 0 may be committed only up to offset 10.
    assert w.safe_offset(TRAJ, 0, 12) == 10
    assert w.safe_offset(TRAJ, 1, 6) == 5
    assert w.safe_offset(REW, 0, 3) == 3  # nothing buffered: everything handled is safe
    path = add(w, src(TRAJ, 0, 12), traj(3))
    assert path is not None and path.name == f"part-00000-{10:020d}-{12:020d}.parquet"
    assert path.parent.name == TRAJ
    assert w.safe_offset(TRAJ, 0, 13) == 13
    assert w.safe_offset(TRAJ, 1, 6) == 5
    assert (w.files_written, w.rows_written, w.buffered_rows) == (1, 3, 1)
    # No temporary file is left behind, and the file reads back with the schema.
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    table = pq.read_table(path)
    assert table.schema.equals(ARCHIVE_SCHEMA, check_metadata=False)
    assert table.column("offset").to_pylist() == [10, 11, 12]
    assert table.column("key").to_pylist() == ["k10", "k11", "k12"]


def test_roll_by_time_and_discard_on_revoke(tmp_path):
    w = ArchiveWriter(tmp_path, roll_bytes=1 << 30, roll_interval_s=5.0)
    add(w, src(TRAJ, 0, 0), traj(0))
    add(w, src(REW, 2, 0), reward(0))
    # Each buffer rolls roll_interval_s after its own first record.
    opened = max(b.opened for b in w._buffers.values())
    assert w.flush_due(min(b.opened for b in w._buffers.values()) + 4.9) == []
    written = w.flush_due(opened + 5.0)
    assert sorted(p.parent.name for p in written) == [REW, TRAJ]
    add(w, src(TRAJ, 3, 7), traj(1))
    assert w.discard([(TRAJ, 3), (REW, 1)]) == 1
    assert w.safe_offset(TRAJ, 3, 8) == 8 and w.buffered_rows == 0


def test_readers_order_dedupe_and_decode(tmp_path):
    w = ArchiveWriter(tmp_path, roll_bytes=1 << 30, roll_interval_s=3600)
    for off in range(3):
        add(w, src(TRAJ, 1, off, ts=5000 + off), traj(off))
    w.flush_all()
    # A crash before the commit: offsets 1..3 written again into an overlapping file.
    for off in range(1, 4):
        add(w, src(TRAJ, 1, off, ts=5000 + off), traj(off))
    add(w, src(TRAJ, 0, 0, ts=9000), traj(9))
    for off in range(2):
        add(w, src(REW, 1, off, ts=5000 + 2 * off + 1), reward(off))
    w.flush_all()
    assert len(archive_files(tmp_path)) == 4

    got = list(iter_events(tmp_path))
    coords = [(s.topic, s.partition, s.offset) for s, _ in got]
    # (topic, partition, offset) order, each offset once although written twice.
    assert coords == [(REW, 1, 0), (REW, 1, 1), (TRAJ, 0, 0),
                      (TRAJ, 1, 0), (TRAJ, 1, 1), (TRAJ, 1, 2), (TRAJ, 1, 3)]
    source, event = got[3]
    assert isinstance(event, TrajectoryEvent) and event.traj_id == "g0:0"
    assert event.output_logprobs == [-0.5, -0.25] and source.key == "k0"
    assert source.timestamp_ms == 5000

    only = [e.traj_id for _, e in iter_events(tmp_path, topic="rewards")]
    assert only == ["g0:0", "g1:0"]
    assert len(list(iter_events(tmp_path, topic=TRAJ))) == 5
    # Time order interleaves the topics by record timestamp: trajectories at 5000..5003
    # (partition 1) and 9000 (partition 0), rewards at 5001 and 5003; ties by topic name.
    by_time = [(r.topic, r.offset) for r in iter_records(tmp_path, order="time")]
    assert by_time == [(TRAJ, 0), (REW, 0), (TRAJ, 1), (TRAJ, 2), (REW, 1), (TRAJ, 3),
                       (TRAJ, 0)]
    # One file on its own reads too.
    one = sorted(archive_files(tmp_path))[0]
    assert [r.offset for r in iter_records(one)] == [0, 1]
    assert read_table(tmp_path).num_rows == 7


def test_plain_pandas_reads_the_directory(tmp_path):
    pd = pytest.importorskip("pandas")
    w = ArchiveWriter(tmp_path, roll_bytes=1 << 30, roll_interval_s=3600)
    for off in range(4):
        add(w, src(TRAJ, off % 2, off), traj(off))
    add(w, src(REW, 0, 0), reward(0, 0.25))
    w.flush_all()
    # A temporary file being written must not break readers.
    (tmp_path / TRAJ / ".part-00000-x.parquet.1.tmp").write_bytes(b"partial")
    df = pd.read_parquet(tmp_path)
    assert len(df) == 5
    assert set(df["type"]) == {"trajectory", "reward"}
    assert df.loc[df["type"] == "reward", "reward"].tolist() == [0.25]
    first = df[df["type"] == "trajectory"].sort_values("offset").iloc[0]
    assert orjson.loads(first["payload"])["output_versions"] == [1, 3]


def test_missing_archive_is_a_clear_error(tmp_path):
    with pytest.raises(ArchiveError, match="does not exist"):
        list(iter_events(tmp_path / "nope"))
    bad = tmp_path / "x.parquet"
    pq.write_table(pa.table({"a": [1]}), bad)
    with pytest.raises(ArchiveError, match="not a Tapioca archive"):
        list(iter_records(bad))


def test_archiver_role_commits_only_durable_offsets(tmp_path):
    role = Archiver(ArchiveSection(archive=ArchiveConfig(roll_bytes=1 << 30, roll_interval_s=3600),
                                   dir=str(tmp_path)))
    state = role.init_state()
    raws = [encode_event(traj(off)) for off in range(3)]
    for off, raw in enumerate(raws):
        # As the runner hands it over: decoded from the record's bytes.
        assert list(role.handle(decode_event(raw), state, src(TRAJ, 0, off))) == []
    assert role.committable(state, TRAJ, 0, 3) == 0
    role.on_stop(state)
    assert role.committable(state, TRAJ, 0, 3) == 3
    assert [e.traj_id for _, e in iter_events(tmp_path)] == ["g0:0", "g1:0", "g2:0"]
    # Decoding and encoding again gives back the producer's bytes exactly.
    assert [r.payload.encode() for r in iter_records(tmp_path)] == raws
    assert role.describe(state)["files"] == 1


# ------------------------------------------------------------------ replay filters


def _replay_items():
    """Two groups of two trajectories on partitions 0 and 1, each with its rewards and
    sample: g-new (versions 5..6, rewards 0.9 / 0.2) and g-mixed (trajectory 0 at
    version 2, trajectory 1 at version 6; rewards 0.8 / 0.7)."""
    from tapioca.bus.replay import ReplayItem

    spec = {"g-new": (0, [[5, 6], [6, 6]], [0.9, 0.2]),
            "g-mixed": (1, [[2, 2], [6, 6]], [0.8, 0.7])}
    items, offsets = [], {}

    def add(topic: str, partition: int, event) -> None:
        off = offsets.get((topic, partition), 0)
        offsets[(topic, partition)] = off + 1
        src = Source(topic=topic, partition=partition, offset=off, key=event.group_id,
                     timestamp_ms=1000 + len(items))
        items.append(ReplayItem(src, encode_event(event), event))

    for gid, (part, versions, rewards) in spec.items():
        seqs = []
        for i, (v, r) in enumerate(zip(versions, rewards)):
            add(TRAJ, part, TrajectoryEvent(
                traj_id=f"{gid}:{i}", group_id=gid, prompt_id="p", sample_index=i,
                group_size=2, prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-1.0, -1.0],
                output_versions=v))
            add(REW, part, RewardEvent(traj_id=f"{gid}:{i}", group_id=gid, reward=r))
            seqs.append(SampleSequence(traj_id=f"{gid}:{i}", output_ids=[2, 3],
                                       behav_logprobs=[-1.0, -1.0], output_versions=v,
                                       reward=r, advantage=0.0))
        add("p.samples.v1", part, SampleEvent(
            group_id=gid, prompt_id="p", prompt_ids=[1], sequences=seqs,
            min_version=min(min(v) for v in versions), max_version=max(max(v) for v in versions)))
    return items


def _replayed(**flt) -> list[tuple[str, str]]:
    """(type, traj_id or group_id) of what a dry run would publish."""
    from tapioca.bus.replay import Replayer, ReplayFilter, ReplayStats
    from tapioca.bus.settings import BusConfig

    items = _replay_items()
    published = []

    class Recording(Replayer):
        def destination(self, item):
            published.append((item.event.type, getattr(item.event, "traj_id", None)
                              or item.event.group_id))
            return super().destination(item)

    f = ReplayFilter(**flt)
    Recording(None, BusConfig(topic_prefix="p")).run(lambda: iter(items), f, ReplayStats(),
                                                     dry_run=True)
    return published


def test_version_filter_keeps_or_drops_whole_groups_by_default():
    # g-mixed has one trajectory below version 5: all of its events go, rewards included.
    got = _replayed(min_version=5)
    assert got == [("trajectory", "g-new:0"), ("reward", "g-new:0"),
                   ("trajectory", "g-new:1"), ("reward", "g-new:1"), ("sample", "g-new")]
    # Per event: the trajectory at version 6 of g-mixed and every reward slip through.
    per_event = _replayed(min_version=5, per_event=True)
    assert ("trajectory", "g-mixed:1") in per_event and ("reward", "g-mixed:0") in per_event
    assert ("trajectory", "g-mixed:0") not in per_event and ("sample", "g-mixed") not in per_event


def test_reward_filter_keeps_or_drops_whole_groups_by_default():
    from tapioca.bus.replay import ReplayFilter, ReplayStats

    # g-new has a 0.2 reward: dropped whole; g-mixed (0.8, 0.7) kept whole.
    got = _replayed(min_reward=0.5, types=frozenset({"reward", "sample"}))
    assert got == [("reward", "g-mixed:0"), ("reward", "g-mixed:1"), ("sample", "g-mixed")]
    # Per event: the 0.9 reward of g-new passes alone, and its sample by its mean 0.55.
    per_event = _replayed(min_reward=0.5, types=frozenset({"reward", "sample"}),
                          per_event=True)
    assert ("reward", "g-new:0") in per_event and ("sample", "g-new") in per_event
    assert ("reward", "g-new:1") not in per_event
    # The verdicts are counted.
    from tapioca.bus.replay import Replayer
    from tapioca.bus.settings import BusConfig

    stats = Replayer(None, BusConfig(topic_prefix="p")).run(
        lambda: iter(_replay_items()), ReplayFilter(max_reward=0.85), ReplayStats(), dry_run=True)
    assert (stats.groups_kept, stats.groups_dropped, stats.published) == (1, 1, 5)


def test_partition_and_offset_bounds():
    # g-mixed is on partition 1: its first trajectory, reward... offsets 0..1 per topic.
    got = _replayed(partition=1, from_offset=1, to_offset=1)
    assert got == [("trajectory", "g-mixed:1"), ("reward", "g-mixed:1")]
    # Without --partition the offset bounds apply in every partition.
    got = _replayed(from_offset=1, to_offset=1)
    assert got == [("trajectory", "g-new:1"), ("reward", "g-new:1"),
                   ("trajectory", "g-mixed:1"), ("reward", "g-mixed:1")]


def test_a_group_without_a_shared_prompt_archives_replays_and_trains_offline(tmp_path):
    """Issue 22: an agent group published with ``prompt_ids=[]`` (its completions share no
    prompt token; each context is in the output with loss mask 0) is archived and read
    back as it was, replayed whole, and SFT from the archive takes its first output
    token as the prompt (it was skipped as ``skipped_empty_prompt`` before)."""
    from tapioca.bus.replay import Replayer, ReplayFilter, ReplayStats, items_from_archive
    from tapioca.bus.settings import BusConfig
    from tapioca.config.supervised import SupervisedDatasetConfig
    from tapioca.trainers.supervised.data import load_sft_examples

    t = TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0,
                        group_size=1, prompt_ids=[], output_ids=[7, 8, 12, 13],
                        output_logprobs=[0.0, 0.0, -0.5, -0.5], output_versions=[0] * 4,
                        loss_mask=[0, 0, 1, 1], turn_boundaries=[2], run_id="r1")
    r = RewardEvent(traj_id="g:0", group_id="g", reward=1.0, scorer="session", run_id="r1")
    s = SampleEvent(group_id="g", prompt_id="p", prompt_ids=[], run_id="r1", sequences=[
        SampleSequence(traj_id="g:0", output_ids=t.output_ids, behav_logprobs=t.output_logprobs,
                       output_versions=t.output_versions, reward=1.0, advantage=1.0,
                       loss_mask=t.loss_mask, turn_boundaries=[2])])
    w = ArchiveWriter(tmp_path, roll_bytes=1 << 30, roll_interval_s=3600)
    for i, (topic, event) in enumerate(((TRAJ, t), (REW, r), ("p.samples.v1", s))):
        add(w, src(topic, 0, i), event)
    w.flush_all()
    got = {e.type: e for _, e in iter_events(tmp_path)}
    assert got["trajectory"] == t and got["sample"] == s and got["sample"].prompt_ids == []
    items = list(items_from_archive(str(tmp_path), None))
    stats = ReplayStats()
    Replayer(None, BusConfig(topic_prefix="p")).run(lambda: iter(items), ReplayFilter(), stats,
                                                    dry_run=True)
    assert stats.published == 3
    examples, data = load_sft_examples(
        SupervisedDatasetConfig(source="archive", path=str(tmp_path), min_reward=1.0), None)
    (ex,) = examples
    assert (ex.prompt_ids, ex.response_ids, ex.response_mask) == ([7], [8, 12, 13], [0, 1, 1])
    assert "skipped_empty_prompt" not in data.counts
