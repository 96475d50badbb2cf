"""The topic registry: every topic of docs/design.md#1-the-event-flow as one table.

Each row gives the topic's base name and version (the full name is
``{prefix}.{name}.v{version}``, prefix ``tapioca`` by default), the event field it is
keyed by, its default partition count, its cleanup policy and the event types it
carries. Producers find a topic from an event's type; consumers find the types to
expect from a topic.
"""

from __future__ import annotations

from dataclasses import dataclass

from .envelope import Event
from .errors import SchemaError
from .events import (
    ControlAckEvent,
    ControlEvent,
    DlqRecord,
    FleetEvent,
    MetricsEvent,
    ProgressEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    TrajectoryEvent,
    WeightsEvent,
)

DEFAULT_PREFIX = "tapioca"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    version: int
    key_field: str
    partitions: int
    cleanup: str  # "delete" | "compact"
    value_types: tuple[type[Event], ...]
    description: str
    # Records must carry the run's HMAC signature (bus/signing.py): commands and policy
    # versions steer every role, so only holders of the run's key may publish them.
    signed: bool = False

    def full_name(self, prefix: str = DEFAULT_PREFIX) -> str:
        return f"{prefix}.{self.name}.v{self.version}"

    def key_of(self, event: Event) -> str:
        key = getattr(event, self.key_field)
        return str(key)


# Group-keyed topics get several partitions so consumer groups can scale out; the
# weights and progress topics have one so every reader sees versions in order.
TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec("prompts", 1, "group_id", 4, "delete", (PromptEvent,),
              "prompt groups admitted by the feeder under the head gate"),
    TopicSpec("trajectories", 1, "group_id", 4, "delete", (TrajectoryEvent,),
              "one completion per event, with per-token logprobs and versions"),
    TopicSpec("rewards", 1, "group_id", 4, "delete", (RewardEvent,),
              "scalar rewards from built-in or external scorers"),
    TopicSpec("samples", 1, "group_id", 4, "delete", (SampleEvent,),
              "complete groups with advantages, ready for training"),
    TopicSpec("weights", 1, "run_id", 1, "compact", (WeightsEvent,),
              "policy versions published by the trainer: where their bytes are", signed=True),
    # Each event names the rejections since the previous one: nothing to compact away.
    TopicSpec("progress", 1, "run_id", 1, "delete", (ProgressEvent,),
              "the trainer's version, trained and rejected groups: the head gates' counts",
              signed=True),
    TopicSpec("control", 1, "target", 1, "delete", (ControlEvent, ControlAckEvent),
              "operator commands and their acknowledgements", signed=True),
    TopicSpec("fleet", 1, "member_id", 1, "compact", (FleetEvent,),
              "heartbeats and status of every running member"),
    TopicSpec("metrics", 1, "run_id", 1, "delete", (MetricsEvent,),
              "scalar metrics of every role"),
    TopicSpec("dlq", 1, "source_topic", 1, "delete", (DlqRecord,),
              "dead letters: events a consumer could not decode or handle"),
)

_BY_NAME = {t.name: t for t in TOPICS}
_BY_TYPE = {cls: t for t in TOPICS for cls in t.value_types}


def topic(name: str) -> TopicSpec:
    """Look a topic up by base name (``"trajectories"``) or full name."""
    base = name
    parts = name.split(".")
    if len(parts) >= 3 and parts[-1].startswith("v") and parts[-1][1:].isdigit():
        base = parts[-2]
    spec = _BY_NAME.get(base)
    if spec is None:
        raise SchemaError(f"unknown topic {name!r}; known: {sorted(_BY_NAME)}")
    return spec


def topic_for(event: Event | type[Event]) -> TopicSpec:
    """The topic an event type is published to."""
    cls = event if isinstance(event, type) else type(event)
    spec = _BY_TYPE.get(cls)
    if spec is None:
        raise SchemaError(f"{cls.__name__} is not carried by any registered topic")
    return spec
