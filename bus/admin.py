"""Cluster administration: reachability, topic bootstrap, descriptions and lag.

Consumer lag here is ``end offset − committed offset`` from broker watermarks. Some
Kafka-compatible brokers (Tansu) report watermarks that undercount when batches hold
several records, so lag is *approximate* there; nothing in Tapioca's logic depends on
watermarks — sequence numbers live in the events themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from ..schemas.errors import BrokerUnavailableError, BusError
from ..schemas.registry import TOPICS, TopicSpec
from .settings import BusConfig


def probe(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """True when a broker answers a metadata request at ``bootstrap``."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "broker.address.family": "v4",
                         "log_level": 0})
    try:
        admin.list_topics(timeout=timeout_s)
        return True
    except KafkaException:
        return False


def admin_client(cfg: BusConfig, timeout_s: float = 5.0) -> AdminClient:
    """An admin client, after checking that the cluster answers (one-line error if not)."""
    admin = AdminClient({**cfg.admin_conf()})
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerUnavailableError(
            f"no Kafka broker answered at {cfg.bootstrap_servers} within {timeout_s:.0f} s; "
            "start one with `tapioca broker up` or check --bootstrap-server"
        ) from exc
    return admin


def ensure_topics(
    cfg: BusConfig,
    specs: Iterable[TopicSpec] = TOPICS,
    partitions: dict[str, int] | None = None,
    timeout_s: float = 15.0,
) -> list[str]:
    """Create the registry's topics that do not exist yet; returns the names created.

    Idempotent: existing topics are left as they are.
    """
    admin = admin_client(cfg)
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = []
    for spec in specs:
        name = cfg.topic(spec)
        if name in existing:
            continue
        n = (partitions or {}).get(spec.name, spec.partitions)
        wanted.append(NewTopic(name, num_partitions=n, replication_factor=1,
                               config={"cleanup.policy": spec.cleanup}))
    created = []
    if wanted:
        for name, fut in admin.create_topics(wanted, request_timeout=timeout_s).items():
            try:
                fut.result()
                created.append(name)
            except KafkaException as exc:
                if "TOPIC_ALREADY_EXISTS" in str(exc) or "already exists" in str(exc):
                    continue
                raise BusError(f"could not create topic {name}: {exc}") from exc
        _wait_for_topics(admin, [t.topic for t in wanted], timeout_s)
    return created


def topic_partitions(cfg: BusConfig, specs: Iterable[TopicSpec] = TOPICS,
                     timeout_s: float = 5.0) -> dict[str, int]:
    """The partition count of each of ``specs``' topics that exists (by full name)."""
    admin = admin_client(cfg, timeout_s)
    md = admin.list_topics(timeout=timeout_s).topics
    out = {}
    for spec in specs:
        name = cfg.topic(spec)
        if name in md and md[name].error is None and md[name].partitions:
            out[name] = len(md[name].partitions)
    return out


def repair_topics(cfg: BusConfig, expected: dict[str, int], timeout_s: float = 30.0
                  ) -> tuple[list[str], list[str]]:
    """Make every topic in ``expected`` (full name -> partitions) exist with its
    partitions: missing ones are created; one with another partition count (e.g.
    auto-created by some client after the broker lost it) is deleted and created again
    (CreatePartitions cannot shrink, and some brokers do not support it at all).
    Returns (created, re-created) names. What a wrong topic held is lost, and was
    written since the loss, with the wrong partitioning."""
    admin = admin_client(cfg)
    md = admin.list_topics(timeout=timeout_s).topics
    wrong = [n for n, parts in expected.items()
             if n in md and md[n].partitions and len(md[n].partitions) != parts]
    if wrong:
        for name, fut in admin.delete_topics(wrong, request_timeout=timeout_s).items():
            try:
                fut.result()
            except KafkaException as exc:
                raise BusError(f"could not delete topic {name} to re-create it: {exc}") from exc
    by_name = {cfg.topic(t): t for t in TOPICS}
    created: list[str] = []
    deadline = time.monotonic() + timeout_s
    todo = [n for n in expected if n not in md or n in wrong]
    while todo:
        new = [NewTopic(n, num_partitions=expected[n], replication_factor=1,
                        config={"cleanup.policy": by_name[n].cleanup} if n in by_name else {})
               for n in todo]
        retry = []
        for name, fut in admin.create_topics(new, request_timeout=timeout_s).items():
            try:
                fut.result()
                created.append(name)
            except KafkaException as exc:
                text = str(exc)
                exists = "TOPIC_ALREADY_EXISTS" in text or "already exists" in text
                if exists and name not in wrong:
                    continue  # created meanwhile by someone else
                if time.monotonic() > deadline:
                    raise BusError(f"could not re-create topic {name}: {exc}") from exc
                retry.append(name)  # a deletion still in progress
        todo = retry
        if todo:
            time.sleep(0.2)
    if created:
        _wait_for_topics(admin, created, timeout_s)
    return [n for n in created if n not in wrong], [n for n in created if n in wrong]


