"""The op classes' costs on the devices this process has, measured by
micro-benchmarks that share nothing with the layouts they will price
(`python train.py --plan --calibrate`, `jaxtp.analysis.price.Costs`).

Each class is timed as a chain of K dependent ops inside one program (an
optimization barrier between them, so XLA fuses none), at K = 1 and K = 1 + D:
one op's time is the difference over D, which cancels the program's
dispatch. Every benchmark runs on all `n` devices at once (a shard_map with
no communication for the compute classes): n fake CPU devices share this
machine's cores, so an op's time measured with n running is the time it
takes inside an n-device step. The classes:

- matmul: [r, k] x [k, k] at rising sizes (FLOP/s by flops);
- memory: an elementwise multiply-add over N floats (bytes/s by the 2 x 4N
  bytes it reads and writes);
- loop: a while loop's iteration with a trivial body;
- step: a program's dispatch (the K = 1 time less one op);
- each collective kind over groups of 2 .. n devices at rising sizes
  (bytes/s of the full buffer by its bytes).
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..analysis.price import Costs, Curve

MATMULS = ((64, 32), (256, 64), (512, 128), (2048, 128), (2048, 256), (2048, 512),
           (2048, 1024))
ELEMENTS = (1024, 16384, 262144, 1 << 20, 1 << 22)
COLLECTIVE_BYTES = (1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _per_op(make, args, reps: int, d: int = 8) -> tuple[float, float]:
    """(one op's seconds, the program's seconds less its ops) from chains of 1 and 1 + d."""
    t1 = _time(make(1), args, reps)
    tk = _time(make(1 + d), args, reps)
    one = max((tk - t1) / d, 1e-9)
    return one, max(t1 - one, 0.0)


def _looped(mesh, body, x, reps: int, d: int | None = None) -> float:
    """Seconds of one `body` on each device's block, all devices at once: a
    while loop of 4 + d iterations less one of 4, over d, less an iteration's
    own cost (`loop_seconds`, subtracted by the caller). d defaults to
    enough iterations to move 16 MiB a device, at least 16: a small op's
    difference must stand above the timer's noise."""
    d = d or max(16, min(4096, (16 << 20) // max(x.nbytes // mesh.size, 1)))
    def make(k):
        f = lambda y: jax.lax.fori_loop(0, k, lambda i, v: body(v), y)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                     check_vma=False))
    return max((_time(make(4 + d), (x,), reps) - _time(make(4), (x,), reps)) / d, 1e-9)


def matmul_curve(mesh, reps: int, loop: float, sizes=MATMULS) -> Curve:
    """FLOP/s by flops: at each size the mean time of a step's three
    orientations of [r, k] x [k, k] (the forward's, the input gradient's
    against a transposed weight, the weight gradient's contracting r)."""
    n, pts = mesh.size, []
    for r, k in sizes:
        w = jnp.eye(k, dtype=jnp.float32)
        x = jnp.ones((n * r, k), jnp.float32) * 0.01
        forms = (lambda y: y @ w, lambda y: y @ w.T,
                 lambda y: y + (y.T @ y)[0] * 1e-9)
        d = max(2, min(4096, int(2e8 / (2 * r * k * k))))  # ~0.2 GFLOP a device a timing
        one = sum(_looped(mesh, f, x, reps, d) - loop for f in forms) / len(forms)
        pts.append((2.0 * r * k * k, 2.0 * r * k * k / max(one, 1e-9)))
    return Curve(tuple(sorted(pts)))


# the memory-bound classes (`jaxtp.hlo_ops`: a fusion's class by the ops it holds)
MEMORY_BODIES = {
    "elementwise": lambda y: y * 1.0001 + 0.5,
    "transcendental": lambda y: jnp.tanh(y) * 0.5 + y,
    "transpose": lambda y: y.reshape(-1, 64, 16).transpose(0, 2, 1).reshape(y.shape) + 1.0,
    "reduce": lambda y: y + y.reshape(-1, 64).sum(1).repeat(64) * 1e-6,
}


def memory_curves(mesh, reps: int, loop: float, sizes=ELEMENTS) -> dict[str, Curve]:
    """{class: bytes/s by the bytes one op reads and writes (2 x 4N)}."""
    out = {}
    for cls, body in MEMORY_BODIES.items():
        pts = []
        for e in sizes:
            x = jnp.ones((mesh.size * e,), jnp.float32) * 0.5
            one = max(_looped(mesh, body, x, reps) - loop, 1e-9)
            pts.append((8.0 * e, 8.0 * e / one))
        out[cls] = Curve(tuple(pts))
    return out


