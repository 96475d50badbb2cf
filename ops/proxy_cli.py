"""Placeholder: commands are registered here by the work in progress (see issues 4-6)."""
