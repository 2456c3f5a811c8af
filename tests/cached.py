"""What tests share within a session instead of building it again.

Initial parameters: `init_params` compiles one sharded threefry program per
model and layout (1-2 s on 2 cores, most of a small parity case). Its values
are the same at every tp and impl (tests/model/test_transformer.py::
test_init_is_the_same_in_every_layout holds it to that), so a test that needs
them in a layout gets them from one single-device init per model and seed,
placed with `place_params`.
"""

import functools

import jax
import numpy as np
from flax import nnx

from jaxtp.config import Config, ModelConfig, TrainConfig
from jaxtp.model.build import resolve_attention
from jaxtp.parallel import Layout, Schedule, make_mesh
from jaxtp.train.data import to_mesh
from jaxtp.train.state import init_params, place_params
from jaxtp.train.step import grads_of
from reference import host_params


@functools.cache
def _values(model: ModelConfig, seed: int) -> dict:
    cfg = Config(model, TrainConfig(seed=seed))
    return host_params(init_params(cfg, make_mesh(1, 1))[1])


def initial_values(cfg: Config) -> dict:
    """cfg's initial parameters as a nested dict of full numpy arrays."""
    return _values(cfg.model, cfg.train.seed)


def initial_params(cfg: Config, mesh):
    """(graphdef, params, shardings) as `init_params(cfg, mesh)` returns them."""
    return place_params(cfg, mesh, initial_values(cfg))


def loss_and_grads(cfg: Config, tokens, values=None, key=None):
    """(loss, {path: full gradient}) of one batch of windows [B, T+1], placed
    as the training loop places it (under cp: inputs and targets in the
    balanced order); `values` as `place_params` takes them (default: the
    initial ones)."""
    layout = Layout.of(cfg)
    mesh = layout.mesh()
    schedule = Schedule.of(resolve_attention(cfg), layout)
    graphdef, params, _ = (initial_params(cfg, mesh) if values is None else
                           place_params(cfg, mesh, values))
    placed = to_mesh(tokens, mesh, cfg.parallel.cp_balance)
    with jax.set_mesh(mesh):
        loss, grads = jax.jit(lambda p, t: grads_of(graphdef, p, t, key, schedule))(params,
                                                                                   placed)
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(jax.device_get(grads)))[0]
    return float(loss), {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    """Two `loss_and_grads` results equal: the loss and every gradient."""
    (la, ga), (lb, gb) = a, b
    np.testing.assert_allclose(la, lb, rtol=rtol)
    assert ga.keys() == gb.keys()
    for k in ga:
        np.testing.assert_allclose(ga[k], gb[k], rtol=rtol, atol=atol, err_msg=k)


# The suite compiles at LLVM -O0 (conftest): compiling is most of a small
# test's time (-O1 doubles a train step's). A test that runs one program for
# seconds (32,000 sampled draws) compiles it at -O1: 0.2 s more compile, 2.5 s
# less running (measured).
OPTIMISED = {"xla_backend_optimization_level": 1}
