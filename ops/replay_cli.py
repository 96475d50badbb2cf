"""`tapioca archive`, `tapioca replay` and `tapioca train-offline`: the log after the run.

- ``archive DIR``: the archiver role (consumers/archiver.py) against a broker, writing
  every topic (or ``--topic``) to Parquet under DIR (format: bus/archive.py).
- ``replay``: republishes events from a Parquet archive, or a live topic's offset or
  time range, to the same topics under another prefix, to one ``--to-topic``, or to a
  new run (``--run-id`` rewrites each event's ``run_id``), at ``--rate`` events per
  second, filtered by type, partition, offset, time, policy version and reward
  (whole groups unless ``--per-event``). The filtering and publishing are
  bus/replay.py; this module parses the flags.
- ``train-offline``: the trainer role trained from an archive (trainers/offline.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Iterator, Optional

import typer

from ..bus.archive import Damaged, count_records
from ..bus.replay import (
    Replayer,
    ReplayFilter,
    ReplayItem,
    ReplayStats,
    items_from_archive,
    items_from_topic,
)
from ..schemas.errors import BusError, ConfigError
from .cli_context import (
    EXTRA_ARGS,
    OUTPUT_HELP,
    G,
    bus_config,
    check_output,
    console,
    emit_json,
    err_console,
    quiet_hugging_face,
)
from .progress import CommandProgress

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()


def parse_time(value: Optional[str], flag: str) -> Optional[int]:
    """Epoch seconds or an ISO-8601 time (UTC unless it names a zone) -> epoch ms."""
    if value is None:
        return None
    try:
        return int(float(value) * 1000)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"{flag} {value!r}: use epoch seconds or ISO 8601, e.g. "
                                 "2026-11-30T07:00:00Z") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return int(t.timestamp() * 1000)


@app.command("replay")
def replay(
    archive: Optional[str] = typer.Argument(
        None, help="Parquet archive directory (or one file) to replay."),
    from_topic: Optional[str] = typer.Option(
        None, "--from-topic", help="Replay a live topic instead (name or full name)."),
    topic: list[str] = typer.Option([], "--topic", "-t",
                                    help="Archive source: only these topics (repeatable)."),
    partition: Optional[int] = typer.Option(
        None, "--partition", help="Only this source partition (offsets are per partition)."),
    from_offset: Optional[int] = typer.Option(
        None, help="First source offset (inclusive), in every partition unless --partition."),
    to_offset: Optional[int] = typer.Option(
        None, help="Last source offset (inclusive), in every partition unless --partition."),
    since: Optional[str] = typer.Option(None, help="Record time from (epoch s or ISO 8601)."),
    until: Optional[str] = typer.Option(None, help="Record time until (inclusive)."),
    type_: list[str] = typer.Option([], "--type", help="Only these event types (repeatable)."),
    min_version: Optional[int] = typer.Option(None, help="Events whose versions are >= this."),
    max_version: Optional[int] = typer.Option(None, help="Events whose versions are <= this."),
    min_reward: Optional[float] = typer.Option(None, help="Rewards / sample means >= this."),
    max_reward: Optional[float] = typer.Option(None, help="Rewards / sample means <= this."),
    per_event: bool = typer.Option(
        False, "--per-event", help="Apply version / reward filters to each record alone "
        "(default: keep or drop whole groups of trajectories, rewards and samples)."),
    to_topic: Optional[str] = typer.Option(None, help="Publish everything to this one topic."),
    to_prefix: Optional[str] = typer.Option(
        None, help="Destination topic prefix (default: --prefix); topics are created."),
    run_id: Optional[str] = typer.Option(None, help="Rewrite every event's run_id (a new run)."),
    rate: float = typer.Option(0.0, help="Events per second (0: as fast as possible)."),
    limit: Optional[int] = typer.Option(None, help="Stop after publishing this many."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be published."),
    skip_damaged: bool = typer.Option(
        False, "--skip-damaged", help="Skip (and count) archive files whose columns are damaged "
        "and records that do not decode, instead of stopping at the first."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Republish a Parquet log, or a live topic's offset or time range, to a topic or a
    new run, with rate control and filters."""
    from ..bus.admin import admin_client, ensure_topics
    from ..bus.producer import EventProducer
    from ..bus.reader import _full_name

    check_output(output)
    if (archive is None) == (from_topic is None):
        raise ConfigError("give either an archive directory or --from-topic NAME (one source)")
    if rate < 0:
        raise typer.BadParameter("--rate must be >= 0 (0: as fast as possible)")
    from ..schemas.envelope import event_types

    unknown = sorted(set(type_) - set(event_types()))
    if unknown:
        raise typer.BadParameter(f"--type {unknown}: event types are {sorted(event_types())}")
    flt = ReplayFilter(frozenset(type_), min_version, max_version, min_reward, max_reward,
                       parse_time(since, "--since"), parse_time(until, "--until"),
                       from_offset, to_offset, partition, per_event)
    if partition is not None and partition < 0:
        raise typer.BadParameter("--partition must be >= 0")
    needs_broker = from_topic is not None or not dry_run
    if needs_broker:
        src_cfg, dest_cfg = bus_config(), bus_config()
    else:  # counting an archive needs no broker
        from ..bus.settings import BusConfig

        src_cfg = dest_cfg = BusConfig(topic_prefix=G.prefix or "tapioca")
    if to_prefix:
        dest_cfg = dataclasses.replace(dest_cfg, topic_prefix=to_prefix)
    elif to_topic and to_topic.count(".") >= 2:
        # A full destination name carries its prefix: create that prefix's topics.
        dest_cfg = dataclasses.replace(dest_cfg, topic_prefix=to_topic.rsplit(".", 2)[0])
    replayer = Replayer(None, dest_cfg, to_topic=to_topic, run_id=run_id, rate=rate)
    stats = ReplayStats()
    if from_topic is not None:
        from ..schemas.registry import topic as topic_spec

        full = _full_name(src_cfg, from_topic)
        target = replayer.to_name or dest_cfg.topic(topic_spec(full))
        if target == full and not dry_run:
            raise ConfigError(f"replaying {full} onto itself would read its own output; "
                              "pass --to-prefix or --to-topic")
        admin_client(src_cfg)

        def items() -> Iterator[ReplayItem]:
            return items_from_topic(src_cfg, full, stats, partition=partition,
                                    from_offset=from_offset)
    else:
        def items() -> Iterator[ReplayItem]:
            return items_from_archive(archive, list(topic), damaged)
    damaged = Damaged() if skip_damaged else None
    # The footers first: a damaged file stops the replay before anything is published.
    total = (count_records(archive, topic=list(topic) or None, damaged=damaged)
             if archive is not None else None)
    if not dry_run:
        ensure_topics(dest_cfg)
        replayer.producer = EventProducer(dest_cfg, "tapioca-replay")
    verb = "would publish" if dry_run else "published"

    def progress(read: int, st: ReplayStats, first_pass: bool) -> None:
        shown.update(read, info="pass 1 of 2: deciding whole groups" if first_pass
                     else f"{verb} {st.published:,}")

    try:
        # -o json keeps stdout one document: the bar (or lines) go to stderr there.
        with CommandProgress("replay", "events read", total=total,
                             console=console if output == "table" else err_console) as shown:
            replayer.run(items, flt, stats, limit=limit, dry_run=dry_run, progress=progress)
    finally:
        if replayer.producer is not None:
            replayer.producer.close()
    if damaged is not None:
        stats.damaged_files, stats.damaged_records = len(damaged.files), len(damaged.records)
    if output == "json":
        emit_json(stats.__dict__)
        return
    console.print(f"{verb} {stats.published} of {stats.read} events in {stats.wall_s:.1f} s "
                  f"({stats.skipped} filtered out, {stats.undecodable} undecodable)")
    if damaged is not None:
        console.print(f"  skipped as damaged (--skip-damaged): {stats.damaged_files} file(s), "
                      f"{stats.damaged_records} record(s)")
    if stats.groups_kept is not None:
        console.print(f"  groups: {stats.groups_kept} kept, {stats.groups_dropped} dropped "
                      "(whole; --per-event filters record by record)")
    for name, n in sorted(stats.by_topic.items()):
        console.print(f"  {name}: {n}")


