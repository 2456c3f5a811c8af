"""The fewest devices a step fits on (`jaxtp.analysis.fit`): its layouts,
and a search held to every layout compiled and measured in the test."""

import functools

import pytest

from jaxtp.analysis import fit
from jaxtp.analysis import plan as planner
from jaxtp.config import apply_overrides, load_config
from jaxtp.train.step import compiled_step

MOE = apply_overrides(load_config("moe-tiny"), ["model.n_layers=2", "train.batch_size=8"])


def _degrees(c):
    p = c.parallel
    return p.pp, p.dp, p.ep, p.tp


def test_layouts_split_the_devices_with_tp_and_ep_inside_a_node():
    got = fit.layouts(MOE, 8, per_node=4)
    assert got, "no layout of 8 devices"
    for c in got:
        pp, dp, ep, tp = _degrees(c)
        assert pp * dp * ep * tp == 8 and tp * ep <= 4 and ep <= 8
        assert c.parallel.fsdp == (dp > 1)  # FSDP over whatever dp is left
        assert pp == 1 or c.train.microbatches >= pp
    seen = {_degrees(c) for c in got}
    assert (1, 2, 4, 1) in seen and (1, 4, 1, 2) in seen and (2, 1, 4, 1) in seen
    assert not any(tp > 4 for *_, tp in seen)  # tp never leaves the node
    assert fit.name(got[0]).endswith("tp=1")


@functools.cache
def _measured(degrees):
    """A layout's compiled total a device (cached: each compiled once)."""
    c = next(c for n in (2, 4) for c in fit.layouts(MOE, n, 4) if _degrees(c) == degrees)
    return planner.analyze(c, compile_step=compiled_step)


@pytest.mark.slow
def test_the_search_names_the_fewest_devices_and_the_fastest_layout_that_fits():
    """Every layout of 2 and 4 devices compiled here: memory set between
    the least total at 2 and at 4, the search must answer 4, and of the
    layouts at 4 that fit, the one a made-up speed ranks first."""
    total = lambda c: _measured(_degrees(c))["memory"]["total"]
    at = {n: fit.layouts(MOE, n, 4) for n in (2, 4)}
    least = {n: min(total(c) for c in cs) for n, cs in at.items()}
    assert least[4] < least[2], least  # (the test's premise: more devices, less each)
    memory = (least[4] + least[2]) / 2
    fitting = [c for c in at[4] if total(c) <= memory]
    speed = lambda c: (-c.parallel.ep, c.parallel.tp, c.parallel.pp)  # (any fixed order)
    lines = []
    n, c, row = fit.smallest_fit(MOE, [2, 4], 4, memory, lambda c: 0.0,
                                 lambda c: _measured(_degrees(c)), lines.append,
                                 per_count=None, speed=speed)
    assert n == 4 and _degrees(c) == _degrees(min(fitting, key=speed))
    assert row["memory"]["total"] <= memory
    assert any(line.startswith("2 devices") for line in lines)
    # below every floor nothing is compiled, and there is no answer
    assert fit.smallest_fit(MOE, [2, 4], 4, memory, lambda c: 2 * memory,
                            lambda c: pytest.fail("compiled"), lines.append) is None


def test_the_dispatch_is_chosen_by_its_einsums_cost_and_then_by_the_compile():
    """2*E*C/(n*k*F) by hand: Qwen3-30B-A3B's one-hots (E 128, C 320 at cf
    1.25, top 8, F 768, gated: n 3) cost 4.44x its experts; Mixtral's (E 8,
    C 1280, top 2, F 14336) 0.24x, so it keeps its own without compiling."""
    qwen, mixtral = load_config("qwen3-30b-a3b"), load_config("mixtral-8x7b")
    assert fit.dispatch_ratio(qwen) == pytest.approx(2 * 128 * 320 / (3 * 8 * 768))
    assert fit.dispatch_ratio(mixtral) == pytest.approx(2 * 8 * 1280 / (3 * 2 * 14336))
    assert fit.dispatch_choice(mixtral, {}, lambda c: pytest.fail("compiled")) == "dense"
    row = lambda total: {"memory": {"total": total}, "compiled_for": "test"}
    seen, lines = [], []
    measure = lambda c: seen.append(c.model) or row(10)
    assert fit.dispatch_choice(qwen, row(20), measure, lines.append) == "ragged"
    assert "4.44x" in lines[0] and lines[-1].endswith("(dropless: model.capacity_factor=0)")
    assert seen[0].moe_dispatch == "ragged" and seen[0].capacity_factor == 0  # (dropless)
    assert fit.dispatch_choice(qwen, row(5), measure, lambda s: None) == "dense"
    lines = []  # (no accelerator's compile: the ratio said, nothing compiled)
    assert fit.dispatch_choice(qwen, row(5), None, lines.append) == "dense"
    assert "--hardware compiles model.moe_dispatch=ragged" in lines[0]
