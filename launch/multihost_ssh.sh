#!/usr/bin/env bash
# Several hosts over plain ssh, explicit coordinator flags: one process per host, host 0 coordinates.
# usage: HOSTS="gpu-a gpu-b" launch/multihost_ssh.sh CHECKPOINT_DIR MESH
#   e.g. HOSTS="gpu-a gpu-b" launch/multihost_ssh.sh /shared/ckpt data=2,tensor=8
# The repository and the checkpoint must be at the same path on every host.
set -euo pipefail
ckpt=${1:?usage: HOSTS="h0 h1" $0 CHECKPOINT_DIR MESH}; mesh=${2:?mesh}
read -r -a hosts <<< "${HOSTS:?set HOSTS to the space-separated host names}"
port=${PORT:-12355}; n=${#hosts[@]}; repo=$(cd "$(dirname "$0")/.." && pwd)
for i in "${!hosts[@]}"; do
  ssh "${hosts[$i]}" "cd $repo && XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python launch/run_multihost.py \
    --checkpoint $ckpt --mesh $mesh --coordinator ${hosts[0]}:$port --num-processes $n --process-id $i" &
done
wait
