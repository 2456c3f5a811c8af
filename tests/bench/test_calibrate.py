"""The CPU's op costs measured by micro-benchmarks price this machine's own
steps: the same pricing that prices an H100 (`jaxtp.analysis.price`), with
constants from `jaxtp.bench.calibrate`, against the steps timed."""

from __future__ import annotations

import pytest

from jaxtp.analysis.price import Costs


@pytest.mark.slow
def test_calibrated_costs_predict_the_measured_cpu_steps(tmp_path):
    """tiny at tp=1 (1 device) and tp=8 (8 devices sharing the cores): one
    round, calibrating, then timing the steps alternated. The
    ratio is held to [0.4, 2.5], loose enough that a loaded machine, which
    slows calibration and step alike, cannot break it; the figures (within
    about 30% here) are the benchmark's (`--only predict_cpu`)."""
    from jaxtp.bench.calibrate import calibrate
    from jaxtp.bench.predict_cpu import LAYOUTS, predicted_vs_measured

    costs = calibrate(2, reps=2, quick=True, log=lambda _: None,
                      collectives={"all-reduce/2", "all-gather/2"})
    path = tmp_path / "costs.json"
    path.write_text(costs.to_json())
    back = Costs.load(path)
    assert back.matmul(1e8) == costs.matmul(1e8) and back.collectives.keys() == \
        costs.collectives.keys() == {"all-reduce/2", "all-gather/2"}
    assert set(back.memory_classes) == {"transcendental", "transpose", "reduce"}
    rows = predicted_vs_measured(LAYOUTS[:2], rounds=1, steps=2, quick=True, log=lambda _: None)
    for r in rows:
        assert 0.4 < r["ratio"] < 2.5, r