# ---------------------------------------------------------------------------- archive


@app.command("archive")
def archive(
    directory: str = typer.Argument(..., help="Where the Parquet files go."),
    topic: list[str] = typer.Option([], "--topic", "-t", help="Only these topics (repeatable)."),
    roll_bytes: int = typer.Option(64 << 20, help="Roll a partition's file at this many bytes."),
    roll_interval_s: float = typer.Option(60.0, help="... or this many seconds after it opened."),
    group: Optional[str] = typer.Option(None, help="Consumer group (default PREFIX.archiver)."),
    run_id: str = typer.Option("default", help="Archive only this run's events (default: all)."),
    exit_when_idle_s: Optional[float] = typer.Option(
        None, help="Stop once nothing arrived for this long (batch use)."),
    max_seconds: Optional[float] = typer.Option(None, help="Stop after this long."),
    image_store: str = typer.Option(
        "", help="The run's image store (vlm.image_store): the images events name are copied "
                 "into DIR/images (docs/vlm.md)."),
) -> None:
    """Run the archiver against the broker until Ctrl-C (every topic to Parquet)."""
    from ..bus.admin import admin_client
    from ..bus.runner import RoleRunner
    from ..config.schema import ArchiveConfig
    from ..config.sections import ArchiveSection
    from ..consumers.archiver import Archiver

    a = ArchiveConfig(enabled=True, dir=directory, roll_bytes=roll_bytes,
                      roll_interval_s=roll_interval_s, topics=list(topic))
    cfg = bus_config(run_id=run_id)
    admin_client(cfg)
    role = Archiver(ArchiveSection(archive=a, dir=a.dir, image_store=image_store),
                    exit_when_idle_s=exit_when_idle_s)
    runner = RoleRunner(role, cfg, member_id="archiver-cli", group_id=group)
    state = runner.run(max_seconds=max_seconds)
    w = state.writer
    console.print(f"archived {state.archived} events into {w.files_written} files under "
                  f"{Path(directory).resolve()}")


