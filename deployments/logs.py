"""Our loggers inside Serve's processes: written where Serve writes its own (the replica's log file and console)."""

from __future__ import annotations

import logging


def through_serve(name: str, level: int = logging.INFO) -> None:
    """Logger `name` writes through Serve's handlers at `level` (a Serve process configures only its own loggers)."""
    logger = logging.getLogger(name)
    logger.setLevel(level)
    logger.handlers, logger.propagate = logging.getLogger("ray.serve").handlers, False
