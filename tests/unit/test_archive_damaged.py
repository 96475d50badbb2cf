"""Damaged archive files whose Parquet structure is valid (bus/archive.py): an ``offset``
column stored as strings, or holding a null, is refused with one line naming the file and
the column, by the readers and by `tapioca replay` / `tapioca train-offline` run as a user
types them (a subprocess: one line on stderr, exit 1); ``--skip-damaged`` skips and
counts such files (and records whose payload does not decode, and, offline, samples the
trainer refuses) and reads everything else; narrower integer widths are cast, not refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tapioca.bus.archive import (
    ARCHIVE_SCHEMA,
    ArchiveError,
    Damaged,
    archive_row,
    count_records,
    iter_events,
    iter_records,
    write_file,
)
from tapioca.bus.role import Source
from tapioca.schemas import PromptEvent, SampleEvent, SampleSequence
from tapioca.schemas.envelope import encode_event

TAPIOCA = str(Path(sys.executable).with_name("tapioca"))


def prompt(i: int) -> PromptEvent:
    return PromptEvent(group_id=f"g{i}", prompt_id=f"p{i}", group_index=i, n_samples=1, prompt_ids=[1, 2],
                       run_id="r1")


def sample(i: int) -> SampleEvent:
    return SampleEvent(group_id=f"g{i}", prompt_id="p", prompt_ids=[1], run_id="r1", sequences=[
        SampleSequence(traj_id=f"g{i}:0", output_ids=[2], behav_logprobs=[-0.5], output_versions=[0],
                       reward=1.0, advantage=0.5)])


def rows(topic: str, events, first: int = 0) -> list[dict]:
    return [archive_row(Source(topic, 0, first + k, key=f"k{k}", timestamp_ms=1000 + first + k), e,
                        encode_event(e)) for k, e in enumerate(events)]


def damaged(directory: Path, topic: str, events, first: int, *, offset=None, nulls: bool = False) -> Path:
    """A file of ``events`` whose ``offset`` column is strings (or has a null)."""
    table = pa.Table.from_pylist(rows(topic, events, first), schema=ARCHIVE_SCHEMA)
    i = ARCHIVE_SCHEMA.get_field_index("offset")
    if nulls:
        col = pa.array([None] + table.column("offset").to_pylist()[1:], pa.int64())
        field = pa.field("offset", pa.int64(), nullable=True)
    else:
        col = pa.array([str(v) for v in table.column("offset").to_pylist()], pa.string())
        field = pa.field("offset", pa.string())
    table = table.set_column(i, field, col)
    (directory / topic).mkdir(parents=True, exist_ok=True)
    path = directory / topic / f"part-00000-{first:020d}-{first + len(events) - 1:020d}.parquet"
    pq.write_table(table, path)
    return path


@pytest.fixture
def archive(tmp_path) -> tuple[Path, Path]:
    """2 good prompts in one file, 2 more in a file whose offsets are strings."""
    root = tmp_path / "archive"
    write_file(root / "p.prompts.v1", rows("p.prompts.v1", [prompt(0), prompt(1)]))
    bad = damaged(root, "p.prompts.v1", [prompt(2), prompt(3)], 2)
    return root, bad


def test_readers_name_the_file_and_the_column(archive, tmp_path):
    root, bad = archive
    with pytest.raises(ArchiveError, match=rf"{bad}: column 'offset' holds string, not int64"):
        count_records(root)  # from the footer, before a row is read
    with pytest.raises(ArchiveError, match=rf"{bad}: column 'offset' holds string, not int64.*--skip-damaged"):
        list(iter_records(root))
    nulls = damaged(tmp_path / "nulls", "p.prompts.v1", [prompt(0), prompt(1)], 0, nulls=True)
    with pytest.raises(ArchiveError, match=rf"{nulls}: column 'offset' has 1 null value"):
        count_records(nulls)
    pq.write_table(pq.read_table(nulls), nulls, write_statistics=False)  # no footer statistics
    count_records(nulls)  # (nothing in the footer to tell)
    with pytest.raises(ArchiveError, match=rf"{nulls}: column 'offset' has 1 null value"):
        list(iter_records(nulls))  # found in the data


def test_skip_damaged_counts_files_and_undecodable_records_and_reads_the_rest(archive):
    root, bad = archive
    # A third file: narrower integers (cast) and one payload that does not decode.
    table = pa.Table.from_pylist(rows("p.prompts.v1", [prompt(4), prompt(5)], 4), schema=ARCHIVE_SCHEMA)
    table = table.set_column(ARCHIVE_SCHEMA.get_field_index("offset"), pa.field("offset", pa.int32()),
                             pa.array([4, 5], pa.int32()))
    payload = table.column("payload").to_pylist()
    payload[1] = "{not json"
    table = table.set_column(ARCHIVE_SCHEMA.get_field_index("payload"), ARCHIVE_SCHEMA.field("payload"),
                             pa.array(payload, pa.string()))
    pq.write_table(table, root / "p.prompts.v1" / f"part-00000-{4:020d}-{5:020d}.parquet")
    skipped = Damaged()
    assert count_records(root, damaged=skipped) == 4
    got = [e.group_id for _, e in iter_events(root, damaged=skipped)]
    assert got == ["g0", "g1", "g4"]
    assert list(skipped.files) == [str(bad)] and "column 'offset'" in skipped.files[str(bad)]
    assert skipped.records == {("p.prompts.v1", 0, 5)}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TAPIOCA_BOOTSTRAP": "127.0.0.1:1"}  # no broker is needed, nor reached
    return subprocess.run([TAPIOCA, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


def test_tapioca_replay_gives_one_line_or_skips_with_skip_damaged(archive, tmp_path):
    root, bad = archive
    line = one_line(cli("replay", str(root), "--dry-run", cwd=tmp_path))
    assert line.startswith(f"error: {bad}: column 'offset' holds string, not int64")
    nulls = damaged(tmp_path / "nulls", "p.prompts.v1", [prompt(0), prompt(1)], 0, nulls=True)
    line = one_line(cli("replay", str(tmp_path / "nulls"), "--dry-run", cwd=tmp_path))
    assert line.startswith(f"error: {nulls}: column 'offset' has 1 null value")
    proc = cli("replay", str(root), "--dry-run", "--skip-damaged", "-o", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert (stats["published"], stats["damaged_files"], stats["damaged_records"]) == (2, 1, 0)
    assert f"skipped (--skip-damaged): {bad}: column 'offset'" in proc.stderr


def test_tapioca_train_offline_gives_one_line_or_skips_with_skip_damaged(tmp_path):
    root = tmp_path / "archive"
    bad = damaged(root, "p.samples.v1", [sample(0)], 0)
    args = ("train-offline", "--from-archive", str(root), "--no-publish", f"run_dir={tmp_path / 'runs'}")
    line = one_line(cli(*args, cwd=tmp_path))
    assert line.startswith(f"error: {bad}: column 'offset' holds string, not int64")
    proc = cli(*args, "--skip-damaged", "-o", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["steps"], out["groups_read"], out["damaged_files"], out["refused_samples"]) == (0, 0, 1, 0)


def test_offline_training_skips_the_samples_the_trainer_refuses_only_when_asked():
    from tapioca.bus.role import Role
    from tapioca.schemas.errors import BadEventError
    from tapioca.trainers.offline import OfflineTrainer

    class Refusing(Role):  # refuses what a live trainer dead-letters (here: group g1)
        name = "trainer"

        def init_state(self):
            return []

        def handle(self, event, state, source):
            if event.group_id == "g1":
                raise BadEventError("group g1: the image is 13000 x 13000 = 169,000,000 pixels, over ...")
            state.append(event.group_id)
            return ()

    samples = [(Source("s", 0, i), sample(i)) for i in range(3)]
    role = Refusing()
    result = OfflineTrainer(role, skip_refused=True).run(iter(samples))
    assert (result.groups_read, result.refused) == (3, 1)
    with pytest.raises(BadEventError, match="13000 x 13000"):
        OfflineTrainer(role).run(iter(samples))
