#!/usr/bin/env bash
# GPU benchmark for one NVIDIA GPU; needs only `pip install -e .` on a machine
# whose jax already has CUDA. About 3-5 minutes on an H100/H200, compilation
# included (budget: under 8).
#
#   1. python -m jaxtp.bench --gpu: the llama-1b preset at tp=1, bf16 compute
#      (fp32 master weights and Adam), batch 4 x 2048, scanned layers, "dots"
#      remat, 3 warm-up + 40 timed steps: tokens/s, step time, model TFLOP/s
#      and MFU against the device's dense bf16 peak; then the attention of
#      those shapes with jax.nn.dot_product_attention, XLA vs cuDNN.
#   2. train.py --plan: the llama3-8b preset planned for tp=8 on the roofline
#      of this GPU model (h200 or h100), on CPU with abstract shapes.
#
# Writes $OUT/bench.json and $OUT/bench.md (the plan appended), and
# $OUT/plan-llama3-8b-tp8.txt. Extra arguments go to step 1, e.g.
#   bench/gpu.sh --steps 20 train.batch_size=2
# (JAXTP_BENCH_ANY_DEVICE=1 runs it without a GPU: a dry run of the script.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-runs/bench-gpu-$(date +%Y%m%d-%H%M%S)}
# fp32 master weights + Adam + activations: ~48 GB (CPU memory_analysis of
# this step); let JAX take more than its default 75% of the device
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

"$PY" -m jaxtp.bench --gpu --gpu-config llama-1b --out "$OUT" "$@"

# planning compiles for fake CPU devices: keep it off the GPU
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
echo "wrote $OUT/bench.json, $OUT/bench.md"
