"""Readable renderings of records for `tapioca tail` (table rows and JSON lines), and
the narrow table and compact numbers that keep `tapioca train`'s live table and
`tapioca status` whole on an 80-column terminal."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from rich import box
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


# ---------------------------------------------------------------------- narrow tables


def narrow_table(title: str | None = None) -> Table:
    """A table for 80 columns: no borders, a rule under the header, two spaces between
    columns. Its number columns come from :func:`number_column` (never wrapped), so a
    narrow terminal wraps the text columns and headers, never a number."""
    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 padding=(0, 0, 0, 1), expand=False, caption_justify="left")


def number_column(table: Table, header: str) -> None:
    table.add_column(header, justify="right", no_wrap=True)


def compact(value: Any, digits: int = 1) -> str:
    """A rate or a count in at most 5 characters: 950, 1.2k, 123k, 4.5M ("-" when it is
    not a number)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            v = value / scale
            return f"{v:.{digits if abs(v) < 10 else 0}f}{suffix}"
    return f"{value:.0f}" if abs(value) >= 10 or float(value).is_integer() else f"{value:.{digits}f}"


def duration(seconds: float | None) -> str:
    """``45s``, ``12m05s``, ``3h20m``; ``-`` for None."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
