"""bench/rounds.py: how many paired rounds a size gets (the benchmarks' one rule for baselines)."""

from __future__ import annotations

import json

from bench.rounds import paired, settle


def _rounds(ratios: list[float], least: int, most: int) -> list[dict]:
    it = iter(ratios)
    one = lambda turn: {"turn": turn, "r": next(it)}  # noqa: E731
    return settle(one, [lambda x: x["r"]], least, most, say=lambda _: None)


def test_rounds_go_on_while_the_median_ratio_moves_and_stop_at_the_cap() -> None:
    steady = _rounds([1.2, 1.21, 1.2, 9.0], least=3, most=8)
    assert [x["r"] for x in steady] == [1.2, 1.21, 1.2]  # the third round moved the median < 5 %
    noisy = _rounds([1.0, 2.0, 3.0, 2.0, 9.0], least=3, most=8)  # 1.5 → 2.0: one more, then still
    assert [x["r"] for x in noisy] == [1.0, 2.0, 3.0, 2.0] and [x["turn"] for x in noisy] == [0, 1, 2, 3]
    capped = _rounds([1.0, 3.0, 1.0, 3.0, 1.0, 3.0], least=2, most=4)
    assert len(capped) == 4


def test_a_ratio_is_shown_with_its_spread_and_its_rounds() -> None:
    runs = [{"a": a, "b": 1.0} for a in (1.1, 1.4, 1.2)]
    assert paired(runs, lambda x: x["a"] / x["b"]) == "1.20 (1.10–1.40; 3 rounds)"


def test_the_goals_table_reads_every_number_from_the_runs_results() -> None:
    """bench/goals.py: per-round ratios from the raw rows, a mark per goal, "–" where nothing ran."""
    from bench.goals import table

    def mig(plain: float, snc: float, post_down: float, pages: float) -> dict:
        return {
            "plain": {"downtime": plain},
            "stop-and-copy": {"downtime_seconds": snc},
            "post-copy": {"downtime_seconds": post_down, "pages_seconds": pages},
            "sealed": {"bytes_moved": 9e8, "transfer_seconds": 1.0},
            "tcp": 1e9,
        }

    migrate = {
        "machine": "m",
        "date": "d",
        "rows": [
            {"gib": 2, "runs": [mig(10, 10.5, 0.4, 5.6), mig(10, 12, 0.4, 9.6), mig(8, 8.4, 0.6, 3.4)]},
            {"gib": 8, "runs": [{"post-copy": {"downtime_seconds": 0.45, "pages_seconds": 30.0}}]},
        ],
    }
    dump_restore = {
        "machine": "m",
        "date": "d",
        "rows": [{"gib": 2, "runs": [{"criuctl": {"restore": 3.0}, "criu": {"restore": 2.0}}]}],
    }
    rows = {
        ln.split(" | ")[0][2:]: ln.split(" | ")[1:]
        for ln in table(dict(migrate=migrate, dump_restore=dump_restore)).splitlines()
        if ln.startswith("| ")
    }
    assert rows["stop-and-copy downtime ÷ plain CRIU page-server migration"][:2] == [
        "1.05 (1.05–1.20; 3) ✓",
        "–",
    ]
    assert rows["criuctl's stream (sealed bundle) ÷ raw TCP"][0] == "0.90 (0.90–0.90; 3) ✓"
    assert rows["`criuctl restore` ÷ plain `criu restore`"][0] == "1.50 (1) ✗"
    assert rows["post-copy: every page on b ÷ plain CRIU's whole migration"][0] == "0.60 (0.50–1.00; 3) ✓"
    assert rows["post-copy downtime, seconds"][:2] == ["–", "0.45 (1) ✓"]  # the goal is at 8 GiB alone
    assert rows["… the same with pages straight into the target (`CRIUCTL_STREAM=direct`)"][0] == "–"


def test_the_gpu_table_is_made_from_the_file_the_gpu_check_writes(tmp_path, monkeypatch, capsys) -> None:
    """tests/gpu/check.py's rows and probed codes -> gpu-check.json -> bench/gpu_table.py's Markdown,
    whose header names the run's commit, driver and GPU."""
    from bench import gpu_table
    from tests.gpu import check

    monkeypatch.setattr(check, "RESULTS", tmp_path)
    monkeypatch.setattr(check, "rows", [])
    monkeypatch.setattr(check, "failed", False)
    check.record("driver API + CRIU (map)", True, "20 steps equal | weights equal", dump_s=7.2)
    check.record("one-rank NCCL job", False, "CUDA_ERROR_NOT_SUPPORTED")
    env = {"commit": "abc1234", "driver": "580.159.04", "gpus": [{"name": "NVIDIA H200"}], "torch": "2.9"}
    codes = {"lock timeout": {"code": 600, "name": "NOT_READY", "state after": "RUNNING"}}
    path = check.write_results(env, codes)
    capsys.readouterr()  # what record() printed as the check ran
    doc = json.loads(path.read_text())
    assert doc["checks"][0]["dump_s"] == 7.2 and doc["failed"] is True
    assert gpu_table.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Commit `abc1234`") and "NVIDIA H200, driver 580.159.04" in out
    assert "| driver API + CRIU (map) | ok | 20 steps equal / weights equal |" in out
    assert "| one-rank NCCL job | FAIL | CUDA_ERROR_NOT_SUPPORTED |" in out
    assert "| lock timeout | NOT_READY | RUNNING |" in out
    assert gpu_table.main([str(tmp_path / "missing.json")]) == 2
    assert "run tests/gpu/check.sh" in capsys.readouterr().err
