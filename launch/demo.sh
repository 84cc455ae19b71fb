#!/usr/bin/env bash
# The demo: set up .venv if needed, show the rank mapping, then train the tiny GPT with
# tensor 2 x pipeline 2 x data 2 (8 processes) on the CPU with the deepspeed launcher, on the
# built-in synthetic corpus, and report the validation loss against the corpus' entropy floor.
# Each run writes a new directory runs/demo-<time> (metrics.jsonl, checkpoints, W&B offline run,
# curves.png). Extra arguments go to mt3d.train, e.g. `bash launch/demo.sh --set mt3d.train.steps=100`.
set -eo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# The demo is a CPU run whatever the machine has: 8 ranks on gloo.
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
RUN="${RUN:-runs/demo-$(date +%Y%m%d-%H%M%S)}"

echo "== rank mapping: 8 ranks on one host, tp 2 x pp 2 (dp 2) =="
mt3d topo --world-size 8 --gpus-per-node 8 --tp 2 --pp 2 --model tiny --seq-len 64 --micro-batch 2 --grad-accum 4
echo
echo "== training (deepspeed launcher, 8 CPU processes) -> $RUN =="
# --log_level warning: the launcher's own INFO lines (commands, environment) stay quiet;
# DeepSpeed's set-up output goes to $RUN/logs/rank<N>.log (add --verbose to see it here).
deepspeed --log_level warning --num_gpus 8 --module mt3d.train --config ds_configs/cpu_demo_3d.json \
  --set "mt3d.train.save_dir=$RUN" "$@"
echo
echo "== result =="
mt3d summary "$RUN"
echo "curves: $(mt3d plot "$RUN")"
