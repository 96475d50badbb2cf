"""The archiver: every topic of the run in, Parquet files out.

Consumes all registry topics (``archive.topics`` to choose fewer) as one consumer
group, ``{prefix}.archiver``: prompts, trajectories, rewards, samples, weights,
control, fleet, metrics and dead letters. Emits no events; writes
``<archive.dir>/<topic>/part-<partition>-<first_offset>-<last_offset>.parquet``
(format and readers: :mod:`tapioca.bus.archive`).

Each topic partition is buffered in memory and rolled into a file when its payloads
reach ``archive.roll_bytes`` or it has been open ``archive.roll_interval_s``. Files
are written atomically (temporary name, fsync, rename). Offsets are committed only up
to the oldest record still in memory (``committable``), so a crash loses nothing: the
records after the last durable file are read again. On a rebalance the buffers of lost
partitions are dropped; their new owner writes them.

The payload column is the event as decoded by the bus and encoded again with orjson,
which is byte-for-byte what Tapioca's producers sent (same classes, same encoder). An
event from another producer is stored in that canonical form (field order normalised,
fields unknown to this version dropped). Undecodable records never reach a role: the
bus dead-letters them, and the dead letter (with the original bytes) is archived from
``dlq.v1``.

Images (docs/vlm.md): events name their images by sha256; the archiver copies every
image an event names from the run's image store (``vlm.image_store``) into
``<archive.dir>/images`` (the same layout) before the event is written, so an archive
replays and trains offline with no access to the run's store. An image the store does
not hold is counted (``images_missing``, in the fleet status) and the event archived all
the same.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import orjson

from ..bus.archive import ArchiveError, ArchiveWriter
from ..bus.dedup import SeenSet
from ..bus.role import Role, Source
from ..config.sections import ArchiveSection
from ..media.images import ref_bytes
from ..media.store import FileImageStore, ImageStoreError, open_image_store
from ..schemas.envelope import Event
from ..schemas.errors import FatalRoleError
from ..schemas.events import FleetEvent, ImageRef, MetricsEvent, PromptEvent, SampleEvent, TrajectoryEvent
from ..schemas.registry import TOPICS

ALL_TOPICS: tuple[str, ...] = tuple(t.name for t in TOPICS)
log = logging.getLogger(__name__)


def _own_status(event: Event) -> bool:
    """An archiver's own status or heartbeat: archived like the rest, but it must not
    keep an idle archiver from finishing (it would hear itself forever)."""
    if isinstance(event, MetricsEvent):
        return any(k.startswith("archiver/") for k in event.metrics)
    return isinstance(event, FleetEvent) and event.role == "archiver"


@dataclass
class ArchiverState:
    writer: ArchiveWriter
    archived: int = 0
    discarded: int = 0
    last_event: float = field(default_factory=time.monotonic)
    assigned: bool = False
    images_copied: int = 0
    images_missing: int = 0
    # Images already in the archive (bounded: a miss only costs a lookup).
    images_seen: SeenSet = field(default_factory=lambda: SeenSet(100_000))


class Archiver(Role[ArchiverState]):
    name = "archiver"
    tick_interval_s = 0.2

    def __init__(self, section: ArchiveSection, *, exit_when_idle_s: float | None = None) -> None:
        """``section``: the ``archive`` config (topics, roll size and interval,
        compression) and the output directory."""
        a = section.archive
        self.dir = Path(section.dir)
        # Batch use (`tapioca archive --exit-when-idle-s`): stop once nothing has
        # arrived for this long since the last event or the partition assignment.
        self.exit_when_idle_s = exit_when_idle_s
        self.group_inputs = tuple(a.topics) or ALL_TOPICS
        self.roll_bytes = a.roll_bytes
        self.roll_interval_s = a.roll_interval_s
        self.compression = a.compression
        self.images = FileImageStore(self.dir / "images")
        self.image_source = open_image_store(section.image_store) if section.image_store else None

    def init_state(self) -> ArchiverState:
        try:
            writer = ArchiveWriter(self.dir, roll_bytes=self.roll_bytes,
                                   roll_interval_s=self.roll_interval_s,
                                   compression=self.compression)
        except OSError as exc:
            raise FatalRoleError(f"cannot create archive directory {self.dir}: {exc}") from exc
        return ArchiverState(writer)

    def handle(self, event: Event, state: ArchiverState, source: Source) -> Iterable[Event]:
        for ref in event_images(event):
            self._copy_image(ref, state)
        try:
            state.writer.add(source, event, orjson.dumps(event))
        except ArchiveError as exc:
            # A full disk is not fixed by retrying one event or dead-lettering it:
            # stop uncommitted, so nothing after the last durable file is lost.
            raise FatalRoleError(str(exc)) from exc
        state.archived += 1
        if not _own_status(event):
            state.last_event = time.monotonic()
        return ()

    def on_tick(self, state: ArchiverState, now: float) -> Iterable[Event]:
        try:
            state.writer.flush_due()
        except ArchiveError as exc:
            raise FatalRoleError(str(exc)) from exc
        return ()

    def _copy_image(self, ref: ImageRef, state: ArchiverState) -> None:
        if ref.sha256 in state.images_seen:
            return
        try:
            if not self.images.has(ref.sha256):
                self.images.put(ref_bytes(ref, self.image_source))
                state.images_copied += 1
            state.images_seen.first(ref.sha256)
        except ImageStoreError as exc:
            state.images_missing += 1
            log.warning("archiving without image %s: %s", ref.sha256, exc)

    def committable(self, state: ArchiverState, topic: str, partition: int,
                    next_offset: int) -> int:
        return state.writer.safe_offset(topic, partition, next_offset)

    def on_assign(self, state: ArchiverState, partitions: list[tuple[str, int]]) -> None:
        # The idle clock starts once there is something to read (a group join takes
        # seconds), not at process start.
        state.assigned = True
        state.last_event = time.monotonic()

    def on_revoke(self, state: ArchiverState, partitions: list[tuple[str, int]]) -> None:
        state.discarded += state.writer.discard(partitions)

    def on_stop(self, state: ArchiverState) -> Iterable[Event]:
        # The runner commits after on_stop: everything buffered becomes durable first.
        try:
            state.writer.flush_all()
        except ArchiveError as exc:
            raise FatalRoleError(str(exc)) from exc
        return ()

    def finished(self, state: ArchiverState) -> bool:
        return (self.exit_when_idle_s is not None and state.assigned
                and time.monotonic() - state.last_event > self.exit_when_idle_s)

    def describe(self, state: ArchiverState) -> dict[str, Any]:
        w = state.writer
        return {"archived": state.archived, "files": w.files_written, "rows": w.rows_written,
                "buffered": w.buffered_rows, "discarded": state.discarded,
                "images_copied": state.images_copied, "images_missing": state.images_missing}


def event_images(event: Event) -> list[ImageRef]:
    """The images an event names (prompts, trajectories, and a sample's sequences)."""
    if isinstance(event, (PromptEvent, TrajectoryEvent)):
        return list(event.images)
    if isinstance(event, SampleEvent):
        return [ref for seq in event.sequences for ref in seq.images]
    return []
