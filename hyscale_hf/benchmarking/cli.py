"""Command-line checks shared by the benchmark scripts."""

from __future__ import annotations

import argparse


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """``parser.error`` naming the first of ``names`` (attribute names) whose value is not positive."""
    for name in names:
        value = getattr(args, name)
        if value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
