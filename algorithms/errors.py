"""The error raised by ``tapioca.algorithms`` for invalid arguments or inputs.

It is both a :class:`TapiocaError` (the project's one hierarchy) and a
:class:`ValueError` (what callers of pure math functions expect to catch).
"""

from ..schemas.errors import TapiocaError


class AlgorithmInputError(TapiocaError, ValueError):
    """An RL-math function got an argument or input it cannot use."""
