"""What XLA made of GSPMD's overlap: the iteration cap a compile logs, the
windowed-einsum loops the compiled step holds per region and pass (or why
there are none), and the compile-only proof past the CPU threshold.

When XLA forms its loops, per backend: `jaxtp.parallel.xla_overlap`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import hlo
from ..config import Config, ModelConfig, ParallelConfig, TrainConfig
from ..parallel import TP_AXIS
from ..parallel.xla_overlap import Forms, activation_bytes
from .budget import expected_collectives
from .rows import check
from ..parallel.targets import compile_only_devices

CAP_LOG = re.compile(r"Set SPMD max windowed einsum iteration to (-?\d+)")
LOG_ENV = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "stateful_rng_spmd_partitioner=3"}


def logged_cap(target: str = "cpu", timeout: float = 300) -> int | None:
    """The windowed-einsum iteration cap XLA's compiler logs for `target`
    ("cpu", "local" for this machine's accelerator, or a GPU in
    `jaxtp.hardware.HARDWARE` compiled deviceless), read from a
    subprocess that compiles one small partitioned dot with the partitioner's
    logging on; None where it logged none (or the compiler is absent)."""
    # no compilation cache: a cached program is not partitioned again, and logs nothing
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(LOG_ENV, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", JAX_ENABLE_COMPILATION_CACHE="false",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")  # beside a process holding the GPU
    try:
        run = subprocess.run([sys.executable, "-m", "jaxtp.analysis.windowed", target],
                             env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    found = CAP_LOG.findall(run.stderr)
    return int(found[-1]) if found else None


def report(impl: str, platform: str, forms_: Forms, loops: dict) -> list[str]:
    """What XLA made of the overlap asked for: the loops per region and
    pass, or the reason there are none."""
    if not loops:
        return [f"{impl} on {platform}: no windowed-einsum loop: {forms_.why}"]
    total = sum(loops.values())
    by = ", ".join(f"{scope or '-'} {pass_} {n} {kind}" for (kind, pass_, scope), n in
                   sorted(loops.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])))
    return [f"{impl} on {platform}: XLA's windowed einsum formed {total} loops ({by}); each "
            "loop permutes one [b, s/tp, h] chunk tp times"]


def _probe(target: str) -> None:
    """Compile one dot that meets the all-gather loop's pattern on two
    devices of `target` (the compile logs the cap)."""
    if target == "cpu":
        jax.config.update("jax_num_cpu_devices", 2)
        devices = jax.devices("cpu")[:2]
    elif target == "local":
        devices = jax.devices()[:2]
    else:
        devices = compile_only_devices(target, 2)
    mesh = jax.make_mesh((len(devices),), (TP_AXIS,), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct((2, 64, 32), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, TP_AXIS)))
    w = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, TP_AXIS)))
    with jax.set_mesh(mesh):
        jax.jit(lambda x, w: jax.lax.with_sharding_constraint(x @ w, P(None, None, TP_AXIS))) \
            .lower(x, w).compile()




# the compile-only proof: 2-block models whose [b, s, h] activation (bf16,
# 8 x 2^20 x 8192: 128 GiB global, nothing allocated) is past XLA's CPU
# threshold of 100000 MiB, with 64 heads of 128 and a one-chunk loss
PROOF_MODELS = {
    "gpt2": dict(style="gpt2", d_ff=32768, n_kv_heads=0, tie_embeddings=True, use_bias=True),
    "llama": dict(style="llama", d_ff=28672, n_kv_heads=8, tie_embeddings=False,
                  use_bias=False),
}


# what stays an activation-sized collective outside the loops, and why
OUTSIDE_LOOPS = {
    **{("all-gather", "backward", scope): "the output gradient: read by two dots (dX, dW), "
       "XLA shares one plain gather" for scope in ("attention", "mlp")},
    # the CPU compiler's reduce-scatter is an all-reduce and a slice
    **{(kind, "forward", "embed"): "the lookup's rows summed: a gather, not a dot"
       for kind in ("reduce-scatter", "all-reduce")},
    ("all-gather", "backward", "embed"): "the lookup's gradient: a scatter, not a dot",
}


def proof_config(model: str, impl: str, remat: str = "none") -> Config:
    """The step the proof compiles: `model` ("gpt2", "llama") at tp=8 with
    SP and the overlap, under `impl` (gspmd or explicit)."""
    m = ModelConfig(**PROOF_MODELS[model], vocab_size=256, n_layers=2, d_model=8192,
                    n_heads=64, seq_len=2**20, dtype="bfloat16", attention="blockwise",
                    attention_block=4096, remat=remat, loss_chunk=0)
    return Config(model=m, train=TrainConfig(batch_size=8),
                  parallel=ParallelConfig(tp=8, impl=impl, sp=True, overlap="collective_matmul"))


def budgeted_loops(expected: list, tp: int) -> Counter:
    """{(kind, pass, scope): loops} of a budget's windowed-loop rows: tp
    permutes each (XLA's loop runs tp steps, one chunk each)."""
    out = Counter()
    for e in expected:
        m = re.match(r"windowed (all-gather|reduce-scatter) loop", e.name)
        if m:
            out[(m.group(1), e.pass_, e.scope)] += e.count // tp
    return out


def prove(cfg: Config, mesh, log: Callable[[str], None] = print, *,
          compile_step: Callable) -> dict:
    """Compile the step of `cfg` on `mesh` (compile-only, abstract) and hold
    it to the overlapped budget: every collective by kind, pass, scope, size
    and count; the loops per region and pass; the bytes each loop moves
    (tp chunks: the activation, tp/(tp-1) of the ring bytes of the
    collective it replaces); and nothing activation-sized left outside the
    loops but what the budget says cannot be a loop."""
    p = cfg.parallel
    t0 = time.perf_counter()
    text = compile_step(cfg, mesh)[1].as_text()  # jaxtp.train.step.compiled_step
    colls = hlo.collectives(text)
    expected = expected_collectives(cfg, p.impl, "cpu")
    loops, want = hlo.windowed_loops(text), budgeted_loops(expected, p.tp)
    act = activation_bytes(cfg) // np.dtype(cfg.model.dtype).itemsize  # elements
    # bytes of one loop's permutes against the [b, s, h] activation it gathers or scatters
    per_loop = {c.kind: c.elements * p.tp for c in colls if c.kind == "collective-permute"}
    b = cfg.train.batch_size // p.dp
    outside = sorted({(c.kind, c.pass_, c.scope) for c in colls if c.kind != "collective-permute"
                      and c.shape[:1] == (b,) and c.elements * p.tp >= act})
    result = {
        "model": cfg.model.style, "impl": p.impl, "compile_s": time.perf_counter() - t0,
        "budget": check(colls, expected, dict(mesh.shape)) or "matches",
        "loops": {f"{k} {ps} {sc}": n for (k, ps, sc), n in sorted(loops.items())},
        "loops_budgeted": {f"{k} {ps} {sc}": n for (k, ps, sc), n in sorted(want.items())},
        "loop_elements_over_activation": {k: v / act for k, v in per_loop.items()},
        "activation_sized_outside_loops": {" ".join(x): OUTSIDE_LOOPS.get(x, "not a loop: why?")
                                           for x in outside},
    }
    result["ok"] = result["budget"] == "matches" and loops == want and all(
        v == 1 for v in result["loop_elements_over_activation"].values()) and \
        set(outside) <= set(OUTSIDE_LOOPS)
    log(f"{cfg.model.style} {p.impl}: {sum(loops.values())} loops "
        f"({sum(n for (k, _, _), n in loops.items() if k == 'all-gather')} all-gather, "
        f"{sum(n for (k, _, _), n in loops.items() if k == 'reduce-scatter')} reduce-scatter), "
        f"budget {result['budget']}, {result['compile_s']:.0f} s")
    return result


if __name__ == "__main__":
    _probe(sys.argv[1] if len(sys.argv) > 1 else "cpu")
