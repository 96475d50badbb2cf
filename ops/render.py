"""Readable renderings of records for `tapioca tail` (table rows and JSON lines)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.table import Table

from ..bus.reader import Record

_ENVELOPE = {"event_id", "type", "schema_version", "run_id", "produced_at", "producer_id"}


def _short(value: Any) -> str:
    if isinstance(value, list):
        if value and all(isinstance(v, (int, float)) for v in value):
            lo, hi = min(value), max(value)
            return f"[{len(value)}: {lo:g}..{hi:g}]" if lo != hi else f"[{len(value)}× {lo:g}]"
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        inner = ", ".join(f"{k}={_short(v)}" for k, v in list(value.items())[:4])
        return "{" + inner + (", …" if len(value) > 4 else "") + "}"
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def summary(record: Record) -> str:
    if record.error is not None:
        return f"UNDECODABLE: {record.error}"
    fields = {k: v for k, v in record.event.to_dict().items() if k not in _ENVELOPE}
    return " ".join(f"{k}={_short(v)}" for k, v in fields.items() if v not in ("", [], {}, None))


def _when(record: Record) -> str:
    ts = record.source.timestamp_ms / 1000
    return dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3] if ts > 0 else "-"


def record_row(record: Record) -> str:
    kind = record.event.type if record.event is not None else "?"
    return (f"{record.source.partition}@{record.source.offset} {_when(record)} {kind} "
            f"key={record.source.key} {summary(record)}")


def records_table(topic: str, records: list[Record]) -> Table:
    table = Table("p@offset", "time", "type", "key", "event", title=topic, expand=True)
    for r in records:
        table.add_row(f"{r.source.partition}@{r.source.offset}", _when(r),
                      r.event.type if r.event is not None else "?", str(r.source.key),
                      summary(r))
    if not records:
        table.caption = "no events"
    return table


def record_json(record: Record) -> dict[str, Any]:
    meta = {"_topic": record.source.topic, "_partition": record.source.partition,
            "_offset": record.source.offset, "_key": record.source.key}
    if record.event is not None:
        return {**meta, **record.event.to_dict()}
    return {**meta, "_error": str(record.error),
            "_raw": (record.raw or b"")[:200].decode(errors="replace")}
