"""The Parquet archive of a run: the file format, its writer and its readers.

Layout: ``<dir>/<full topic name>/part-<partition>-<first_offset>-<last_offset>.parquet``
(offsets zero-padded to 20 digits so names sort like the offsets). One file holds the
records of one topic partition in offset order. Files appear atomically: written to a
dot-prefixed temporary name in the same directory, fsynced, then renamed, so readers
(pyarrow, pandas, DuckDB all skip dot-files) never see a half-written file.

Every file has the same schema (:data:`ARCHIVE_SCHEMA`): the record's coordinates
(``topic``, ``partition``, ``offset``, ``timestamp_ms``, ``key``), the envelope
(``type``, ``schema_version``, ``event_id``, ``run_id``, ``producer_id``,
``produced_at``), a few flattened payload fields for filtering without parsing JSON
(``group_id``, ``traj_id``, ``scorer``, ``min_version``, ``max_version``, ``reward``),
and ``payload``: the whole event as its JSON envelope, which
:func:`tapioca.schemas.envelope.decode_event` turns back into the typed event.

Plain tools read it directly::

    pyarrow.dataset.dataset("archive/").to_table()
    pandas.read_parquet("archive/")
    duckdb.sql("select type, count(*) from 'archive/*/*.parquet' group by 1")

A crash between writing a file and committing its offsets makes the archiver write
the same records again (at-least-once), possibly into a file with other bounds. The
readers here drop repeated ``(topic, partition, offset)`` coordinates, so they yield
every archived record exactly once.

Damaged files. The readers check every file against :data:`ARCHIVE_SCHEMA` before
they use a row: its columns' names and types (from the footer: a column stored as
strings where offsets are int64 is refused before a row is read; integer and float
widths are cast), and no null where the schema has none (from the footer's statistics,
then from the data). A file that fails is an :class:`ArchiveError` naming the file and
the column; with a :class:`Damaged` (``--skip-damaged`` of `tapioca replay` and
`tapioca train-offline`) it is skipped and counted instead, as is a record whose
payload does not decode, and everything else is read.
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..schemas.envelope import Event, decode_event
from ..schemas.errors import SchemaError, TapiocaError
from ..schemas.events import (
    FleetEvent,
    MetricsEvent,
    ProgressEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    TrajectoryEvent,
    WeightsEvent,
)
from ..schemas.registry import topic as topic_spec
from .role import Source

ARCHIVE_SCHEMA = pa.schema([
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    # Kafka record timestamp (producer create time), milliseconds since the epoch.
    pa.field("timestamp_ms", pa.int64(), nullable=False),
    pa.field("key", pa.string()),
    pa.field("type", pa.string(), nullable=False),
    pa.field("schema_version", pa.int32(), nullable=False),
    pa.field("event_id", pa.string(), nullable=False),
    pa.field("run_id", pa.string(), nullable=False),
    pa.field("producer_id", pa.string()),
    pa.field("produced_at", pa.float64()),
    pa.field("group_id", pa.string()),
    pa.field("traj_id", pa.string()),
    pa.field("scorer", pa.string()),
    # Policy versions the event is about (see :func:`flat_fields`); null when none.
    pa.field("min_version", pa.int64()),
    pa.field("max_version", pa.int64()),
    # A reward's value; a sample group's mean reward; null otherwise.
    pa.field("reward", pa.float64()),
    pa.field("payload", pa.string(), nullable=False),
], metadata={b"tapioca.archive_format": b"1"})

_FILE_RE = re.compile(r"^part-(\d+)-(\d+)-(\d+)\.parquet$")

log = logging.getLogger(__name__)


class ArchiveError(TapiocaError):
    """An archive file cannot be written or read."""


def flat_fields(event: Event) -> dict[str, Any]:
    """The flattened columns of one event: what filters and queries use without JSON.

    Versions: a trajectory's min/max ``output_versions``; a sample's ``min_version`` /
    ``max_version``; a weights or progress event's ``version``; a prompt's ``admitted_at_version``;
    fleet and metrics events' ``policy_version``. Reward: a reward event's value, a
    sample group's mean sequence reward.
    """
    lo = hi = None
    reward = None
    if isinstance(event, TrajectoryEvent):
        if event.output_versions:
            lo, hi = min(event.output_versions), max(event.output_versions)
    elif isinstance(event, SampleEvent):
        lo, hi = event.min_version, event.max_version
        if event.sequences:
            reward = sum(s.reward for s in event.sequences) / len(event.sequences)
    elif isinstance(event, (WeightsEvent, ProgressEvent)):
        lo = hi = event.version
    elif isinstance(event, PromptEvent):
        lo = hi = event.admitted_at_version
    elif isinstance(event, (FleetEvent, MetricsEvent)):
        lo = hi = event.policy_version
    if isinstance(event, RewardEvent):
        reward = event.reward
    return {
        "group_id": getattr(event, "group_id", None),
        "traj_id": getattr(event, "traj_id", None),
        "scorer": event.scorer if isinstance(event, RewardEvent) else None,
        "min_version": lo,
        "max_version": hi,
        "reward": reward,
    }


def archive_row(source: Source, event: Event, payload: bytes | str) -> dict[str, Any]:
    """One archive row for an event read at ``source`` (``payload``: its JSON)."""
    return {
        "topic": source.topic,
        "partition": source.partition,
        "offset": source.offset,
        "timestamp_ms": source.timestamp_ms,
        "key": source.key,
        "type": event.type,
        "schema_version": event.schema_version,
        "event_id": event.event_id,
        "run_id": event.run_id,
        "producer_id": event.producer_id,
        "produced_at": event.produced_at,
        **flat_fields(event),
        "payload": payload.decode() if isinstance(payload, bytes) else payload,
    }


def file_name(partition: int, first_offset: int, last_offset: int) -> str:
    return f"part-{partition:05d}-{first_offset:020d}-{last_offset:020d}.parquet"


def write_file(directory: Path, rows: list[dict[str, Any]], *, compression: str = "zstd") -> Path:
    """Write one partition's rows (offset order) as a file, atomically and durably."""
    if not rows:
        raise ArchiveError("refusing to write an empty archive file")
    first, last = rows[0], rows[-1]
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / file_name(first["partition"], first["offset"], last["offset"])
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    table = pa.Table.from_pylist(rows, schema=ARCHIVE_SCHEMA)
    try:
        with open(tmp, "wb") as fh:
            pq.write_table(table, fh, compression=compression)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ArchiveError(f"cannot write {final}: {exc}; check free space and permissions "
                           "of archive.dir") from exc
    return final


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- writer


