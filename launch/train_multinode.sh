#!/usr/bin/env bash
# Multi-node with the deepspeed launcher (passwordless ssh to every host in the hostfile; the same
# checkout and virtualenv path on every host):
#   bash launch/train_multinode.sh launch/hostfile.example ds_configs/megatron_8.3b_tp8.json
# mt3d discovers the hosts from the launcher (uneven slots are fine) and keeps TP groups inside them;
# check the layout first with: mt3d topo --hostfile launch/hostfile.example --tp 8 --pp 1
set -eo pipefail
HOSTFILE="${1:?hostfile}"; CONFIG="${2:?config JSON}"; shift 2
exec deepspeed --hostfile "$HOSTFILE" --module mt3d.train --config "$CONFIG" "$@"
