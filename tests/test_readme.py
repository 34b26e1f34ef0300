"""The README says true things a test can check: every exit code criuctl gives is in its table."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# an error class's `exit_code = N`, or a verb's own `return 0 if ... else N`
CODE = re.compile(r"^    exit_code = (\d+)|^    return 0 if .* else (\d+)$", re.M)


def _readme_exit_codes() -> set[int]:
    text = (REPO / "README.md").read_text()
    sentence = text[text.index("Exit codes:") :].split("\n\n", 1)[0]
    return {int(n) for n in re.findall(r"(?:^|[:;] )(\d+)(?:/\d+)? ", sentence.replace("\n", " "))}


def _exit_codes_in_code() -> dict[int, str]:
    """Each error class's `exit_code`, and the codes `migrate` returns itself (`... else 6`)."""
    found: dict[int, str] = {}
    for path in sorted((REPO / "criuctl").rglob("*.py")):
        for m in re.finditer(
            r"^    exit_code = (\d+)|^    return 0 if .* else (\d+)$", path.read_text(), re.M
        ):
            found.setdefault(int(m[1] or m[2]), str(path.relative_to(REPO)))
    return found


def test_every_exit_code_is_in_the_readme() -> None:
    listed, used = _readme_exit_codes(), _exit_codes_in_code()
    assert {0, 1, 2, 3, 77, 126} <= listed, listed  # the parse reads the sentence
    missing = {code: where for code, where in used.items() if code not in listed}
    assert not missing, f"exit codes criuctl gives that README.md's 'Exit codes:' does not explain: {missing}"
