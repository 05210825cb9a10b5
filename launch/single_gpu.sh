#!/usr/bin/env bash
# One GPU: a checkpoint small enough for one device (the tiny test models, or a reduced config).
# usage: launch/single_gpu.sh /path/to/checkpoint [extra generate args]
set -euo pipefail
ckpt=${1:?usage: $0 CHECKPOINT_DIR [generate args]}; shift
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
python -m dsv3_jax.plan --config "$ckpt" --mesh tensor=1 --dtype "${DTYPE:-bf16}" \
  --max-seq-len "${MAX_SEQ_LEN:-4096}" --device-memory "${DEVICE_MEMORY:-141GB}" || true
exec python -m dsv3_jax.generate --ckpt "$ckpt" "$@"
