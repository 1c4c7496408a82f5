"""Argument types and checks shared by the benchmark command lines and the developer tools."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .configs import ALL_CONFIGS


def at_least_one(text: str) -> int:
    """An int of at least 1 (a round count of 0 would time nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def names_in(table: dict[str, object]) -> Callable[[str], list[str]]:
    """An argparse ``type`` for a comma-separated ``--configs`` value whose names must be keys of ``table``, empty
    ones skipped (an unknown one: the usage error, listing the known ones)."""
    def names(text: str) -> list[str]:
        found = [n for n in text.split(",") if n]
        unknown = [n for n in found if n not in table]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown config {', '.join(unknown)}; known: {', '.join(table)}")
        return found
    return names


def config_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """:func:`names_in` of benchmarks/configs.py's configs, for a value read after parsing: an unknown name is
    ``parser``'s usage error (exit status 2)."""
    try:
        return names_in(ALL_CONFIGS)(text)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