# ---------------------------------------------------------------------------- offline RL


@app.command("train-offline",
             context_settings=EXTRA_ARGS)
def train_offline(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file."),
    from_archive: str = typer.Option(..., "--from-archive", help="Parquet archive directory."),
    source: str = typer.Option(
        "samples", help="samples (the run's advantages) or trajectories (recomputed from "
                        "trajectories + rewards with this config's advantage section)."),
    trial: Optional[str] = typer.Option(
        None, help="trial_name of the offline run (its own checkpoints, weights and "
                   "metrics); default: the config's trial_name + '-offline' (a new "
                   "timestamped trial when the config has none)."),
    max_steps: Optional[int] = typer.Option(None, help="Stop after this many steps."),
    publish: bool = typer.Option(True, help="Publish weights and metrics to the broker."),
    skip_damaged: bool = typer.Option(
        False, "--skip-damaged", help="Skip (and count) archive files whose columns are damaged, "
        "records that do not decode and samples the trainer refuses (what a live run "
        "dead-letters), instead of stopping at the first."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Train the policy from a Parquet log (decoupled PPO on the recorded behaviour
    logprobs; staleness gate off). Extra arguments are dotted overrides."""
    with quiet_hugging_face():  # the model's loads and saves: the bar below is the progress
        _train_offline(list(ctx.args), config, from_archive, source, trial, max_steps, publish,
                       skip_damaged, output)


def _train_offline(overrides: list[str], config: Optional[str], from_archive: str, source: str,
                   trial: Optional[str], max_steps: Optional[int], publish: bool, skip_damaged: bool,
                   output: str) -> None:
    from ..bus.archive import iter_events
    from ..bus.producer import EventProducer
    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from ..runtime.builders import build_role
    from ..runtime.run import resolve_run
    from ..trainers.offline import OFFLINE_ETA, OfflineTrainer, samples_from_log
    from . import broker_state

    if source not in ("samples", "trajectories"):
        raise typer.BadParameter("--source must be samples or trajectories")
    if not Path(from_archive).exists():
        raise ConfigError(f"archive {from_archive} does not exist; pass the archive "
                          "directory (archive.dir of the run, or `tapioca archive DIR`)")
    cfg = load_config(TrainConfig, config, overrides)
    damaged = Damaged() if skip_damaged else None
    # The bar's total: the steps left to total_train_steps (or --max-steps), at most what
    # the archive's groups make (their count is read from the Parquet footers, which are
    # checked: a damaged file stops here, before a run directory or a model is made).
    if source == "samples":
        groups = count_records(from_archive, topic="samples", damaged=damaged)
    else:
        groups = count_records(from_archive, topic="trajectories", damaged=damaged) // cfg.gconfig.n_samples
    bound = groups // cfg.train_dataset.prompts_per_step
    if trial is None:  # never resume another offline run's checkpoint by accident
        trial = f"{resolve_run(cfg).trial_name}-offline"
    # Recorded versions count the online trainer's steps: no gate (see trainers/offline.py).
    values: dict = {"rollout.max_head_offpolicyness": OFFLINE_ETA}
    archived_images = Path(from_archive) / "images"
    if archived_images.is_dir():  # the archive's own copy of the images (docs/vlm.md)
        values["vlm.image_store"] = str(archived_images.resolve())
    cfg = resolve_run(cfg, values=values, trial_name=trial, topic_prefix=G.prefix or None,
                      prepare=True)
    run_dir = Path(cfg.run_path)
    producer = None
    if publish:
        # --bootstrap-server / TAPIOCA_BOOTSTRAP first: a run's config.yaml names the
        # broker it ran on, which stopped with the run if it was the run's own.
        cfg = resolve_run(cfg, bootstrap=broker_state.resolve_bootstrap(G.bootstrap,
                                                                        cfg.bus.bootstrap_servers))
        from ..bus.admin import ensure_topics

        try:
            ensure_topics(cfg.bus)
        except BusError as exc:
            raise BusError(
                f"{exc}. A run's config.yaml names the broker the run used, which is gone "
                "if it was the run's own embedded broker: pass a live one with "
                "--bootstrap-server (or TAPIOCA_BOOTSTRAP; either wins over the config), "
                "or --no-publish to train without publishing weights and metrics "
                "events") from None
        producer = EventProducer(cfg.bus, f"{cfg.run_id}-trainer-offline")
    trainer = build_role("trainer", cfg)
    if source == "samples":
        samples = samples_from_log(iter_events(from_archive, topic="samples", damaged=damaged))
    else:
        samples = samples_from_log(
            iter_events(from_archive, topic=["trajectories", "rewards"], order="time", damaged=damaged),
            build_role("advantage", cfg))

    def shown_total(result) -> int:
        left = max(cfg.total_train_steps - result.start_version, 0)
        return min(left, bound, max_steps if max_steps is not None else left)

    try:
        with CommandProgress("train-offline", "steps",
                             console=console if output == "table" else err_console) as shown:
            result = OfflineTrainer(
                trainer, publish=producer.publish if producer else None, max_steps=max_steps,
                progress=lambda r: shown.update(r.steps, shown_total(r),
                                                info=f"{r.groups_read:,} groups read"),
                skip_refused=skip_damaged,
            ).run(samples)
    finally:
        if producer is not None:
            producer.close()
    summary = {"run_dir": str(run_dir), "steps": result.steps, "groups_read": result.groups_read,
               "final_version": result.final_version, "losses": result.losses,
               "weights": result.weights[-1].path if result.weights else None,
               "already_complete": result.already_complete}
    if damaged is not None:
        summary.update(damaged_files=len(damaged.files), damaged_records=len(damaged.records),
                       refused_samples=result.refused)
    if output == "json":
        emit_json(summary)
        return
    if result.already_complete:
        console.print(f"train-offline: already complete: trial {cfg.trial_name} ({run_dir}) is at "
                      f"version {result.start_version} of total_train_steps="
                      f"{cfg.total_train_steps}; nothing to train (raise total_train_steps to go "
                      "on, or pass --trial NEW for a new offline run)", soft_wrap=True)
        return
    console.print(f"offline: {result.steps} steps from {result.groups_read} groups of "
                  f"{from_archive}; version {result.final_version}; weights "
                  f"{summary['weights']}; metrics {run_dir}/metrics/metrics.jsonl")
    if damaged is not None:
        console.print(f"  skipped as damaged (--skip-damaged): {summary['damaged_files']} file(s), "
                      f"{summary['damaged_records']} record(s), {result.refused} sample(s) the "
                      "trainer refused")
