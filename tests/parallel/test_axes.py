"""The axis table (`jaxtp.axes`) is the one list of the parallel
dimensions: the config's degrees, the flags, the mesh's order, the batch
rule and the run's first line all follow it."""


from jaxtp.cli import FLAG_KEYS
from jaxtp.config import Config, ParallelConfig
from jaxtp.parallel import RULES, Layout
from jaxtp.axes import AXES, BATCH, OPTIONAL, TABLE, mesh_words


def test_the_config_flags_and_mesh_name_the_table_s_axes():
    assert set(ParallelConfig().degrees) == set(AXES)
    assert all(FLAG_KEYS[a] == f"parallel.{a}" for a in AXES)  # --pp sets parallel.pp, ...
    every = Layout.make(**{a: 2 for a in AXES})
    assert [name for name, _ in every.axes] == list(AXES)  # outermost first, tp last
    ones = Layout.make()
    assert {name for name, _ in ones.axes} == set(AXES) - OPTIONAL


def test_the_batch_rule_is_the_table_s_batch_axes():
    assert RULES["batch"] == BATCH == ("pp", "dp", "ep")
    layout = Layout.make(**{a: 2 for a in AXES})
    assert layout.rows(64) == 64 // 2 ** len(BATCH)
    assert layout.rows(64, manual=frozenset(BATCH)) == 64


def test_the_first_line_names_each_axis_in_the_table_s_order():
    cfg = Config(parallel=ParallelConfig(pp=2, dp=1, ep=1, cp=2, tp=4, cp_attention="ring"))
    words = mesh_words(cfg.parallel.degrees, cfg)
    assert words == "pp=2 (gpipe, 2 layers per stage) x dp=1 x cp=2 (ring, balanced) x tp=4"
    # an axis at degree 1 is named only where every mesh has it
    assert mesh_words({"dp": 4, "tp": 2}) == "dp=4 x tp=2"
    assert [a.name for a in TABLE if a.sweep] == ["pp", "ep", "cp"]


def test_each_axis_check_is_keyed_by_a_table_axis_and_refuses_its_own_degree():
    """`jaxtp.axis_checks`: a check per axis name of the table; each raises
    (through `validate`) on a layout of its axis alone that it refuses."""
    import dataclasses
    import re

    import pytest

    from jaxtp.axis_checks import CHECKS
    from jaxtp.config import ConfigError, load_config, validate

    assert set(CHECKS) <= set(AXES)
    tiny, moe = load_config("tiny"), load_config("moe-tiny")
    bad = {"pp": (tiny, dict(pp=3)),  # 4 layers over 3 stages
           "cp": (tiny, dict(cp=2, cp_attention="allgather", overlap="collective_matmul",
                             sp=True)),
           "ep": (moe, dict(ep=2, impl="explicit", pp=2))}
    assert set(bad) == set(CHECKS)
    for axis, (cfg, par) in bad.items():
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **par))
        assert CHECKS[axis](cfg)
        with pytest.raises(ConfigError, match=re.escape(CHECKS[axis](cfg))):
            validate(cfg)
