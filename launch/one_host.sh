#!/usr/bin/env bash
# All GPUs of one host, one process. usage: launch/one_host.sh CHECKPOINT_DIR MESH
#   e.g. launch/one_host.sh /ckpt/deepseek-v3-fp8 tensor=8
set -euo pipefail
ckpt=${1:?usage: $0 CHECKPOINT_DIR MESH}; mesh=${2:?mesh, e.g. tensor=8 or expert=8}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
python -m dsv3_jax.plan --config "$ckpt" --mesh "$mesh" --dtype "${DTYPE:-fp8}" \
  --max-seq-len "${MAX_SEQ_LEN:-131072}" --device-memory "${DEVICE_MEMORY:-141GB}"
exec python launch/run_multihost.py --single --checkpoint "$ckpt" --mesh "$mesh"
