#!/usr/bin/env bash
# Runs the CPU benchmark set and writes runs/bench/<date>.md (Markdown tables) next to the raw
# BENCH lines (<date>.log). On a machine with a GPU, `python -m mt3d.bench gpu --compile` adds the
# GPU figures. Usage: bash launch/bench.sh [bench names...]   (default: every CPU benchmark)
set -eo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
out="runs/bench"; mkdir -p "$out"
stamp="$(date +%Y%m%d-%H%M%S)"
log="$out/$stamp.log"
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=(overhead bubble comm memory preprocess checkpoint planner gpu)
for b in "${benches[@]}"; do
  echo "== $b =="
  extra=()
  [ "$b" = gpu ] && extra=(--smoke)
  python -m mt3d.bench "$b" "${extra[@]}" 2>&1 | tee -a "$log" | grep -v '^\[20' | grep -v '^BENCH' || true
done
python -m mt3d.bench.report "$log" > "$out/$stamp.md"
echo "tables: $out/$stamp.md"
