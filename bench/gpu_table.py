"""docs/benchmarks.md's GPU table, from the raw results the GPU check wrote (tests/gpu/check.py).

Every row and number comes from gpu-check.json, and the header names the commit, driver, GPU and
versions it ran on, so the table can be traced to one run on one machine.

    python bench/gpu_table.py [bench/results/gpu-check.json]     # prints the Markdown
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parent / "results" / "gpu-check.json"


def _gpus(doc: dict) -> str:
    names = [g.get("name", "?") for g in doc.get("gpus") or []]
    return ", ".join(sorted(set(names))) or "no GPU"


def table(doc: dict) -> str:
    head = (
        f"Commit `{doc.get('commit', 'unknown')}`, {doc.get('date', 'date unknown')}: {_gpus(doc)}, "
        f"driver {doc.get('driver', '?')} (CUDA {doc.get('driver_cuda', '?')}), "
        f"torch {doc.get('torch', '?')} "
        f"(CUDA {doc.get('torch_cuda', '?')}, NCCL {doc.get('nccl', '?')}), kernel {doc.get('kernel', '?')}, "
        f"{doc.get('criu', 'criu ?')}."
    )
    lines = [head, "", "| check | result | detail |", "| --- | --- | --- |"]
    for row in doc.get("checks", []):
        detail = str(row.get("detail", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {row.get('check', '?')} | {'ok' if row.get('ok') else 'FAIL'} | {detail} |")
    codes = doc.get("driver_codes") or {}
    if codes:
        lines += ["", "| driver call case | answer | state after |", "| --- | --- | --- |"]
        for case, answer in codes.items():
            lines.append(f"| {case} | {answer.get('name', '?')} | {answer.get('state after', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", type=Path, default=DEFAULT)
    a = p.parse_args(argv)
    try:
        doc = json.loads(a.results.read_text())
    except (OSError, ValueError) as exc:
        print(
            f"gpu_table: cannot read {a.results}: {exc}; run tests/gpu/check.sh on a GPU host",
            file=sys.stderr,
        )
        return 2
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
