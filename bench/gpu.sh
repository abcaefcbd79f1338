#!/usr/bin/env bash
# The accelerator check of the train step: ANDREA-120M, bfloat16 compute, context 1024,
# batch 32, no remat, cuDNN attention (configs/andrea120m.py), on one GPU, with AdamW and
# with Muon timed side by side in the same rounds.
# Target: 50% MFU in the nanoGPT/PaLM convention against the device's table peak
# (H200: 989 TFLOP/s dense bf16), i.e. a step of about 44 ms (32,768 tokens).
#
#   bash bench/gpu.sh            # needs jax[cuda12]; prints one table in 2-4 minutes
#
# Each optimizer's step compiles in about a minute; 5 rounds of about 2 s of each follow. The
# whole script is bounded by `timeout` to stay under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" - <<'PY'
import jax
device = jax.devices()[0]
if device.platform != "gpu":
    raise SystemExit(f"no GPU visible to JAX (found {device}); install jax[cuda12] on a GPU machine")
print(f"{jax.device_count()} × {device.device_kind}, jax {jax.__version__}")
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader || true
exec timeout 450 "$PYTHON" bench/bench_step.py --only gpu120m --no-torch --no-matmul --optimizers adamw,muon --rounds 5 --rep-seconds 2 "$@"
