"""A full disk (issue 31): the write of a weights file or of a checkpoint fails with
ENOSPC part way through (the module's ``open`` is patched so that its writes stop after a
few bytes, as on a full file system), then the disk is freed and the trainer resumes.
Nothing of the step is committed (version, trained groups, buffer, offsets), no version
is announced with another version's file, the temp file is removed, and the error is the
one-line ``StorageError`` that stops the role (never an ordinary, retried failure). Also:
a trainer resumed below the log's highest version publishes above it, and the launcher's
reason pipe (ops/role_main.py). Real tiny model, no broker."""

from __future__ import annotations

import errno
import io
import os
import sys
from pathlib import Path

import pytest
import torch

from tapioca.bus.role import Role, Source
from tapioca.bus.runner import RoleRunner
from tapioca.bus.settings import BusConfig
from tapioca.schemas.errors import FatalRoleError, StorageError
from tapioca.schemas.events import WeightsEvent
from tapioca.trainers import checkpoint
from tapioca.trainers.batching import flatten_groups
from tapioca.trainers.checkpoint import read_progress
from tapioca.weights import durable
from tapioca.weights import files as weight_files
from tapioca.weights.files import sha256_file, weights_file
from tapioca.weights.payload import load_verified
from tapioca.weights.publisher import WeightPublisher

sys.path.insert(0, str(Path(__file__).parent))
from test_role_trainer import TOPIC, make_trainer, progress_of, sample, src, start  # noqa: E402

ENOSPC = os.strerror(errno.ENOSPC)  # "No space left on device"


class _FullFile(io.FileIO):
    """A real file whose writes fail with ENOSPC once ``room`` bytes are in it."""

    room = 64

    def write(self, data) -> int:
        left = self.room - self.tell()
        if len(memoryview(data)) > left:
            if left > 0:
                super().write(memoryview(data)[:left])
            raise OSError(errno.ENOSPC, ENOSPC)
        return super().write(data)


def fill_disk(monkeypatch, module) -> None:
    """``module``'s binary writes (its one ``open(tmp, "wb")``) now hit a full disk."""
    monkeypatch.setattr(module, "open", lambda path, mode="r", *a, **k: _FullFile(path, mode),
                        raising=False)


def tmp_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob("*.tmp"))


def weights_events(out) -> list[WeightsEvent]:
    return [e for e in out if isinstance(e, WeightsEvent)]


def step_2_on_a_full_disk(t, m, module):
    """Step 1 (g0, g1) on a healthy disk, g2 buffered; then ``module``'s writes hit a
    full disk and g3 triggers step 2. Returns (state, version 1's event, the error)."""
    state = start(t)
    t.handle(sample("g0"), state, src(0))
    (v1,) = weights_events(t.handle(sample("g1"), state, src(1)))
    t.handle(sample("g2"), state, src(2))
    fill_disk(m, module)
    with pytest.raises(StorageError) as err:
        t.handle(sample("g3"), state, src(3))
    return state, v1, err