@dataclass
class _Buffer:
    rows: list[dict[str, Any]] = field(default_factory=list)
    nbytes: int = 0
    opened: float = 0.0  # monotonic time of the first buffered row


class ArchiveWriter:
    """Buffers rows per topic partition and rolls each buffer into a file when it
    reaches ``roll_bytes`` (payload bytes) or has been open ``roll_interval_s``.

    :meth:`safe_offset` is what may be committed for a partition: everything before
    its oldest row still in memory, i.e. only offsets that are in a durable file.
    """

    def __init__(self, directory: str | Path, *, roll_bytes: int = 64 << 20,
                 roll_interval_s: float = 60.0, compression: str = "zstd") -> None:
        self.dir = Path(directory)
        self.roll_bytes = roll_bytes
        self.roll_interval_s = roll_interval_s
        self.compression = compression
        self._buffers: dict[tuple[str, int], _Buffer] = {}
        self.files_written = 0
        self.rows_written = 0
        self.dir.mkdir(parents=True, exist_ok=True)

    def add(self, source: Source, event: Event, payload: bytes) -> Path | None:
        """Buffer one event; returns the file written if this row filled the buffer."""
        tp = (source.topic, source.partition)
        buf = self._buffers.get(tp)
        if buf is None:
            buf = self._buffers[tp] = _Buffer(opened=time.monotonic())
        buf.rows.append(archive_row(source, event, payload))
        buf.nbytes += len(payload)
        if buf.nbytes >= self.roll_bytes:
            return self.flush(tp)
        return None

    def flush(self, tp: tuple[str, int]) -> Path | None:
        buf = self._buffers.pop(tp, None)
        if buf is None or not buf.rows:
            return None
        path = write_file(self.dir / tp[0], buf.rows, compression=self.compression)
        self.files_written += 1
        self.rows_written += len(buf.rows)
        return path

    def flush_due(self, now_monotonic: float | None = None) -> list[Path]:
        now = time.monotonic() if now_monotonic is None else now_monotonic
        due = [tp for tp, b in self._buffers.items() if now - b.opened >= self.roll_interval_s]
        return [p for tp in due if (p := self.flush(tp)) is not None]

    def flush_all(self) -> list[Path]:
        return [p for tp in list(self._buffers) if (p := self.flush(tp)) is not None]

    def discard(self, partitions: Iterable[tuple[str, int]]) -> int:
        """Forget buffered rows of partitions this member lost: their new owner reads
        them again from the committed offset. Returns how many rows were dropped."""
        dropped = 0
        for tp in partitions:
            buf = self._buffers.pop(tp, None)
            dropped += len(buf.rows) if buf else 0
        return dropped

    def safe_offset(self, topic: str, partition: int, next_offset: int) -> int:
        buf = self._buffers.get((topic, partition))
        if buf and buf.rows:
            return min(next_offset, buf.rows[0]["offset"])
        return next_offset

    @property
    def buffered_rows(self) -> int:
        return sum(len(b.rows) for b in self._buffers.values())


