"""Tapioca: asynchronous RL for LLMs as an event-sourced streaming system over Kafka.

This file makes the repository root the package ``tapioca``, and its folders
(``schemas/``, ``bus/``, ``producers/``, ...) its subpackages: pyproject.toml maps
``tapioca`` to this folder, so the wheel, the editable install (``make install``) and a
plain clone have the same layout, and the relative imports between the folders
(``from ..schemas.errors import ...``) resolve on disk, for Python and for an
import-graph tool (docs/CONTRIBUTING.md, "Imports", has the commands). It imports
nothing: every ``import tapioca.x`` runs it first.
"""
