"""Fleet control from the CLI: `tapioca status`, `tapioca pause|resume|drain TARGET`,
`tapioca reward SESSION_ID VALUE`, `tapioca weights list|rollback`, `tapioca dlq
list|show|retry`.

Reads ``fleet.v1`` (heartbeats), ``weights.v1`` and ``dlq.v1``; publishes
``ControlEvent`` on ``control.v1`` and waits for the members' ``ControlAckEvent``; `dlq
retry` republishes dead letters' original payloads to their source topics (with their
original keys). A target is a role name, a member id, or ``all``.
"""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any, Optional

import orjson
import typer
from rich.table import Table

from ..schemas.envelope import ANY_RUN, names_a_run
from ..schemas.errors import TapiocaError
from .cli_context import OUTPUT_HELP, bus_config, check_output, console, emit_json, run_dir_run_id
from .render import compact, duration, narrow_table, number_column

# This module's top-level commands and its two command groups; ops/cli.py adds them to
# `tapioca`.
app = typer.Typer()
weights_app = typer.Typer(no_args_is_help=True, help="Published policy versions; rollback.")
dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters: list, show, retry.")

TIMEOUT_HELP = "Seconds to wait for every targeted member's acknowledgement."


def _fmt(value: Any, spec: str = "{:.1f}") -> str:
    return spec.format(value) if isinstance(value, (int, float)) else "-"


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts > 0 else "-"


# ---------------------------------------------------------------------- status


@app.command("status")
def status(
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
    all_members: bool = typer.Option(False, "--all", help="Also members whose last "
                                     "heartbeat is older than --since."),
    since_s: float = typer.Option(600.0, "--since", help="Hide members silent for longer "
                                  "than this many seconds (unless --all)."),
    stall_after_s: float = typer.Option(60.0, "--stall-after", help="Raise the stall alarm "
                                        "when every running member has been idle this long."),
) -> None:
    """The fleet: every member's role, status, version, throughput, lag, staleness and
    dead letters, from the heartbeats on fleet.v1; a stall alarm (on stderr, exit code
    4) when every running member has been idle for --stall-after seconds."""
    from ..bus.admin import admin_client
    from ..bus.fleet import TARGETABLE_STALE_S, read_fleet, stall

    check_output(output)
    cfg = bus_config()
    admin_client(cfg)
    window = None if all_members else max(since_s, TARGETABLE_STALE_S)
    run_id = run_dir_run_id()  # --run-dir: that run's members only
    members = [m for m in read_fleet(cfg, window_s=window, run_id=run_id)
               if all_members or m.age_s <= since_s]
    alarm = stall(members, stall_after_s)
    if output == "json":
        emit_json([m.to_json() for m in members])
        _stall_exit(alarm)
        return
    # Short headers and compact numbers: the numbers stay whole on 80 columns (the text
    # columns wrap instead). A member id names its role ("rollout-0"): the role is said
    # only where it does not.
    run = f", run {run_id}" if names_a_run(run_id) else ""
    table = narrow_table(f"fleet ({cfg.topic_prefix}{run}); -o json has hosts, pids and "
                         "per-partition lag")
    for col in ("member", "status"):
        table.add_column(col, overflow="fold")
    for col in ("ver", "in/out/s", "lag~", "stale", "DLQ", "idle", "seen"):
        number_column(table, col)
    for m in members:
        j = m.to_json()
        state = f"[yellow]stale[/] ({j['status']})" if m.stale else j["status"]
        staleness = ("-" if j["staleness_mean"] is None else
                     f"{j['staleness_mean']:.2f}/{_fmt(j['staleness_max'], '{:.0f}')}")
        member = (j["member_id"] if j["member_id"].startswith(f"{j['role']}-")
                  else f"{j['member_id']} ({j['role']})")
        table.add_row(member, state, str(j["policy_version"]),
                      f"{compact(j['rates'].get('in_per_s'))}/{compact(j['rates'].get('out_per_s'))}",
                      compact(j["lag_total"]), staleness, compact(j["dead_lettered"]),
                      duration(j["idle_s"]), duration(j["age_s"]))
    table.caption = ("ver: policy version; in/out/s: events per second; lag~: approximate "
                     "(broker watermarks); stale: mean/max staleness of the trainer's last "
                     "step; idle: since it last moved; seen: since its last heartbeat")
    foreign = sum(m.to_json()["foreign"] for m in members)
    if foreign:  # e.g. an earlier run's weights on the same prefix: skipped, not forgeries
        table.caption += f"; {foreign} events of other runs skipped"
    if not members:
        table.caption = "no heartbeats on fleet.v1 (are roles running under this --prefix?)"
    console.print(table)
    _stall_exit(alarm)


