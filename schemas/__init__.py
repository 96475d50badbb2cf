"""Typed events and the topic registry: the vocabulary every role shares.

Import events from here: ``from tapioca.schemas import TrajectoryEvent, encode_event``.
"""

from .envelope import (
    DEFAULT_MAX_EVENT_BYTES,
    Event,
    EventTooLargeError,
    UnknownEventTypeError,
    UnsupportedSchemaVersionError,
    decode_event,
    encode_event,
    event_types,
)
from .errors import (
    BadEventError,
    BrokerUnavailableError,
    BusError,
    ConfigError,
    EngineError,
    FatalRoleError,
    RewardError,
    SchemaError,
    TapiocaError,
)
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
    SampleSequence,
    TrajectoryEvent,
    WeightsEvent,
)
from .registry import DEFAULT_PREFIX, TOPICS, TopicSpec, topic, topic_for

__all__ = [name for name in dir() if not name.startswith("_")]
