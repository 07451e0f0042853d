"""The ``shardcore`` command line, on top of the plan, the views and the engine."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