# ---------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class ArchivedRecord:
    """One archive row. ``payload`` is the event's JSON envelope; :meth:`event`
    decodes it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: str | None
    type: str
    schema_version: int
    event_id: str
    run_id: str
    producer_id: str | None
    produced_at: float | None
    group_id: str | None
    traj_id: str | None
    scorer: str | None
    min_version: int | None
    max_version: int | None
    reward: float | None
    payload: str

    @property
    def source(self) -> Source:
        return Source(self.topic, self.partition, self.offset, self.key, self.timestamp_ms)

    def event(self) -> Event:
        try:
            return decode_event(self.payload.encode())
        except SchemaError as exc:
            raise SchemaError(f"archived record {self.topic}[{self.partition}]@{self.offset}: "
                              f"{exc}") from None


def archive_files(path: str | Path) -> list[Path]:
    """The archive files under ``path`` (a directory or one file), skipping files
    being written (dot-prefixed)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ArchiveError(f"archive {p} does not exist; pass the archive directory "
                           "(archive.dir) or one .parquet file of it")
    return sorted(f for f in p.rglob("*.parquet")
                  if not any(part.startswith((".", "_")) for part in f.relative_to(p).parts))


def _topic_matches(full: str, wanted: set[str] | None) -> bool:
    if wanted is None:
        return True
    if full in wanted:
        return True
    try:
        return topic_spec(full).name in wanted
    except SchemaError:
        return False


def _file_order(f: Path) -> tuple[str, int, int]:
    m = _FILE_RE.match(f.name)
    if m:
        return (f.parent.name, int(m.group(1)), int(m.group(2)))
    return (f.parent.name, -1, -1)  # foreign name: its rows are sorted after reading


@dataclass
class Damaged:
    """What the readers skipped instead of raising (``--skip-damaged``): damaged files
    (path -> why, each once however often it is read) and records whose payload does
    not decode (their ``(topic, partition, offset)``)."""

    files: dict[str, str] = field(default_factory=dict)
    records: set[tuple[str, int, int]] = field(default_factory=set)

    def skip_file(self, f: Path, error: ArchiveError) -> None:
        if str(f) not in self.files:
            self.files[str(f)] = str(error)
            log.warning("skipped (--skip-damaged): %s", error)

    def skip_record(self, rec: "ArchivedRecord", error: Exception) -> None:
        key = (rec.topic, rec.partition, rec.offset)
        if key not in self.records:
            self.records.add(key)
            log.warning("skipped (--skip-damaged): %s", error)


