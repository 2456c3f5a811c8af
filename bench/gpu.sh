#!/usr/bin/env bash
# GPU benchmark for one NVIDIA GPU; needs only `pip install -e ".[test]"` on a
# machine whose jax already has CUDA. About 5-6 minutes on an H100/H200,
# compilation included.
#
#   1. the GPU-only tests (tests/test_gpu.py: cuDNN and blockwise attention
#      against XLA in bf16, three cuDNN train steps against XLA ones);
#   2. python -m jaxtp.bench --gpu: the llama-1b preset at tp=1, bf16 compute
#      (fp32 master weights and Adam), batch 8 x 4096, scanned layers, the
#      "minimal" remat policy, attention=auto (cuDNN flash attention), the
#      loss in 4096-token chunks, 3 warm-up + 40 timed steps: tokens/s, step
#      time, model TFLOP/s and MFU against the device's dense bf16 peak; then
#      4 x 4096 with cuDNN against XLA attention in the step (XLA's does not
#      fit 8 x 4096: 91 GiB planned); then the attention kernels alone;
#   3. given 2 or more GPUs, python -m jaxtp.bench --gpu-overlap: llama-1b's SP
#      step at tp <= 8 with GSPMD's overlap against none: the windowed-einsum
#      iteration cap the client logs, the loops XLA forms, the step time ratio
#      (unverified until run on such a machine);
#   4. train.py --plan: the llama3-8b preset planned for tp=8, compiled for
#      this GPU model (h200 or h100) without using the device;
#   5. train.py --plan --calibrate: this GPU's op costs by micro-benchmarks, and
#      the one-device layouts' steps priced op by op against their measured times.
#
# Writes $OUT/bench.json and $OUT/bench.md (the overlap and the plan appended),
# $OUT/tests.txt, $OUT/overlap.txt (and $OUT/overlap/ given 2+ GPUs)
# and $OUT/plan-llama3-8b-tp8.txt. Extra arguments go to step 2, e.g.
#   bench/gpu.sh --steps 20 train.batch_size=4
# (JAXTP_BENCH_ANY_DEVICE=1 runs it without a GPU: a dry run of the script.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/bench-gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
# planned at 44.6 GiB for an H100 (jaxtp.parallel.targets compile): above JAX's
# default 75% pool on smaller cards; let it take 90%
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

KIND=$("$PY" -c 'import jax; d = jax.devices()[0]; print(d.platform, d.device_kind)')
echo "device: $KIND"
if [[ "$KIND" != gpu* ]]; then
  if [ -z "${JAXTP_BENCH_ANY_DEVICE:-}" ]; then
    echo "error: no GPU visible to JAX (got: $KIND); install jax with CUDA" >&2
    exit 2
  fi
  echo "JAXTP_BENCH_ANY_DEVICE is set: a dry run of this script on $KIND"
fi
case "$KIND" in
  *H200*) HW=h200 ;;
  *) HW=h100 ;;  # the planner knows h100, h200, tpu-v5p; other GPUs are planned as an H100
esac

JAXTP_GPU_TESTS=1 "$PY" -m pytest -q -n 0 -p no:cacheprovider tests/test_gpu.py 2>&1 \
  | tee "$OUT/tests.txt" || true

"$PY" -m jaxtp.bench --gpu --gpu-config llama-1b --out "$OUT" "$@"

# GSPMD's overlap, given 2 or more GPUs (unverified until run there: no session has
# had more than one): the windowed-einsum cap this client logs, the loops XLA forms
# in the SP step at tp <= 8, and its step time against no overlap
NDEV=$("$PY" -c 'import jax; print(jax.device_count())')
if [ "$NDEV" -ge 2 ]; then
  "$PY" -m jaxtp.bench --gpu-overlap --gpu-config llama-1b --out "$OUT/overlap" \
    | tee "$OUT/overlap.txt"
  { echo; tail -n +3 "$OUT/overlap/bench.md"; } >> "$OUT/bench.md"
else
  echo "overlap: $NDEV device here; GSPMD's windowed loops need 2 or more GPUs (skipped)" \
    | tee "$OUT/overlap.txt"
fi

# compile-only devices of the GPU model (jaxtp.parallel.targets): the device stays free
JAX_PLATFORMS=cpu "$PY" train.py --config llama3-8b --plan --tp 8 --hardware "$HW" \
  | tee "$OUT/plan-llama3-8b-tp8.txt"
{
  echo
  echo "### Plan: llama3-8b at tp=8 on $HW (\`train.py --config llama3-8b --plan --tp 8 --hardware $HW\`)"
  echo
  echo '```'
  cat "$OUT/plan-llama3-8b-tp8.txt"
  echo '```'
} >> "$OUT/bench.md"

# the op-by-op predictor calibrated on this GPU (jaxtp.bench.calibrate) and its
# predictions of the one-device layouts against their measured steps
"$PY" train.py --plan --calibrate --out "$OUT/calibration" | tee "$OUT/calibration.txt"
{ echo; echo "### Op-by-op prediction calibrated on this GPU (\`train.py --plan --calibrate\`)"
  echo; echo '```'; tail -n 14 "$OUT/calibration.txt"; echo '```'; } >> "$OUT/bench.md"
echo "wrote $OUT/bench.json, $OUT/bench.md, $OUT/tests.txt"
