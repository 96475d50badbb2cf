"""The OpenAI-compatible agent proxy (`tapioca proxy`): see :mod:`.server` for the HTTP
API, :mod:`.sessions` for how sessions become trajectories."""

from .server import ProxyServer, create_app
from .service import ProxyService

__all__ = ["ProxyServer", "ProxyService", "create_app"]