def _stall_exit(alarm: str | None) -> None:
    """The stall alarm goes to stderr with exit code 4, so scripts and monitors see it."""
    if alarm:
        import sys

        sys.stderr.write(f"ALARM: {alarm}\n")
        raise typer.Exit(4)


# ---------------------------------------------------------------------- commands


def _command(command: str, target: str, *, args: dict | None = None, timeout_s: float,
             output: str, run_id: str | None = None, members=None) -> dict:
    """Check the target against the live fleet, send, wait for acks, report; raise when
    a member did not acknowledge or refused."""
    from ..bus.fleet import (
        ControlError,
        check_signing,
        read_fleet,
        resolve_target,
        send_command,
    )

    cfg = bus_config()
    # --run-dir: that run's members, and a command only they obey (other runs skip it).
    run_id = run_id or (rid if names_a_run(rid := run_dir_run_id()) else None)
    chosen = resolve_target(members if members is not None else read_fleet(
        cfg, run_id=run_id or ANY_RUN), target)
    check_signing(cfg, chosen)
    expect = [m.event.member_id for m in chosen]
    event, acks = send_command(cfg, command, target, expect, args=args, timeout_s=timeout_s,
                               run_id=run_id)
    rows = [{"member_id": mid, "acked": mid in acks, "ok": acks[mid].ok if mid in acks else None,
             "message": (acks[mid].message if mid in acks
                         else f"no acknowledgement within {timeout_s:g} s"),
             "acked_at": acks[mid].produced_at if mid in acks else None}
            for mid in expect]
    report = {"command_id": event.command_id, "command": command, "target": target,
              "args": event.args, "acks": rows}
    if output == "json":
        emit_json(report)
    else:
        table = Table("member", "ok", "message", title=f"{command} {target}")
        for r in rows:
            mark = "[green]yes[/]" if r["ok"] else "[red]no[/]" if r["acked"] else "[yellow]?[/]"
            table.add_row(r["member_id"], mark, r["message"])
        console.print(table)
    missing = [r["member_id"] for r in rows if not r["acked"]]
    refused = [f"{r['member_id']}: {r['message']}" for r in rows if r["acked"] and not r["ok"]]
    if missing:
        raise ControlError(f"{len(missing)} of {len(rows)} member(s) did not acknowledge "
                           f"`{command}` within {timeout_s:g} s: {', '.join(missing)} "
                           "(busy in a long step? raise --timeout; `tapioca status` shows them)")
    if refused:
        raise ControlError(f"`{command}` refused by " + "; ".join(refused))
    return report


def _control_command(command: str, doc: str):
    def run(
        target: str = typer.Argument(..., help="A role (e.g. rollout), a member id "
                                     "(e.g. rollout-0, see `tapioca status`) or all."),
        timeout: float = typer.Option(10.0, "--timeout", help=TIMEOUT_HELP),
        output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
    ) -> None:
        check_output(output)
        _command(command, target, timeout_s=timeout, output=output)

    run.__doc__ = doc
    app.command(command)(run)


_control_command("pause", "Pause members: their input partitions are paused and the role "
                 "is handed no events and no ticks (nothing is published) until `resume`.")
_control_command("resume", "Resume paused members.")
_control_command("drain", "Drain members: they take no new input, finish their in-flight "
                 "work, commit, report status stopped and exit.")


