"""The moe section: all-to-all bytes against the capacity factor, compiled
and by the ep ledger, against counts by hand."""

from jaxtp.bench.moe import bench_moe
from jaxtp.bench.suite import PLANS


def test_the_moe_section_follows_the_capacity_factor():
    """moe-tiny at the quick plan's size (1 layer, B = 8, T = 64) at ep 4 x
    tp 2: each rank routes 8/4 = 2 sequences; C = ceil(cf x 64 x 2 / 8) = 16
    at cf 1, 64 dropless (C = T); 4 all-to-alls per layer of E x G_r x C x D
    = 8 x 2 x C x 128 fp32 each, by hand; dropless moves E/k = 4 times cf 1's."""
    s = bench_moe(PLANS["quick"], log=lambda _: None, factors=(1.0, 0.0))
    one, dropless = s["rows"]
    for row, C in ((one, 16), (dropless, 64)):
        assert row["capacity"] == C and row["slots"] == 8 * 2 * C * 128
        assert row["compiled_bytes"] == row["ledger_bytes"] == 4 * 8 * 2 * C * 128 * 4
    assert (one["value"], dropless["value"]) == (1.0, 4.0)
    assert s["id"] == "moe" and "dropless" in dropless["case"]
