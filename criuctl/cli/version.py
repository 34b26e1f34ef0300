"""Which criuctl runs: what `criuctl --version` prints and `criuctl doctor` reports first."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def describe() -> str:
    """criuctl's version, its Python and, inside the agent image, the image's revision and CRIU
    (the Dockerfile records them beside the venv), so a user can tell which build a node runs."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("criuctl")
    except PackageNotFoundError:
        mine = "(not installed)"
    detail = f"{mine}, Python {platform.python_version()} at {sys.executable}"
    record = Path(sys.prefix).parent / "image.json"
    if record.is_file():
        try:
            image = json.loads(record.read_text())
            detail += f"; agent image of commit {image['revision']} (CRIU {image['criu']})"
        except (OSError, ValueError, KeyError, TypeError):
            detail += f"; unreadable image record {record}"
    return detail