@app.command("reward", context_settings={"ignore_unknown_options": True})  # VALUE may be -1
def reward(
    session_id: str = typer.Argument(..., help="The session (sess-..., from POST /v1/sessions)."),
    value: float = typer.Argument(..., help="The reward: a finite number within +-1e9."),
    timeout: float = typer.Option(10.0, "--timeout", help=TIMEOUT_HELP),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Reward an ended agent session (online mode: seconds to days after its end): the
    signed `reward` command to the run's proxy, which publishes the session's rewards (as
    POST /v1/sessions/SESSION_ID/reward with the admin key would). Refused with the
    proxy's reason: an unknown or expired session, a second reward (docs/online.md)."""
    import math

    from ..bus.fleet import ControlError, read_fleet

    check_output(output)
    if not math.isfinite(value):
        raise typer.BadParameter(f"the reward must be a finite number, not {value}")
    live = [m for m in read_fleet(bus_config()) if m.event.role == "proxy-sessions" and m.live]
    if not live:
        raise ControlError("no proxy of this run is running (no live proxy-sessions member in "
                           "`tapioca status`): start the run (`tapioca train` with agent.mode "
                           "online), check --run-dir / --prefix, or POST the reward to "
                           "/v1/sessions/SESSION_ID/reward")
    newest = max(live, key=lambda m: m.event.produced_at)  # one proxy answers, not each
    _command("reward", newest.event.member_id, args={"session_id": session_id, "reward": value},
             timeout_s=timeout, output=output, members=[newest])


# ---------------------------------------------------------------------- weights


def _weights(cfg, run: Optional[str]) -> tuple[str, dict[int, dict]]:
    """(run id, version -> its latest weights event as a dict with rollback_of carried
    over from any announcement of that version) for one run on the weights topic."""
    from ..bus.reader import read_events
    from ..schemas.events import WeightsEvent

    events = [e for e in read_events(cfg, "weights", idle_s=0.3) if isinstance(e, WeightsEvent)]
    if not events:
        raise TapiocaError(f"no weights events on {cfg.topic_prefix}.weights.v1: has a trainer "
                           "run under this --prefix?")
    run_id = run or max(events, key=lambda e: e.produced_at).run_id
    versions: dict[int, dict] = {}
    for e in sorted((e for e in events if e.run_id == run_id), key=lambda e: e.produced_at):
        prev = versions.get(e.version) or {}
        row = {"version": e.version, "path": e.path or prev.get("path", ""),
               "sha256": e.sha256 or prev.get("sha256", ""), "time": e.produced_at,
               "rollback_of": e.rollback_of if e.rollback_of is not None
               else prev.get("rollback_of"), "step": e.step, "num_bytes": e.num_bytes,
               "run_id": e.run_id, "transport": e.transport}
        versions[e.version] = row
        # Fast transports: a version's durable file is announced by a later event.
        for f in e.files:
            if f.version in versions:
                versions[f.version].update(path=f.path, sha256=f.sha256, num_bytes=f.num_bytes)
    if not versions:
        raise TapiocaError(f"no weights events of run {run_id!r}; runs on this topic: "
                           f"{', '.join(sorted({e.run_id for e in events}))}")
    return run_id, versions


def shown_versions(rows: list[dict], last: int, all_versions: bool) -> list[dict]:
    """What `weights list` shows (rows in version order): every version with ``--all``,
    else the newest ``last`` and every older one whose file is on disk here (what a
    rollback can go back to; the trainer deletes all but weights.keep_versions files)."""
    if all_versions:
        return rows
    newest = {r["version"] for r in rows[-last:]} if last > 0 else set()
    return [r for r in rows if r["version"] in newest or r["on_disk"]]


@weights_app.command("list")
def weights_list(
    run: Optional[str] = typer.Option(None, "--run", help="Run id (default: the run of the "
                                      "newest weights event)."),
    last: int = typer.Option(10, "--last", help="Show the newest N versions, and the older "
                             "ones whose file is on disk here."),
    all_versions: bool = typer.Option(False, "--all", help="Every version ever published."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Published policy versions (path, sha256, time, rollback_of): the newest --last N
    and those whose weights file is on disk here, or every one with --all."""
    from pathlib import Path

    check_output(output)
    if last < 0:
        raise typer.BadParameter("--last must be >= 0")
    run_id, versions = _weights(bus_config(), run)
    every = [{**v, "on_disk": bool(v["path"]) and Path(v["path"]).exists()}
             for _, v in sorted(versions.items())]
    rows = shown_versions(every, last, all_versions)
    if output == "json":
        emit_json(rows)
        return
    dirs = {str(Path(r["path"]).parent) for r in rows if r["path"]}
    hidden = len(every) - len(rows)
    table = Table("version", "time", "sha256", "rollback_of", "file", "on disk here",
                  title=f"weights of run {run_id}"
                  + (f" in {dirs.pop()}" if len(dirs) == 1 else ""),
                  caption=(f"{len(rows)} of {len(every)} versions: the newest {last} and those "
                           "on disk here; --all shows every one. " if hidden else "")
                  + "The trainer keeps only the last weights.keep_versions files "
                    "(ipc / nccl: every weights.file_every_versions-th version has "
                    "one); -o json has full paths")
    for r in rows:
        table.add_row(str(r["version"]), _when(r["time"]),
                      r["sha256"][:12] + "…" if r["sha256"] else "-",
                      "-" if r["rollback_of"] is None else str(r["rollback_of"]),
                      (Path(r["path"]).name if len(dirs) <= 1 else r["path"]) or "-",
                      "yes" if r["on_disk"] else "no")
    console.print(table)


@weights_app.command("rollback")
def weights_rollback(
    version: int = typer.Argument(..., help="The earlier version to make current again."),
    run: Optional[str] = typer.Option(None, "--run", help="Run id (default: the newest run)."),
    timeout: float = typer.Option(60.0, "--timeout", help=TIMEOUT_HELP),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Republish VERSION's weights as a NEW version (current + 1, with rollback_of =
    VERSION): the trainer loads and checksums the file, publishes, and checkpoints."""
    check_output(output)
    cfg = bus_config()
    run_id, versions = _weights(cfg, run)
    if version not in versions:
        known = sorted(versions)
        raise TapiocaError(f"run {run_id} has no version {version} on the weights topic; "
                           f"published versions: {known[0]}..{known[-1]}")
    target = versions[version]
    if not target["sha256"]:
        raise TapiocaError(f"version {version} of run {run_id} has no durable weights file on "
                           "the log (ipc / nccl write one every weights.file_every_versions "
                           "versions, in the background); roll back to a version that has one "
                           "(`tapioca weights list`)")
    _command("rollback", "trainer", args={"version": version, "sha256": target["sha256"]},
             timeout_s=timeout, output=output, run_id=run_id if names_a_run(run_id) else None)


# ---------------------------------------------------------------------- dlq


def _dead_letters(cfg) -> list:
    from ..bus.reader import TopicReader
    from ..schemas.events import DlqRecord

    with TopicReader(cfg, "dlq") as reader:
        return [r for r in reader.records(idle_s=0.3, timeout_s=60)
                if isinstance(r.event, DlqRecord)]


def _dlq_json(record, *, full: bool = False) -> dict:
    e = record.event
    out = {"offset": record.source.offset, "time": e.produced_at, "source_topic": e.source_topic,
           "source_partition": e.source_partition, "source_offset": e.source_offset,
           "source_key": e.source_key, "error_type": e.error_type,
           "error": e.error if full else e.error[:200], "consumer_group": e.consumer_group,
           "attempts": e.attempts, "payload_bytes": len(base64.b64decode(e.payload_b64)),
           "payload_truncated": e.payload_truncated}
    if full:
        payload = base64.b64decode(e.payload_b64)
        try:
            out["payload"] = orjson.loads(payload)
        except orjson.JSONDecodeError:
            out["payload_text"] = payload[:4000].decode(errors="replace")
    return out


def _matches_source(cfg, record, source: Optional[str]) -> bool:
    if not source:
        return True
    from ..bus.reader import _full_name

    return record.event.source_topic == _full_name(cfg, source)


@dlq_app.command("list")
def dlq_list(
    source: Optional[str] = typer.Option(None, "--source", help="Only dead letters of this "
                                         "topic (e.g. trajectories or its full name)."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Dead letters on dlq.v1: where each came from and why it failed."""
    check_output(output)
    cfg = bus_config()
    rows = [_dlq_json(r) for r in _dead_letters(cfg) if _matches_source(cfg, r, source)]
    if output == "json":
        emit_json(rows)
        return
    table = Table("offset", "time", "source", "group", "error", "attempts", "payload",
                  title=f"{cfg.topic_prefix}.dlq.v1")
    for r in rows:
        table.add_row(str(r["offset"]), _when(r["time"]),
                      f"{r['source_topic']}[{r['source_partition']}]@{r['source_offset']}",
                      r["consumer_group"], f"{r['error_type']}: {r['error'][:80]}",
                      str(r["attempts"]), f"{r['payload_bytes']} B"
                      + (" (truncated)" if r["payload_truncated"] else ""))
    if not rows:
        table.caption = "no dead letters"
    console.print(table)


@dlq_app.command("show")
def dlq_show(
    offset: int = typer.Argument(..., help="The dead letter's offset on dlq.v1 (`dlq list`)."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """One dead letter in full: the error and the original payload, decoded."""
    check_output(output)
    cfg = bus_config()
    found = [r for r in _dead_letters(cfg) if r.source.offset == offset]
    if not found:
        raise TapiocaError(f"no dead letter at offset {offset} of {cfg.topic_prefix}.dlq.v1; "
                           "`tapioca dlq list` shows the offsets")
    row = _dlq_json(found[0], full=True)
    if output == "json":
        emit_json(row)
        return
    for key, value in row.items():
        if key not in ("payload", "payload_text"):
            console.print(f"[bold]{key}[/]: {value}")
    console.print("[bold]payload[/]:")
    if "payload" in row:
        console.print_json(orjson.dumps(row["payload"]).decode())
    else:
        console.print(row.get("payload_text", ""))


def _retry_marker(cfg, dlq_offset: int) -> bytes:
    return f"{cfg.topic_prefix}.dlq.v1@{dlq_offset}".encode()


def _already_retried(cfg, letters: list) -> set[int]:
    """The dlq.v1 offsets among ``letters`` whose payload was republished before: the
    source topics are read for records carrying their ``tapioca.retry_of`` marker."""
    from ..bus.reader import TopicReader

    wanted = {_retry_marker(cfg, r.source.offset): r.source.offset for r in letters}
    found: set[int] = set()
    for name in sorted({r.event.source_topic for r in letters}):
        try:
            with TopicReader(cfg, name) as reader:
                for record in reader.records(idle_s=0.3, timeout_s=60, decode=False):
                    for key, value in record.headers:
                        if key == "tapioca.retry_of" and value in wanted:
                            found.add(wanted[value])
        except TapiocaError:  # the source topic is gone: nothing to compare against
            continue
    return found


def _duplicate_letters(letters: list) -> dict[int, int]:
    """For each dead letter of a record that an earlier one in ``letters`` (lower dlq.v1
    offset) also dead-lettered -- the same source topic, partition and offset: one
    letter per consumer group that failed on it -- the earlier one's offset. A record is
    republished once however many groups dead-lettered it. Letters without a source
    position (an event found bad in a tick, offset -1) are never merged."""
    first: dict[tuple[str, int, int], int] = {}
    duplicate_of: dict[int, int] = {}
    for r in sorted(letters, key=lambda r: r.source.offset):
        e = r.event
        if e.source_offset < 0 or not e.payload_b64 or e.payload_truncated:
            continue
        where = (e.source_topic, e.source_partition, e.source_offset)
        if where in first:
            duplicate_of[r.source.offset] = first[where]
        else:
            first[where] = r.source.offset
    return duplicate_of


@dlq_app.command("retry")
def dlq_retry(
    source: Optional[str] = typer.Option(None, "--source", help="Only dead letters of this topic."),
    offsets: list[int] = typer.Option([], "--offset", help="Only the dead letter at this "
                                      "dlq.v1 offset (repeatable)."),
    all_: bool = typer.Option(False, "--all", help="Retry every dead letter (no filter)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be republished."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Republish dead letters' original payloads to their source topics (original key),
    e.g. after fixing what made their handler fail. Consumers de-duplicate by event
    identity, so a retry of an event that was in fact handled changes nothing. A dead
    letter retried before (its source topic holds a record marked ``tapioca.retry_of``
    with its offset) is republished again, with a warning listing such letters. A record
    that several consumer groups dead-lettered (one letter each, the same source topic,
    partition and offset) is republished once, for the first of its letters."""
    import sys

    from ..bus.producer import EventProducer

    check_output(output)
    if not (source or offsets or all_):
        raise typer.BadParameter("choose what to retry: --source TOPIC, --offset N, or --all")
    cfg = bus_config()
    chosen = [r for r in _dead_letters(cfg) if _matches_source(cfg, r, source)
              and (not offsets or r.source.offset in offsets)]
    missing = sorted(set(offsets) - {r.source.offset for r in chosen})
    if missing:
        raise TapiocaError(f"no dead letter at dlq.v1 offset(s) {missing}"
                           + (f" from {source}" if source else "") + "; see `tapioca dlq list`")
    before = _already_retried(cfg, [r for r in chosen if r.event.payload_b64
                                    and not r.event.payload_truncated])
    if before:
        sys.stderr.write(
            f"warning: dead letter(s) at dlq.v1 offset(s) {sorted(before)} were retried "
            "before (their source topics hold records marked tapioca.retry_of); they are "
            "republished again: consumers de-duplicate, so a handled event changes nothing"
            + (" (dry run: nothing is republished)" if dry_run else "") + "\n")
    duplicate_of = _duplicate_letters(chosen)
    results = []
    with EventProducer(cfg, f"tapioca-dlq-retry-{cfg.client_id}") as producer:
        for r in chosen:
            e = r.event
            row = {"offset": r.source.offset, "source_topic": e.source_topic,
                   "source_offset": e.source_offset,
                   "retried_before": r.source.offset in before}
            if r.source.offset in duplicate_of:
                first = duplicate_of[r.source.offset]
                row.update(retried=False, duplicate_of=first,
                           reason=f"the same record as the dead letter at @{first} (another "
                                  "consumer group's); republished once")
            elif e.payload_truncated:
                row.update(retried=False, reason="payload was truncated in the dead letter; the "
                           f"original is at {e.source_topic}[{e.source_partition}]"
                           f"@{e.source_offset} (while retention keeps it)")
            elif not e.payload_b64:
                row.update(retried=False, reason="the dead letter has no payload")
            else:
                if not dry_run:
                    producer.publish_raw(
                        e.source_topic, e.source_key.encode() if e.source_key is not None else None,
                        base64.b64decode(e.payload_b64),
                        [("tapioca.retry_of", _retry_marker(cfg, r.source.offset))])
                row.update(retried=not dry_run, reason="dry run" if dry_run else "republished")
            results.append(row)
    if output == "json":
        emit_json(results)
    else:
        table = Table("dlq offset", "to", "retried", "note", title="dlq retry")
        for row in results:
            table.add_row(str(row["offset"]),
                          f"{row['source_topic']} (was @{row['source_offset']})",
                          "yes" if row["retried"] else "no", row["reason"])
        if not results:
            table.caption = "nothing matched"
        console.print(table)
    skipped = [row for row in results if not row["retried"] and not dry_run
               and "duplicate_of" not in row]
    if skipped:
        raise TapiocaError(f"{len(skipped)} dead letter(s) could not be retried: "
                           + "; ".join(f"@{row['offset']}: {row['reason']}" for row in skipped))