def _damaged(f: Path, what: str) -> ArchiveError:
    return ArchiveError(f"{f}: {what}; the file is damaged or was not written by Tapioca's archiver "
                        "(its Parquet structure is valid): move it out of the archive, or pass "
                        "--skip-damaged to read everything else")


def _fits(actual: pa.DataType, expected: pa.DataType, nullable: bool) -> bool:
    """Whether a column of type ``actual`` holds the values of ``expected`` (widths may
    differ: they are cast)."""
    if actual == expected or (nullable and pa.types.is_null(actual)):
        return True
    if pa.types.is_integer(expected):
        return pa.types.is_integer(actual)
    if pa.types.is_floating(expected):
        return pa.types.is_floating(actual) or pa.types.is_integer(actual)
    if pa.types.is_string(expected):
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    return False


def _check_schema(f: Path, schema: pa.Schema) -> None:
    """The columns' names and types against :data:`ARCHIVE_SCHEMA`."""
    missing = set(ARCHIVE_SCHEMA.names) - set(schema.names)
    if missing:
        raise ArchiveError(f"{f} is not a Tapioca archive file (missing columns "
                           f"{sorted(missing)})")
    for want in ARCHIVE_SCHEMA:
        got = schema.field(want.name).type
        if not _fits(got, want.type, want.nullable):
            raise _damaged(f, f"column {want.name!r} holds {got}, not {want.type}")


def _open_checked(f: Path) -> pq.ParquetFile:
    """The file, its footer checked: the columns' types, and (where the writer kept
    statistics) no nulls in a column that allows none."""
    try:
        pf = pq.ParquetFile(f)
        _check_schema(f, pf.schema_arrow)
        md = pf.metadata
        leaf = {md.schema.column(j).path: j for j in range(md.num_columns)}
        for want in ARCHIVE_SCHEMA:
            j = leaf.get(want.name)
            if want.nullable or j is None:
                continue
            nulls = 0
            for i in range(md.num_row_groups):
                stats = md.row_group(i).column(j).statistics
                if stats is not None and stats.has_null_count:
                    nulls += stats.null_count
            if nulls:
                raise _damaged(f, f"column {want.name!r} has {nulls} null value(s) (every row needs one)")
    except ArchiveError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"cannot read archive file {f}: {exc}") from None
    return pf


def _read_rows(f: Path) -> list[dict[str, Any]]:
    try:
        # ParquetFile, not read_table: no pyarrow.dataset import (a second of start-up).
        table = _open_checked(f).read(columns=ARCHIVE_SCHEMA.names)
    except ArchiveError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"cannot read archive file {f}: {exc}") from None
    columns = []
    for want in ARCHIVE_SCHEMA:
        col = table.column(want.name)
        if not want.nullable and col.null_count:
            raise _damaged(f, f"column {want.name!r} has {col.null_count} null value(s) (every row needs one)")
        if col.type != want.type:
            try:
                col = col.cast(want.type, safe=True)
            except pa.ArrowException as exc:
                raise _damaged(f, f"column {want.name!r} ({table.column(want.name).type}) does not fit "
                                  f"{want.type}: {exc}") from None
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=ARCHIVE_SCHEMA).to_pylist()


def _rows_or_skip(f: Path, damaged: Damaged | None) -> list[dict[str, Any]]:
    try:
        return _read_rows(f)
    except ArchiveError as exc:
        if damaged is None:
            raise
        damaged.skip_file(f, exc)
        return []


def _partition_streams(path: str | Path, topics: set[str] | None
                       ) -> dict[tuple[str, int], list[Path]]:
    """Files per (topic dir, partition), in first-offset order."""
    by_tp: dict[tuple[str, int], list[Path]] = {}
    for f in sorted(archive_files(path), key=_file_order):
        t, part, _ = _file_order(f)
        if topics is not None and part >= 0 and not _topic_matches(t, topics):
            continue
        by_tp.setdefault((t, part), []).append(f)
    return by_tp


