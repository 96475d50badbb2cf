"""A full disk and a resume below the log (issue 31), through the real `tapioca train`
supervisor (ops/launcher.py), the real trainer role process and the real embedded broker.
The other roles are stand-ins that sleep: the test itself plays feeder, rollout and
advantage, publishing sample groups under the head gate (algorithms/head_gate.py, the
feeder's own arithmetic) from the weights events it reads. Everything is checked from
the log and the run directory.

The disk fills for real: the trainer process's file size limit (RLIMIT_FSIZE, set from
outside with prlimit) drops to 1 byte mid-run, so its next write -- its log's and the
weights file's -- fails in the kernel (EFBIG: Python ignores SIGXFSZ), as writes fail
on a full file system. Then the run is started again with the limit gone.
"""

from __future__ import annotations

import resource
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from tapioca.algorithms.head_gate import head_gate_capacity, log_counts
from tapioca.bus import EventProducer, TopicReader, read_events
from tapioca.bus.settings import BusConfig
from tapioca.config.schema import (
    ActorConfig,
    DatasetConfig,
    GenerationConfig,
    LauncherConfig,
    ModelConfig,
    RolloutConfig,
    TrainConfig,
)
from tapioca.ops.launcher import Launcher, RoleFailedError
from tapioca.ops.run_setup import role_command
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import ProgressEvent, SampleEvent, SampleSequence, WeightsEvent
from tapioca.trainers.checkpoint import read_progress
from tapioca.weights.files import sha256_file, weights_file

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prlimit is Linux")]

B = 2  # groups per step
ETA = 1
STEPS = 6
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model"))


def make_cfg(tmp_path: Path, broker, model: str, **actor) -> TrainConfig:
    return TrainConfig(
        run_dir=str(tmp_path / "runs"), experiment_name="full", trial_name="t0",
        total_train_steps=STEPS, model=ModelConfig(path=model),
        bus=BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"full{uuid.uuid4().hex[:8]}"),
        train_dataset=DatasetConfig(prompts_per_step=B),
        gconfig=GenerationConfig(n_samples=2, max_new_tokens=2),
        rollout=RolloutConfig(max_head_offpolicyness=ETA), actor=ActorConfig(**actor),
        launcher=LauncherConfig(restart_backoff_s=0.1))


def only_the_trainer(role: str, member: int, config: Path) -> list[str]:
    return role_command(role, member, config) if role == "trainer" else SLEEPER


class GroupSource:
    """Feeder, rollout and advantage in one: publishes sample groups while the head gate
    (computed as the feeder computes it, from the progress events) has room, each made
    "at" the latest version seen. ``limit``: stop after that many groups."""

    def __init__(self, bus: BusConfig, tokenizer, limit: int | None = None) -> None:
        self.bus, self.limit = bus, limit
        self.prompt = tokenizer("max(3,5)=", add_special_tokens=False)["input_ids"]
        # Answers differ from group to group, so no two steps give the same weights.
        self.outs = [tokenizer(str(d), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                     for d in range(10)]
        self.reader = TopicReader(bus, "progress")
        self.admitted = 0
        self.freed: set[str] = set()
        self.latest: ProgressEvent | None = None

    def capacity(self) -> int:
        v = self.latest
        if v is None:
            return 0
        rollbacks, _ = log_counts(v.rollbacks, v.groups_rejected, v.base_steps, v.base_rejected)
        return head_gate_capacity(self.admitted, v.version, ETA, B, freed=len(self.freed),
                                  rollbacks=rollbacks)

    def tick(self) -> None:
        for r in self.reader.records(idle_s=0.05, timeout_s=2):
            if isinstance(r.event, ProgressEvent):
                ev = r.event
                if self.latest is None or ev.version >= self.latest.version:
                    self.latest = ev
                self.freed |= {g for g in ev.rejected_group_ids if g.startswith("full-g")}
        groups = []
        while self.capacity() > len(groups) and (self.limit is None or self.admitted + len(groups) < self.limit):
            groups.append(self._group(self.admitted + len(groups), self.latest.version))
        if groups:
            with EventProducer(self.bus, "test-source") as producer:
                for g in groups:
                    producer.publish(g)
            self.admitted += len(groups)

    def _group(self, k: int, version: int) -> SampleEvent:
        gid = f"full-g{k:04d}"
        outs = [self.outs[k % 10], self.outs[(k * 3 + 1) % 10]]
        seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=out,
                               behav_logprobs=[-3.0] * len(out),
                               output_versions=[version] * len(out), reward=float(i == 0),
                               advantage=1.0 if i == 0 else -1.0) for i, out in enumerate(outs)]
        return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=self.prompt, sequences=seqs,
                           min_version=version, max_version=version)

    def close(self) -> None:
        self.reader.close()


