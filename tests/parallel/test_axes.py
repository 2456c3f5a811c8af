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
