"""Agents that train through the OpenAI-compatible proxy: tools, workflows, the runner."""
