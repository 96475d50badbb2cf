"""Kafka plumbing: the only code in Tapioca that touches Kafka clients.

- :class:`BusConfig` — client settings for one cluster.
- :class:`EventProducer` — typed, idempotent, delivery-checked publishing.
- :class:`Role` / :class:`RoleRunner` — ``handle(event, state, source) -> events``
  wrapped in polling, dead letters, retries and commits.
- :class:`TopicReader` — group-less reading for tools and recovery.
- :class:`EmbeddedBroker` — the Tansu broker for the demo, tests and CI.
- :func:`ensure_topics` — idempotent topic bootstrap.
"""

from .admin import consumer_lag, describe_topic, ensure_topics, list_topics, probe
from .broker import EmbeddedBroker, find_tansu, free_port
from .dedup import SeenSet
from .producer import EventProducer
from .reader import Record, TopicReader, read_events
from .role import Role, Source
from .runner import FatalRoleError, RoleRunner, RunnerStats
from .settings import BOOTSTRAP_ENV, BusConfig

__all__ = [name for name in dir() if not name.startswith("_")]
