"""Argument types shared by the benchmark command lines."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    """An int of at least 1 (a round count of 0 would time nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value
