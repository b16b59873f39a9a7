"""loomd: long-term memory for AI coding agents, as a local daemon."""

__version__ = "0.1.0"
