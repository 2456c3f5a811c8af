"""The Schedule: decided once from the config beside the Layout; who consumes
the microbatches, and the counts the ledger multiplies by."""

import dataclasses

import pytest

from jaxtp.config import Config, ParallelConfig, TrainConfig
from jaxtp.parallel import Layout, Schedule


def schedule(dp=1, cp=1, fsdp=False, M=1, impl="gspmd", attention="xla", ep=1, once=True):
    cfg = Config(train=TrainConfig(microbatches=M, batch_size=16, reduce_once=once),
                 parallel=ParallelConfig(dp=dp, cp=cp, fsdp=fsdp, impl=impl, ep=ep))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=attention))
    return Schedule.of(cfg, Layout.of(cfg))


def test_the_mode_is_decided_from_the_layout_and_the_microbatches():
    assert schedule().mode == "whole"
    assert schedule(M=4).mode == "sequential"  # one dp rank: nothing to reduce once
    assert schedule(dp=2, M=4).mode == "over_dp"
    assert schedule(dp=2, M=4).reduces_once
    assert schedule(dp=2, M=4, fsdp=True).mode == "sequential"  # reduce-scattered per slice
    assert schedule(dp=2, cp=2, M=2).mode == "sequential"  # summed over cp per slice
    assert schedule(dp=2, M=2, attention="cudnn").mode == "sequential"
    assert schedule(dp=2, M=2, attention="cudnn", impl="shard_map").mode == "over_dp"
    assert schedule(dp=2, ep=2, M=2).mode == "sequential"  # ep reshards over dp x ep
    assert schedule(dp=2, M=2, once=False).mode == "sequential"  # as asked


def test_ticks_and_layers_per_rank():
    """Without stages a step loops M times over all L layers; with p stages
    and v repeats it runs v*M + p - 1 ticks (GPipe's fill and drain) of L/p."""
    s = schedule(dp=2, M=4)
    assert (s.ticks, s.layers_per_rank) == (4, 4)  # tiny: 4 layers
    piped = dataclasses.replace(s, stages=2, repeats=2, layers=8)
    assert (piped.ticks, piped.layers_per_rank) == (2 * 4 + 2 - 1, 4)


def test_a_schedule_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="schedule mode 'zigzag'"):
        Schedule(mode="zigzag")
    with pytest.raises(ValueError, match="pipeline schedule has more than one stage"):
        Schedule(microbatches=4, mode="pipeline")
    with pytest.raises(ValueError, match="whole-batch schedule has 1 microbatch, not 4"):
        Schedule(microbatches=4, mode="whole")