def test_full_disk_at_the_weights_write_commits_nothing_and_stops_the_trainer(tmp_path, monkeypatch):
    t = make_trainer(tmp_path)
    with monkeypatch.context() as m:
        # The file transport writes through durable.write_safetensors.
        state, v1, err = step_2_on_a_full_disk(t, m, durable)
    # One line naming the file; fatal (the runner re-raises FatalRoleError, never retries).
    assert str(err.value) == f"{ENOSPC} writing {weights_file(tmp_path / 'weights', 2)}"
    assert isinstance(err.value, FatalRoleError)
    # Nothing of step 2 was committed: version, trained groups, the checkpoint's offsets.
    assert state.progress.version == 1 and state.trained == {"g0", "g1"}
    assert state.progress.last_group_ids == ["g0", "g1"]
    assert t.committable(state, TOPIC, 0, 4) == 2  # what the version-1 checkpoint covers
    assert tmp_files(tmp_path) == []
    assert not weights_file(tmp_path / "weights", 2).exists()
    assert read_progress(t.checkpoints.path).version == 1
    t.sink.close()

    # The disk is freed; the role restarts from its checkpoint and trains g2, g3 once.
    t2 = make_trainer(tmp_path, seed=5)
    s2 = t2.init_state()
    (hello,) = weights_events(t2.on_tick(s2, 0.0))
    assert (hello.version, hello.path, hello.sha256) == (1, v1.path, v1.sha256)
    t2.handle(sample("g2", min_version=1), s2, src(2))
    out = t2.handle(sample("g3", min_version=1), s2, src(3))
    (v2,), (p2,) = weights_events(out), progress_of(out)
    assert v2.version == 2 and p2.version == 2 and p2.group_ids == ["g2", "g3"]
    assert Path(v2.path) == weights_file(tmp_path / "weights", 2).resolve()
    assert sha256_file(v2.path) == v2.sha256 != v1.sha256
    t2.sink.close()


def test_full_disk_at_the_checkpoint_commits_no_version_nor_offset(tmp_path, monkeypatch):
    t = make_trainer(tmp_path)
    with monkeypatch.context() as m:
        state, v1, err = step_2_on_a_full_disk(t, m, checkpoint)  # checkpoint.write_tensors
        assert str(err.value) == f"{ENOSPC} writing {t.checkpoints.path}"
        assert state.progress.version == 1 and state.trained == {"g0", "g1"}
        # The offsets that may be committed are still the saved checkpoint's (the bug:
        # they were set before the save that failed, and ~150 groups were lost for good).
        assert state.progress.offsets == {f"{TOPIC}:0": 2}
        assert t.committable(state, TOPIC, 0, 4) == 2
        assert tmp_files(tmp_path) == []
        # Were the process to announce now, it is version 1 with version 1's own file.
        state.announce_weights = True
        (again,) = t.on_tick(state, 0.0)
        assert (again.version, again.path, again.sha256) == (1, v1.path, v1.sha256)
    assert read_progress(t.checkpoints.path).version == 1
    t.sink.close()

    t2 = make_trainer(tmp_path, seed=5)
    s2 = t2.init_state()
    assert s2.progress.version == 1 and s2.trained == {"g0", "g1"}
    t2.handle(sample("g2", min_version=1), s2, src(2))
    (v2,) = weights_events(t2.handle(sample("g3", min_version=1), s2, src(3)))
    assert v2.version == 2 and sha256_file(v2.path) == v2.sha256
    assert read_progress(t2.checkpoints.path).version == 2
    t2.sink.close()


def test_full_disk_at_the_metrics_file_is_a_storage_error_naming_it(tmp_path):
    t = make_trainer(tmp_path)
    state = start(t)
    t.handle(sample("g0"), state, src(0))
    jsonl = t.sink._jsonl
    full = io.TextIOWrapper(_FullFile(jsonl.name, "a"), line_buffering=True)
    full.buffer.room = 0
    t.sink._jsonl = full
    jsonl.close()
    with pytest.raises(StorageError, match=f"{ENOSPC} writing .*metrics.jsonl"):
        t.handle(sample("g1"), state, src(1))
    # The step was written and checkpointed before its metrics line: it stands.
    assert read_progress(t.checkpoints.path).version == 1


def test_a_version_is_never_announced_with_another_versions_file(tmp_path):
    t = make_trainer(tmp_path)
    state = start(t)
    t.handle(sample("g0"), state, src(0))
    (v1,) = weights_events(t.handle(sample("g1"), state, src(1)))
    # What the bug left: step 2 taken in memory and the version bumped, but the path and
    # checksum still version 1's (its weights write had failed).
    assert t.payload.out.announcement(2, v1.path, v1.sha256) is None
    t.actor.train_step(flatten_groups([sample("g2", 1), sample("g3", 1)]), policy_version=1)
    state.progress.version = 2
    state.announce_weights = True
    (ev,) = t.on_tick(state, 0.0)
    assert ev.version == 2
    assert Path(ev.path) == weights_file(tmp_path / "weights", 2).resolve()
    assert sha256_file(ev.path) == ev.sha256 != v1.sha256
    # Its own file, present: re-announced as it is.
    assert t.payload.out.announcement(1, v1.path, v1.sha256)["path"] == v1.path
    t.sink.close()