def dispatch_seconds(mesh, reps: int) -> float:
    """A program's own cost: a jitted call doing one small op."""
    x = jnp.ones((mesh.size * 8,), jnp.float32)
    f = jax.jit(jax.shard_map(lambda y: y + 1.0, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                              check_vma=False))
    return _time(f, (x,), reps * 4)


def loop_seconds(mesh, reps: int) -> float:
    """A while loop's iteration, its body one scalar add per device."""
    x = jnp.ones((mesh.size,), jnp.float32)
    return _looped(mesh, lambda v: v + 1.0, x, reps, d=256)


def _collective(kind: str, g: int):
    if kind == "all-reduce":
        return lambda y: jax.lax.psum(y, "i")
    if kind == "all-gather":
        return lambda y: jax.lax.all_gather(y[: y.shape[0] // g], "i", tiled=True)
    if kind == "reduce-scatter":
        return lambda y: jnp.tile(jax.lax.psum_scatter(y, "i", tiled=True), g)
    if kind == "all-to-all":
        return lambda y: jax.lax.all_to_all(y.reshape(g, -1), "i", 0, 0, tiled=True).reshape(-1)
    return lambda y: jax.lax.ppermute(y, "i", [(j, (j + 1) % g) for j in range(g)])


def collective_curves(devices, reps: int, sizes=COLLECTIVE_BYTES, wanted=None) -> dict:
    """{"kind/g": Curve of full-buffer bytes/s} over groups of g = 2 .. n
    (only the "kind/g" in `wanted`, where given)."""
    n, out = len(devices), {}
    for g in (2 ** i for i in range(1, n.bit_length()) if n % 2 ** i == 0):
        mesh = Mesh(np.array(devices).reshape(n // g, g), ("o", "i"))
        for kind in (k for k in KINDS if wanted is None or f"{k}/{g}" in wanted):
            pts = []
            for b in sizes:
                e = max(b // 4 // g * g, g)
                x = jax.device_put(jnp.ones((n * e,), jnp.float32) * 0.5,
                                   NamedSharding(mesh, P(("o", "i"))))
                f = _collective(kind, g)

                def make(K, f=f):
                    def chain(y):
                        for _ in range(K):
                            y = jax.lax.optimization_barrier(f(y))
                        return y
                    return jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(("o", "i")),
                                                 out_specs=P(("o", "i")), check_vma=False))

                one, _ = _per_op(make, (x,), reps)
                pts.append((4.0 * e, 4.0 * e / one))
            out[f"{kind}/{g}"] = Curve(tuple(pts))
    return out


def calibrate(n: int | None = None, reps: int = 5, quick: bool = False, log=print,
              collectives=None) -> Costs:
    """The costs of this process's first `n` devices (default all), measured;
    of the collectives only the "kind/group" in `collectives`, where given."""
    devices = jax.devices()[: n or len(jax.devices())]
    mesh = Mesh(np.array(devices), ("d",))
    t0 = time.perf_counter()
    log(f"calibrating the op classes on {len(devices)} {devices[0].platform} device(s) ...")
    loop = loop_seconds(mesh, reps)
    matmul = matmul_curve(mesh, reps, loop, MATMULS[:-1:2] if quick else MATMULS)
    memory = memory_curves(mesh, reps, loop, ELEMENTS[1::2] if quick else ELEMENTS)
    dispatch = dispatch_seconds(mesh, reps)
    colls = collective_curves(devices, reps, COLLECTIVE_BYTES[::2] if quick else
                              COLLECTIVE_BYTES, collectives) if len(devices) > 1 else {}
    # f32 measured; another dtype's matmul is priced at f32's rate
    costs = Costs(f"{devices[0].platform} x{len(devices)}", matmul, {"f32": 1.0},
                  memory["elementwise"], None, 0.0, loop, dispatch, 1.0, colls,
                  {k: v for k, v in memory.items() if k != "elementwise"},
                  source=f"jaxtp.bench.calibrate on {devices[0].device_kind}, "
                         f"{len(devices)} device(s) at once")
    log(f"calibrated in {time.perf_counter() - t0:.0f} s: matmul "
        f"{matmul.points[-1][1] / 1e9:.1f} GFLOP/s at {matmul.points[-1][0] / 1e9:.2f} GFLOP, "
        f"memory {memory['elementwise'].points[-1][1] / 1e9:.1f} GB/s, loop "
        f"{loop * 1e6:.1f} us, dispatch {dispatch * 1e6:.0f} us")
    return costs
