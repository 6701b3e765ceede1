"""The argparse types every command's flags use (clef-serve, clef-batch, clef-bench, the
worker): one module, so a number of seconds, a count or a port is refused with the same words
wherever it is given.

Each raises `argparse.ArgumentTypeError` saying what it expected and what it got.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_int(value: str) -> int:
    """An integer >= 1."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def non_negative_int(value: str) -> int:
    """An integer >= 0."""
    if value.strip().isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")


def non_negative_float(value: str) -> float:
    """A finite number >= 0."""
    return non_negative("a non-negative number")(value)


def non_negative(unit: str) -> Callable[[str], float]:
    """A finite number >= 0 of `unit` (its error names the unit)."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit}, got {value!r}") from None
        if not number >= 0 or number == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite number of {unit}, got {value!r}")
        return number

    return parse


# Seconds a wait may last where 0 means "not at all" (a grace, a timeout that may be off).
non_negative_seconds = non_negative("seconds")
# Bytes per second (a minimum upload rate; 0 turns it off).
bytes_per_second = non_negative("bytes per second")


def positive_seconds(value: str) -> float:
    """A positive, finite number of seconds."""
    number = non_negative_seconds(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return number


def port(value: str) -> int:
    """A TCP port, 0 to 65535 (0 picks a free one)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a TCP port (0 picks a free one)")
    return number
