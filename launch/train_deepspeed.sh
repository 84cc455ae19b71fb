#!/usr/bin/env bash
# Single node, N GPUs, with the deepspeed launcher:
#   bash launch/train_deepspeed.sh 8 ds_configs/gpt3_1.3b_8gpu.json [--set key=value ...]
set -eo pipefail
NGPUS="${1:?number of GPUs}"; CONFIG="${2:?config JSON}"; shift 2
exec deepspeed --num_gpus "$NGPUS" --module mt3d.train --config "$CONFIG" "$@"
