"""One process of a multi-process training run (tests/parallel/test_distributed.py starts two).

    python tests/parallel/multihost_worker.py --coordinator localhost:PORT --num-processes 2 \\
        --process-id I --out FILE [--local-devices 4]

Every process trains the same tiny model for a few steps on each mesh in
--meshes (default dp=1 x tp=8, then dp=2 x tp=4), each spanning all processes'
devices; process 0 writes the per-step metrics as JSON to FILE, one entry per
mesh. `run` is also what the test calls in a single process, so the two runs
share every line but `initialize`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `jaxtp`

from jaxtp.parallel import distributed  # noqa: E402  (imports no backend)

STEPS = 3
OVERRIDES = ["model.n_layers=2", "model.d_model=64", "model.n_heads=8", "model.d_ff=128",
             "model.seq_len=32", "train.batch_size=8", f"train.steps={STEPS}",
             # step 1 runs at lr 0; steps 2 and 3 move the parameters
             "train.warmup_steps=2"]
# dp=1 x tp=8: the tp all-reduces cross processes, every process holds the whole batch;
# dp=2 x tp=4: each process holds one dp replica and feeds only its half of the batch
MESHES = ("1x8", "2x4")


def run(dp: int = 1, tp: int = 8) -> dict:
    """Train STEPS steps on the global devices; per-step loss and grad norm, final param norm."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxtp.config import Config, apply_overrides, validate
    from jaxtp.train.data import Dataset, load_tokens
    from jaxtp.parallel import make_mesh, spec
    from jaxtp.train.state import init_train_state
    from jaxtp.train.step import make_train_step, step_controls

    cfg = validate(apply_overrides(Config(), OVERRIDES + [f"parallel.tp={tp}",
                                                           f"parallel.dp={dp}"]))
    m, t = cfg.model, cfg.train
    mesh = make_mesh(dp, tp)
    state = init_train_state(cfg, mesh)
    step = make_train_step(state, use_dropout=False)
    batches = Dataset(load_tokens(None), m.seq_len, m.vocab_size).train_batches(
        t.batch_size, t.seed)
    params, opt_state = state.params, state.opt_state
    base_key = jax.random.key(t.seed)
    losses, grad_norms = [], []
    with jax.set_mesh(mesh):
        for i in range(1, STEPS + 1):
            tokens = distributed.global_batch(next(batches), mesh, spec("batch", None))
            params, opt_state, metrics = step(params, opt_state, tokens,
                                              jax.random.fold_in(base_key, i), step_controls())
            # replicated scalars: every process holds the whole value, so float() works
            losses.append(float(metrics["loss"]))
            grad_norms.append(float(metrics["grad_norm"]))
        # the parameters are sharded across processes: reduce on device to a replicated
        # scalar rather than fetching them (device_get fails on non-addressable shards)
        norm = jax.jit(optax.tree.norm, out_shardings=NamedSharding(mesh, P()))(params)
    return {"losses": losses, "grad_norms": grad_norms, "param_norm": float(norm),
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            # which process holds each device of the (dp, tp) mesh
            "mesh_processes": [[d.process_index for d in row] for row in mesh.devices]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator", required=True, help="host:port of process 0")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--local-devices", type=int, default=4, help="fake CPU devices each")
    ap.add_argument("--meshes", default=",".join(MESHES),
                    help="comma-separated DPxTP meshes to train on, one after the other")
    ap.add_argument("--out", required=True, help="JSON file process 0 writes")
    a = ap.parse_args(argv)
    print(distributed.initialize(a.coordinator, a.num_processes, a.process_id,
                                 a.local_devices), file=sys.stderr, flush=True)
    result = {m: run(*map(int, m.split("x"))) for m in a.meshes.split(",")}
    if distributed.is_main():
        Path(a.out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
