"""What tests share within a session instead of building it again.

Initial parameters: `init_params` compiles one sharded threefry program per
model and layout (1-2 s on 2 cores, most of a small parity case). Its values
are the same at every tp and impl (tests/model/test_transformer.py::
test_init_is_the_same_in_every_layout holds it to that), so a test that needs
them in a layout gets them from one single-device init per model and seed,
placed with `place_params`.
"""

import functools

from jaxtp.config import Config, ModelConfig, TrainConfig
from jaxtp.parallel import make_mesh
from jaxtp.train.state import init_params, place_params
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


# The suite compiles at LLVM -O0 (conftest): compiling is most of a small
# test's time (-O1 doubles a train step's). A test that runs one program for
# seconds (32,000 sampled draws) compiles it at -O1: 0.2 s more compile, 2.5 s
# less running (measured).
OPTIMISED = {"xla_backend_optimization_level": 1}
