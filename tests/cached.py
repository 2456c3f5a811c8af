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
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtp.config import Config, ModelConfig, TrainConfig
from jaxtp.model import reorder_layers
from jaxtp.model.build import resolve_attention
from jaxtp.parallel import Layout, Schedule, make_mesh
from jaxtp.train.data import to_mesh
from jaxtp.train.state import abstract_train_state, init_params, place_params
from jaxtp.train.step import grads_of, step_controls
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


def step_loss_and_grads(cfg: Config, step, tokens, values=None):
    """(loss, {path: full gradient}) as `loss_and_grads` gives them (stacked
    layers in model order), read from
    one run of the compiled train step `step` (`compile_train_step` for cfg
    on its mesh): a test that reads a step's HLO checks the same program's
    numbers, with no second compile.

    From zero moments AdamW's first moment is mu = (1 - b1) * g after the
    step's clipping by min(1, clip / norm) (optax.scale_by_adam; the norm is
    the step's grad_norm metric), so g = mu / (1 - b1) / that factor, to a
    few roundings. A skipped step leaves mu zero and fails the comparison.
    """
    layout = Layout.of(cfg)
    mesh = layout.mesh()
    _, params, _ = (initial_params(cfg, mesh) if values is None else
                    place_params(cfg, mesh, values))
    abstract = abstract_train_state(cfg, mesh)
    # optax's AdamW state starts at zero: counts, moments
    opt_state = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding),
                             abstract.opt_state)
    replicated = NamedSharding(mesh, P())
    key, controls = (jax.device_put(x, replicated)
                     for x in (jax.random.key(0), step_controls()))
    placed = to_mesh(tokens, mesh, cfg.parallel.cp_balance)
    _, opt_state, metrics = step(params, opt_state, placed, key, controls)
    t = cfg.train
    norm = float(metrics["grad_norm"])
    clip = min(1.0, t.grad_clip / max(norm, 1e-30)) if t.grad_clip > 0 else 1.0
    mu = nnx.to_pure_dict(jax.device_get(optax.tree_utils.tree_get(opt_state, "mu")))
    schedule = Schedule.of(cfg, layout)
    if schedule.stacked:  # in model order (a circular pipeline's interleaves)
        mu = reorder_layers(mu, np.argsort(schedule.layer_order()))
    flat = jax.tree_util.tree_flatten_with_path(mu)[0]
    return float(metrics["loss"]), {jax.tree_util.keystr(k): np.asarray(v) / (1 - t.b1) / clip
                                    for k, v in flat}


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


def stacked_grads(grads: dict, period: int = 1) -> dict:
    """{"['blocks'][i]...": g} -> {"['blocks']...": g stacked over i}: a
    list model's gradients as a scanned or pipelined one's come (in groups
    of `period` layers: {"['blocks']['layers'][j]...": layers j, j + period, ...})."""
    out, layers = {}, {}
    for k, g in grads.items():
        if k.startswith("['blocks'][") and k[len("['blocks']["):][:1].isdigit():
            i, rest = k[len("['blocks']["):].split("]", 1)
            unit = f"['layers'][{int(i) % period}]" if period > 1 else ""
            layers.setdefault("['blocks']" + unit + rest, {})[int(i) // period] = g
        else:
            out[k] = g
    return out | {k: np.stack([v[i] for i in range(len(v))]) for k, v in layers.items()}


def as_pipeline_slices(tokens, M: int, pp: int, dp: int, ep: int):
    """`tokens` reordered so that one device's slice m (rows m, M+m, ...:
    `jaxtp.parallel.schedule`) holds a pipeline's microbatch m: on each
    (dp, ep) rank its stages' rows in stage order, cut in M
    (`jaxtp.parallel.pipeline`), the batch split over (pp, dp, ep)."""
    ranks = np.arange(len(tokens)).reshape(pp, dp * ep, -1).transpose(1, 0, 2)
    micro = ranks.reshape(dp * ep, M, -1).transpose(1, 0, 2).reshape(M, -1)  # [M, rows]
    return tokens[micro.T.reshape(-1)]