def _wait_for_topics(admin: AdminClient, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout_s)
        if all(n in md.topics and md.topics[n].partitions for n in names):
            return
        time.sleep(0.05)
    raise BusError(f"topics {names} did not appear within {timeout_s:.0f} s")


@dataclass
class TopicInfo:
    name: str
    partitions: int
    config: dict[str, str]


def list_topics(cfg: BusConfig) -> list[TopicInfo]:
    admin = admin_client(cfg)
    md = admin.list_topics(timeout=10)
    out = []
    for name in sorted(md.topics):
        if name.startswith("__"):
            continue
        out.append(TopicInfo(name, len(md.topics[name].partitions), {}))
    return out


def describe_topic(cfg: BusConfig, name: str) -> dict:
    admin = admin_client(cfg)
    md = admin.list_topics(topic=name, timeout=10)
    tmd = md.topics.get(name)
    if tmd is None or tmd.error is not None or not tmd.partitions:
        raise BusError(f"topic {name!r} does not exist; create it with `tapioca topics create`")
    config: dict[str, str] = {}
    try:
        res = ConfigResource(ConfigResource.Type.TOPIC, name)
        for entry in admin.describe_configs([res])[res].result(timeout=10).values():
            config[entry.name] = entry.value
    except Exception:  # some brokers return nothing or refuse; the description still stands
        pass
    partitions = []
    consumer = Consumer({**cfg.consumer_conf("tapioca-describe")})
    try:
        for pid in sorted(tmd.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(name, pid), timeout=10)
            partitions.append({"partition": pid, "low": low, "high": high,
                               "leader": tmd.partitions[pid].leader})
    finally:
        consumer.close()
    return {"name": name, "partitions": partitions, "config": config}


@dataclass
class LagRow:
    group: str
    topic: str
    partition: int
    committed: int | None
    end: int
    lag: int | None


def consumer_lag(cfg: BusConfig, groups: list[str] | None = None) -> list[LagRow]:
    """Committed vs end offset per consumer group and partition (approximate on brokers
    with unreliable watermarks)."""
    admin = admin_client(cfg)
    if groups is None:
        listing = admin.list_consumer_groups(request_timeout=10).result()
        groups = sorted(g.group_id for g in listing.valid)
    rows: list[LagRow] = []
    if not groups:
        return rows
    from confluent_kafka import ConsumerGroupTopicPartitions

    consumer = Consumer({**cfg.consumer_conf("tapioca-lag")})
    try:
        for group in groups:
            fut = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group]
            try:
                result = fut.result()
            except KafkaException as exc:
                raise BusError(f"could not read offsets of group {group!r}: {exc}") from exc
            for tp in sorted(result.topic_partitions, key=lambda t: (t.topic, t.partition)):
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=10)
                committed = tp.offset if tp.offset >= 0 else None
                lag = max(high - committed, 0) if committed is not None else None
                rows.append(LagRow(group, tp.topic, tp.partition, committed, high, lag))
    finally:
        consumer.close()
    return rows
