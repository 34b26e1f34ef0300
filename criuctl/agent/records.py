"""Durable records: write-temp, fsync, rename, fsync the folder — so a crash leaves the old or the new.

A migration's state is written *before* the step it announces is taken (a write-ahead record): a
process that dies at any instant leaves a record that says at most one step too early, never one
too late, and every step is safe to repeat. A record that cannot be read (torn by a disk error,
edited by hand) is reported as `Unreadable`, never raised: an agent that crash-loops on one bad file
would strand every other migration on its node.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from criuctl.agent.protocol import SettleOrder, settle_order_path
from criuctl_hook import durable

T = TypeVar("T")


def write(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` with `data` as JSON, atomically and durably (root-only)."""
    durable.replace_json(path, data)


@dataclass(frozen=True)
class Unreadable:
    """A record that exists but cannot be used; `why` says what is wrong with it."""

    path: Path
    why: str


def read(path: Path, parse: Callable[[object], T]) -> T | Unreadable | None:
    """The record at `path` parsed by `parse`; None when there is none; Unreadable when it is bad."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Unreadable(path, exc.strerror or str(exc))
    try:
        return parse(json.loads(raw))
    except (ValueError, TypeError, KeyError) as exc:
        return Unreadable(path, f"{exc.__class__.__name__}: {exc}")


def scan(folder: Path, pattern: str, parse: Callable[[object], T]) -> Iterator[tuple[Path, T | Unreadable]]:
    """Every record matching `pattern` under `folder` (temp files of a torn write are skipped)."""
    for path in sorted(folder.glob(pattern)):
        if path.name.startswith("."):
            continue
        rec = read(path, parse)
        if rec is not None:
            yield path, rec


def settle_order(record: str | Path) -> SettleOrder | None:
    """The settle order beside a source record, if a person gave one (an unreadable one is none:
    the tree stays frozen, which is never wrong)."""
    order = read(settle_order_path(record), SettleOrder.from_json)
    return order if isinstance(order, SettleOrder) else None


def order_settle(record: str | Path, order: SettleOrder) -> None:
    """Write the order durably before anything acts on it: whoever holds the tree finds it."""
    write(settle_order_path(record), order.to_json())