@pytest.fixture
def tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt, local_files_only=True)


def one_sha_per_version(weights: list[WeightsEvent], progress: list[ProgressEvent]) -> dict[int, str]:
    """{version: sha256}, after checking that no version was announced with two sets of
    bytes, nor two versions that trained groups with the same bytes (one announced with
    another's file). A rollback's version has its target's bytes, by design."""
    shas: dict[int, set[str]] = defaultdict(set)
    for ev in weights:
        shas[ev.version].add(ev.sha256)
    assert all(len(s) == 1 for s in shas.values()), f"a version with two sets of bytes: {dict(shas)}"
    by_version = {v: s.pop() for v, s in shas.items()}
    trained = {e.version for e in progress if e.group_ids}
    assert len({by_version[v] for v in trained}) == len(trained), "two versions with the same bytes"
    return by_version


def trained_once(progress: list[ProgressEvent], versions) -> list[str]:
    """The groups trained by ``versions`` (each version's latest event), none twice."""
    latest = {e.version: e for e in progress}
    groups = [g for v in versions for g in latest[v].group_ids]
    assert len(groups) == len(set(groups)), "a group was trained twice"
    return groups


def feed_and_once_at(launcher: Launcher, source: GroupSource, version: int, action) -> list[int]:
    """The launcher's tick: feed groups; the first time ``version`` is on the log, run
    ``action()`` and lift the source's limit. Returns where the version seen is noted."""
    seen: list[int] = []

    def tick() -> None:
        source.tick()
        if not seen and source.latest is not None and source.latest.version >= version:
            action()
            seen.append(source.latest.version)
            source.limit = None

    launcher.on_tick = tick
    return seen


def test_a_full_disk_stops_the_trainer_with_its_reason_and_the_resume_finishes(
        tmp_path, broker, tiny_ckpt, tokenizer):
    cfg = make_cfg(tmp_path, broker, tiny_ckpt)
    launcher = Launcher(cfg, command_for=only_the_trainer)
    launcher.start()
    # Groups for two steps, then the disk fills (the trainer idle at version 2), then more.
    source = GroupSource(launcher.cfg.bus, tokenizer, limit=2 * B)

    def fill_the_disk() -> None:  # every further write of the trainer fails in the kernel
        trainer = next(c for c in launcher.children if c.role == "trainer")
        _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.prlimit(trainer.proc.pid, resource.RLIMIT_FSIZE, (1, hard))

    filled_at = feed_and_once_at(launcher, source, 2, fill_the_disk)
    try:
        with pytest.raises(RoleFailedError) as err:
            launcher.wait(timeout_s=240)
    finally:
        launcher.stop()
    run = Path(launcher.cfg.run_path)
    v = filled_at[0]
    assert v == 2
    # One line, with the reason the trainer could not write into its own log.
    message = str(err.value)
    reason = f"File too large writing {weights_file(run / 'weights', v + 1)}"
    assert message.startswith(f"role trainer-0 stopped: {reason}; free space") and "\n" not in message
    assert reason not in (run / "logs" / "trainer-0.log").read_text(errors="replace")
    # The state is the last version's: checkpointed, announced with its own file, no .tmp.
    assert sorted(run.rglob("*.tmp")) == []
    weights = read_events(launcher.cfg.bus, "weights")
    progress = read_events(launcher.cfg.bus, "progress")
    assert max(e.version for e in weights) == v == read_progress(run / "checkpoints" / "trainer.safetensors").version
    shas = one_sha_per_version(weights, progress)
    for ev in weights:
        assert Path(ev.path) == weights_file(run / "weights", ev.version).resolve()
    source.close()

    before_fill = {f"full-g{k:04d}" for k in range(source.admitted)}
    admitted = source.admitted

    # Space freed (a new process has no limit): the same run again resumes and finishes.
    again = Launcher(cfg, command_for=only_the_trainer)
    again.start()
    source = GroupSource(again.cfg.bus, tokenizer)
    source.admitted = admitted  # the feeder's count, recovered from its log
    again.on_tick = source.tick
    try:
        summary = again.wait(timeout_s=240)
    finally:
        again.stop()
        source.close()
    assert summary.steps == STEPS
    weights = read_events(again.cfg.bus, "weights")
    progress = read_events(again.cfg.bus, "progress")
    shas = one_sha_per_version(weights, progress)
    assert sorted(shas) == list(range(STEPS + 1)), "a version was skipped"
    for version, sha in shas.items():
        path = weights_file(run / "weights", version)
        assert sha256_file(path) == sha  # each announced file holds its version's bytes
    trained = trained_once(progress, range(1, STEPS + 1))
    # The failed step's groups were not lost (no offset committed past the checkpoint):
    # read again, they trained the next version.
    latest = {e.version: e for e in progress}
    assert set(latest[v + 1].group_ids) <= before_fill - set(trained_once(progress, range(1, v + 1)))
    rejected = {g for e in progress for g in e.rejected_group_ids}
    published = {e.group_id for e in read_events(again.cfg.bus, "samples")}
    assert not rejected & set(trained)
    print(f"\ndisk filled at version {v}; {len(trained)} groups trained, {len(rejected)} "
          f"rejected, {len(published - set(trained) - rejected)} left unread at the end")