def test_a_trainer_resumed_below_the_logs_highest_version_publishes_above_it(tmp_path):
    # checkpoint_every_steps=2: version 3 is published but no checkpoint covers it; the
    # process dies there (no on_stop).
    t = make_trainer(tmp_path, checkpoint_every_steps=2)
    state = t.init_state()
    log = list(t.on_tick(state, 0.0))  # version 0 at start
    for k in range(6):
        log += t.handle(sample(f"g{k}", min_version=k // 2), state, src(k))
    assert state.progress.version == 3 and read_progress(t.checkpoints.path).version == 2
    t.sink.close()

    t2 = make_trainer(tmp_path, seed=5)
    s2 = t2.init_state()
    assert s2.progress.version == 2
    t2.recover(s2, [e for e in log if isinstance(e, WeightsEvent)])
    up, up_progress = t2.on_tick(s2, 0.0)
    # Above the log's highest (3), with the checkpoint's weights, as a rollback does.
    assert (up.version, up.rollback_of, up_progress.version, up_progress.group_ids) == (4, 2, 4, [])
    assert up_progress.rollbacks == 2  # version - rollbacks = 2 trained steps: the head gate's count
    assert sha256_file(up.path) == up.sha256
    v2 = weights_file(tmp_path / "weights", 2)
    mine, theirs = load_verified(up.path, up.sha256), load_verified(v2, sha256_file(v2))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert read_progress(t2.checkpoints.path).version == 4  # checkpointed before it was sent
    assert list(t2.on_tick(s2, 0.0)) == []
    # The lost step's groups are read again and train at once (made at versions <= 3,
    # not newer than the trainer); versions keep going up.
    t2.handle(sample("g4", min_version=3), s2, src(4))
    (v5,) = progress_of(t2.handle(sample("g5", min_version=3), s2, src(5)))
    assert v5.version == 5 and v5.group_ids == ["g4", "g5"] and v5.rollbacks == 2
    t2.sink.close()


def test_a_trainer_restarted_without_a_checkpoint_trains_on_to_total_train_steps(tmp_path):
    """Issue 37: a trainer that died after step 1 with no checkpoint (checkpoint_every_steps
    10) came back, republished the initial weights as version 2 and, with
    total_train_steps=2, finished there: final/ held the untrained model. The
    republished version is no trained step: it trains two more."""
    import dataclasses

    t = make_trainer(tmp_path, checkpoint_every_steps=10)
    state = t.init_state()
    log = list(t.on_tick(state, 0.0))
    for k in range(2):
        log += t.handle(sample(f"g{k}"), state, src(k))
    assert state.progress.version == 1 and read_progress(t.checkpoints.path) is None
    t.sink.close()

    t2 = make_trainer(tmp_path, seed=5)
    t2.cfg = dataclasses.replace(t2.cfg, total_train_steps=2)
    s2 = t2.init_state()
    t2.recover(s2, [e for e in log if isinstance(e, WeightsEvent)])
    assert (s2.progress.version, s2.progress.rollbacks, s2.progress.trained_steps) == (2, 2, 0)
    assert not t2.finished(s2)
    for k in range(2, 6):
        t2.handle(sample(f"g{k}", min_version=k // 2), s2, src(k))
    assert (s2.progress.version, s2.progress.trained_steps) == (4, 2) and t2.finished(s2)
    t2.sink.close()


def test_durable_writer_of_a_fast_transport_reports_a_full_disk(tmp_path, monkeypatch):
    pub = WeightPublisher("ipc", tmp_path / "weights", device="cpu", publish_dtype=None,
                          bucket_bytes=1 << 16, name=f"t{os.getpid()}")
    try:
        state_dict = {"w": torch.arange(4096, dtype=torch.float32)}
        pub.publish(state_dict, 1)  # the event of version 1 goes out; its file is due
        fill_disk(monkeypatch, durable)
        pub.poll()  # starts the background write
        with pytest.raises(StorageError, match=f"{ENOSPC} writing .*v000001.safetensors"):
            pub.finish()
        assert tmp_files(tmp_path) == []
    finally:
        monkeypatch.undo()
        try:
            pub.close()
        except StorageError:
            pass


def test_atomic_write_removes_its_temp_file_and_names_the_target(tmp_path):
    target = tmp_path / "x.bin"
    for code in (errno.ENOSPC, errno.EIO, errno.EROFS):
        with pytest.raises(StorageError) as err:
            with weight_files.atomic_write(target) as tmp:
                tmp.write_bytes(b"half")
                raise OSError(code, os.strerror(code))
        assert str(err.value) == f"{os.strerror(code)} writing {target}"
        assert not target.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(OSError) as other:  # not the disk's fault: left as it is
        with weight_files.atomic_write(target):
            raise OSError(errno.EACCES, "denied")
    assert not isinstance(other.value, StorageError)


# ---------------------------------------------------------------------- the runner


class _DiskRole(Role):
    name = "disk"
    group_inputs = ("samples",)

    def __init__(self, code: int) -> None:
        self.code = code
        self.calls = 0

    def init_state(self):
        return {}

    def handle(self, event, state, source):
        self.calls += 1
        raise OSError(self.code, os.strerror(self.code), "/runs/x/archive/part-0.parquet")

    def on_tick(self, state, now):
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EROFS])
def test_runner_stops_on_a_disk_error_instead_of_retrying_it(code):
    role = _DiskRole(code)
    runner = RoleRunner(role, BusConfig(handler_max_attempts=5))
    runner.state = role.init_state()
    event = sample("g0")
    with pytest.raises(StorageError) as err:
        runner._try_handle(event, b"", Source(topic=TOPIC, partition=0, offset=0), attempt=1)
    assert str(err.value) == f"{os.strerror(code)} writing /runs/x/archive/part-0.parquet"
    assert role.calls == 1 and runner.stats.retries == 0 and runner.stats.dead_lettered == 0
    with pytest.raises(StorageError):
        runner._tick(0.0)
    assert runner.stats.tick_failures == 0


# ---------------------------------------------------------------------- role_main


def test_role_process_exits_74_and_tells_the_launcher_why_when_its_log_is_full(
        tmp_path, monkeypatch):
    from tapioca.ops import role_main
    from tapioca.ops.launcher import EXIT_STORAGE, REASON_FD_ENV

    def full_disk_role(role, cfg, member):
        raise StorageError(f"{ENOSPC} writing /runs/x/weights/v000028.safetensors")

    class FullLog(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, ENOSPC)

    monkeypatch.setattr(role_main, "build_role", full_disk_role)
    read_end, write_end = os.pipe()
    monkeypatch.setenv(REASON_FD_ENV, str(write_end))
    monkeypatch.setattr(sys, "stderr", FullLog())
    example = Path(__file__).resolve().parents[2] / "examples" / "demo_cpu.yaml"
    try:
        code = role_main.run_role_process("trainer", str(example),
                                          ["trial_name=full", f"run_dir={tmp_path}"])
    finally:
        os.close(write_end)
    assert code == EXIT_STORAGE
    with os.fdopen(read_end, "rb") as pipe:
        assert pipe.read().decode() == (f"{ENOSPC} writing "
                                        "/runs/x/weights/v000028.safetensors\n")
