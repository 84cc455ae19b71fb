#!/usr/bin/env bash
# Single node with torchrun:
#   bash launch/train_torchrun.sh 8 ds_configs/gpt3_1.3b_8gpu.json [--set key=value ...]
# Two nodes (run on each node, NODE_RANK=0 and 1, MASTER_ADDR = node 0's address):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash launch/train_torchrun.sh 8 ds_configs/X.json
set -eo pipefail
NPROC="${1:?processes per node}"; CONFIG="${2:?config JSON}"; shift 2
exec torchrun --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$NPROC" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  -m mt3d.train --config "$CONFIG" "$@"