def _iter_partition(files: list[Path], topics: set[str] | None,
                    damaged: Damaged | None = None) -> Iterator[ArchivedRecord]:
    """Rows of one partition's files in offset order, each offset once."""
    last: dict[tuple[str, int], int] = {}
    for f in files:
        rows = sorted(_rows_or_skip(f, damaged), key=lambda r: (r["topic"], r["partition"], r["offset"]))
        for row in rows:
            if not _topic_matches(row["topic"], topics):
                continue
            tp = (row["topic"], row["partition"])
            if row["offset"] <= last.get(tp, -1):
                continue  # written twice (a crash before the commit); keep the first
            last[tp] = row["offset"]
            yield ArchivedRecord(**row)


def count_records(path: str | Path, *, topic: str | Sequence[str] | None = None,
                  damaged: Damaged | None = None) -> int:
    """How many records the archive's files hold (of ``topic``), from the Parquet footers
    alone: a bound for a progress bar (a record written twice is read once). Every
    footer is checked (column types, nulls), so a damaged file is found before a row is
    read: an :class:`ArchiveError`, or skipped into ``damaged``."""
    topics = _normalise_topics(topic)
    total = 0
    for files in _partition_streams(path, topics).values():
        for f in files:
            try:
                total += _open_checked(f).metadata.num_rows
            except ArchiveError as exc:
                if damaged is None:
                    raise
                damaged.skip_file(f, exc)
    return total


def _normalise_topics(topic: str | Sequence[str] | None) -> set[str] | None:
    if topic is None:
        return None
    return {topic} if isinstance(topic, str) else set(topic)


def iter_records(path: str | Path, *, topic: str | Sequence[str] | None = None,
                 order: Literal["offset", "time"] = "offset",
                 damaged: Damaged | None = None) -> Iterator[ArchivedRecord]:
    """Every archived record under ``path`` (a directory or one file), once each.

    ``topic``: a base name (``"trajectories"``), a full name, or several. ``order``:
    ``"offset"`` sorts by (topic, partition, offset); ``"time"`` merges the partitions
    by record timestamp (each partition stays in offset order), which is close to the
    order a consumer of several topics saw them in. A damaged file raises
    :class:`ArchiveError` naming the file and the column, or (``damaged``) is skipped.
    """
    topics = _normalise_topics(topic)
    streams = _partition_streams(path, topics)
    if order == "offset":
        for key in sorted(streams):
            if key[1] < 0:  # foreign file names: sort their rows in memory
                yield from sorted(_iter_partition(streams[key], topics, damaged),
                                  key=lambda r: (r.topic, r.partition, r.offset))
            else:
                yield from _iter_partition(streams[key], topics, damaged)
    elif order == "time":
        iters = [_iter_partition(streams[k], topics, damaged) for k in sorted(streams)]
        yield from heapq.merge(*iters, key=lambda r: (r.timestamp_ms, r.topic, r.partition,
                                                      r.offset))
    else:
        raise ValueError(f"order must be 'offset' or 'time', got {order!r}")


def iter_events(path: str | Path, *, topic: str | Sequence[str] | None = None,
                order: Literal["offset", "time"] = "offset",
                damaged: Damaged | None = None) -> Iterator[tuple[Source, Event]]:
    """``(Source, Event)`` for every archived event, decoded with ``decode_event``;
    ordered by (topic, partition, offset) unless ``order="time"``. With ``damaged``,
    damaged files and records that do not decode are skipped into it."""
    for rec in iter_records(path, topic=topic, order=order, damaged=damaged):
        event = decoded_or_skip(rec, damaged)
        if event is not None:
            yield rec.source, event


def decoded_or_skip(rec: ArchivedRecord, damaged: Damaged | None) -> Event | None:
    """``rec.event()``; None (skipped into ``damaged``) when it does not decode."""
    try:
        return rec.event()
    except SchemaError as exc:
        if damaged is None:
            raise
        damaged.skip_record(rec, exc)
        return None


def read_table(path: str | Path, *, topic: str | Sequence[str] | None = None) -> pa.Table:
    """The archive (or one topic of it) as one pyarrow Table, each record once."""
    rows = [r.__dict__ for r in iter_records(path, topic=topic)]
    return pa.Table.from_pylist(rows, schema=ARCHIVE_SCHEMA)
