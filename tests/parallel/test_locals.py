"""The Locals (jaxtp.parallel.locals): every impl's class implements the
whole declared protocol, the table picks it per impl, and a fourth impl is
one class and one table entry: the model runs on it without an edit."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtp.config import IMPLS, ModelConfig
from jaxtp.model.mlp import MLP
from jaxtp.parallel import GSPMD, LOCALS, Explicit, Layout, Local, ShardMap, local_of, make_mesh

PROTOCOL = sorted(n for n, v in vars(Local).items()
                  if callable(v) and not n.startswith("_"))


def test_the_protocol_declares_each_method_with_its_math():
    assert len(PROTOCOL) >= 19, PROTOCOL  # 14 of the regions' math, 5 ways to run a module
    for name in PROTOCOL:
        doc = inspect.getdoc(getattr(Local, name))
        assert doc and len(doc) > 20, f"Local.{name} has no docstring"


@pytest.mark.parametrize("impl", IMPLS)
def test_every_impl_has_a_local_that_implements_all_of_it(impl):
    cls = LOCALS[impl]
    for name in PROTOCOL:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(Local, name)).parameters)
        assert list(inspect.signature(method).parameters) == want, (cls.__name__, name)
    assert set(LOCALS) == set(IMPLS)


def test_the_table_picks_the_local_of_the_layouts_impl():
    assert type(local_of(Layout.make(tp=2, impl="gspmd"))) is GSPMD
    assert type(local_of(Layout.make(tp=2, impl="shard_map"))) is ShardMap
    with jax.set_mesh(make_mesh(1, 2, impl="explicit")):
        assert type(local_of(Layout.make(tp=2, impl="explicit"))) is Explicit
    with pytest.raises(ValueError, match="runs on a mesh of Explicit axes"):
        Explicit(Layout.make(tp=2, impl="explicit"))  # no mesh in context


class Logged(GSPMD):
    """A new impl: GSPMD that counts each region it runs."""

    regions = 0

    def run_region(self, module, x_BTD):
        Logged.regions += 1
        return super().run_region(module, x_BTD)


def test_a_fourth_impl_is_one_class_and_one_table_entry(monkeypatch):
    monkeypatch.setitem(LOCALS, "logged", Logged)
    cfg = ModelConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4, d_ff=64, seq_len=8)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 32)), jnp.float32)
    out = {}
    for impl in ("gspmd", "logged"):
        layout = Layout.make(tp=2, impl=impl)
        with jax.set_mesh(make_mesh(1, 2)):
            mlp = MLP(cfg, layout, rngs=nnx.Rngs(0))
            out[impl] = np.asarray(jax.jit(lambda m, x: m(x))(mlp, x))
    assert Logged.regions == 1  # traced once, through the new class
    np.testing.assert_array_equal(out["logged"], out["gspmd"])
