"""The one exception hierarchy of Tapioca.

Every error a user can see derives from :class:`TapiocaError`; messages say what to do.
"""


class TapiocaError(Exception):
    """Base of every Tapioca error."""


class ConfigError(TapiocaError):
    """A configuration value is missing or invalid."""


class SchemaError(TapiocaError):
    """An event failed to encode, decode or validate."""


class UnattributedEventError(SchemaError):
    """An event without a run id (or stamped ``default``) read by a role of a named run,
    on an input where that run's events must say so (``Role.attributed_inputs``)."""


class BusError(TapiocaError):
    """Kafka plumbing failed (broker unreachable, delivery failed, ...)."""


class BrokerUnavailableError(BusError):
    """No broker answered at the configured bootstrap servers."""


class EngineError(TapiocaError):
    """An inference engine failed."""


class RewardError(TapiocaError):
    """A reward function or service failed."""


class FatalRoleError(TapiocaError):
    """Raised by a role when retrying or dead-lettering cannot help (a bad config, a
    failed training step, lost model files): the role stops and reports it."""


def require_config(cond: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (which says what to change) unless
    ``cond``: the one check every config dataclass's ``__post_init__`` uses."""
    if not cond:
        raise ConfigError(message)
