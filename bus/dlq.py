"""Dead letters: a bad event becomes a :class:`DlqRecord` on ``dlq.v1`` and the loop
goes on. The record's Kafka headers carry the error and the source coordinates too, so
tools that do not decode the body can still route and count them."""

from __future__ import annotations

import base64

from ..schemas.events import DlqRecord
from .role import Source

# Keep a dead letter well under any limit; the source coordinates locate the original.
MAX_DLQ_PAYLOAD_BYTES = 1024 * 1024


def dead_letter(
    raw: bytes | None, source: Source, error: BaseException, *, consumer_group: str,
    attempts: int = 1,
) -> tuple[DlqRecord, list[tuple[str, bytes]]]:
    payload = raw or b""
    truncated = len(payload) > MAX_DLQ_PAYLOAD_BYTES
    if truncated:
        payload = payload[:MAX_DLQ_PAYLOAD_BYTES]
    message = str(error) or type(error).__name__
    record = DlqRecord(
        source_topic=source.topic,
        source_partition=source.partition,
        source_offset=source.offset,
        source_key=source.key,
        error=message[:4000],
        error_type=type(error).__name__,
        consumer_group=consumer_group,
        payload_b64=base64.b64encode(payload).decode(),
        payload_truncated=truncated,
        attempts=attempts,
    )
    headers = [
        ("tapioca.error", message[:1000].encode()),
        ("tapioca.error_type", type(error).__name__.encode()),
        ("tapioca.source_topic", source.topic.encode()),
        ("tapioca.source_partition", str(source.partition).encode()),
        ("tapioca.source_offset", str(source.offset).encode()),
        ("tapioca.consumer_group", consumer_group.encode()),
    ]
    return record, headers


def original_payload(record: DlqRecord) -> bytes:
    return base64.b64decode(record.payload_b64)
