"""The object a tool registers as an ``mpx.commands`` entry point (the protocol ``mpx.cli`` reads)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

__all__ = ["Command"]


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``mpx`` command: its line in ``mpx --help``, its options and what runs it.

    Attributes:
        help: one line for ``mpx --help``.
        add_arguments: adds the command's options to its parser.
        run: runs the command with the parsed arguments; returns the exit status.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
