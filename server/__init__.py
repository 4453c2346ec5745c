"""kvserve: a stateful OpenAI-compatible text-generation server."""

__version__ = "0.1.0"