def test_a_trainer_killed_above_its_checkpoint_publishes_above_the_log_and_finishes(
        tmp_path, broker, tiny_ckpt, tokenizer):
    # checkpoint_every_steps=2: version 3 is published, then the trainer is killed (-9)
    # before any checkpoint covers it; its restart finds version 3 on the log.
    cfg = make_cfg(tmp_path, broker, tiny_ckpt, checkpoint_every_steps=2)
    launcher = Launcher(cfg, command_for=only_the_trainer)
    launcher.start()
    source = GroupSource(launcher.cfg.bus, tokenizer, limit=3 * B)
    killed = feed_and_once_at(launcher, source, 3, lambda: launcher.restart("trainer"))
    try:
        summary = launcher.wait(timeout_s=300)  # it finishes: no stall on resume
    finally:
        launcher.stop()
        source.close()
    # Versions 3 (lost with the kill) and 4 (the restart's) are rollbacks: the run trains
    # on to STEPS trained steps, so its last version is STEPS + 2 (issue 37: a restart
    # without a checkpoint used to end the run short, on its republished weights).
    last = STEPS + 2
    assert killed == [3] and summary.steps == last
    weights = read_events(launcher.cfg.bus, "weights")
    progress = read_events(launcher.cfg.bus, "progress")
    shas = one_sha_per_version(weights, progress)
    # The restart published the checkpoint's weights (version 2's) as version 4, above
    # the log's highest, as a rollback does; versions 3's groups were judged again.
    (up,) = [e for e in weights if e.rollback_of is not None]
    up_progress = [e for e in progress if e.version == 4][0]
    assert (up.version, up.rollback_of, up_progress.rollbacks, up_progress.group_ids) == (4, 2, 2, [])
    assert shas[4] == shas[2] and sorted(shas) == list(range(last + 1))
    lineage = [1, 2, *range(5, last + 1)]  # the history the final model descends: STEPS steps
    assert len(lineage) == STEPS
    trained = trained_once(progress, lineage)
    latest = {e.version: e for e in progress}
    rejected = {g for e in progress for g in e.rejected_group_ids}
    assert set(latest[3].group_ids) <= set(trained) | rejected
    samples = {e.group_id: e for e in read_events(launcher.cfg.bus, "samples")}
    for version in lineage:  # the staleness bound held in the resumed history
        for gid in latest[version].group_ids:
            assert 0 <= version - 1 - samples[gid].min_version <= ETA
