"""bench/rounds.py: how many paired rounds a size gets (the benchmarks' one rule for baselines)."""

from __future__ import annotations

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
