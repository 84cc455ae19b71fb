#!/usr/bin/env bash
# The GPU record in one device call (docs/benchmarks.md): steps in order of value, each with its own
# time limit, every line appended to $OUT/record.log as it comes, so a call cut short still brings
# back what ran. Prepare here first: `bash launch/device_wheels.sh` (DeepSpeed and its pure-Python
# needs into .whl/); then the device tool runs, carrying .whl:
#   bash launch/gpu_record.sh [part]
# part: "main" (default: GEMMs, one-GPU MFU with FP8, attention, the cp/ep smoke), "second" (FP8
# beside bf16 again, and no, selective and full recompute without compiling) or "third" (the step
# overheads removed: gpt3-1.3b against the code before them, carried in .before/ (`bash
# launch/gpu_record.sh --before REV` makes it), llama-1b, the Qwen3-MoE row against transformers, and
# the GPU-only tests). SMOKE=1 runs the part's commands on the CPU in smoke mode (the dry run) and
# WHEELS=0 skips installing .whl (a CPU machine has DeepSpeed already).
set -uo pipefail
OUT="${OUT:-/tmp/gpu-record}"
mkdir -p "$OUT"
LOG="$OUT/record.log"
part="${1:-main}"
if [ "$part" = --before ]; then  # the mt3d package as it was at REV, for the "before" rows of "third"
    rm -rf .before && mkdir .before && git archive "${2:?--before REV}" mt3d | tar -x -C .before
    grep -qx '/.before/' .git/info/exclude || echo '/.before/' >>.git/info/exclude
    exit 0
fi
if [ "${WHEELS:-1}" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 WANDB_MODE=disabled
export TOKENIZERS_PARALLELISM=false
t_start=$(date +%s)

step() {  # step NAME LIMIT_S COMMAND...: run with a limit, log its output, time and status
    local name=$1 limit=$2
    shift 2
    echo "## $name: $* (limit ${limit} s, at $(( $(date +%s) - t_start )) s)" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" 2>&1 | grep -v -E "Warning|warn\(|^\s*$" >>"$LOG"
    local rc=${PIPESTATUS[0]}
    # a step cut at its limit leaves its ranks (forked by multiprocessing's forkserver) holding the GPU
    pkill -9 -f multiprocessing.forkserver 2>/dev/null
    echo "## $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
}

{
    echo "# launch/gpu_record.sh $part on $(hostname), $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c 'import torch, transformers, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "deepspeed", deepspeed.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
} >>"$LOG" 2>&1

dry=${SMOKE:+--smoke}
gpu="python3 -m mt3d.bench gpu --seq-len 2048 --micro ${MICRO:-16} --steps 6 --warmup 2 --compile-only $dry"
smoke="--set mt3d.parallel.tensor=1 --set mt3d.parallel.pipeline=1 --set mt3d.train.steps=5
 --set mt3d.train.overwrite=true --set wandb.enabled=false --set mt3d.train.eval_interval=0
 --set mt3d.train.eval_batches=0 --set mt3d.train.save_at_end=false --set mt3d.train.log_interval=1
 --set bf16.enabled=true --set mt3d.data.seq_len=128"
share="python3 -m torch.distributed.run --nproc_per_node 2 launch/gpu_share.py --config ds_configs/cpu_demo_3d.json"
if [ "$part" = main ]; then
    step gemm 50 python3 -m mt3d.bench gemm --reps 10 --fp8
    step gpt3-1.3b 230 $gpu --models gpt3-1.3b --fp8 rowwise,tensorwise --profile
    step llama-1b 150 $gpu --models llama-1b --fp8 rowwise
    step attention 100 python3 -m mt3d.bench attention --part patterns --reps 3
    step smoke-cp2 40 $share $smoke --set mt3d.parallel.context=2 --set mt3d.train.save_dir=/tmp/smoke-cp
    step smoke-ep2 40 $share $smoke --set mt3d.model.preset=tiny-mixtral --set mt3d.parallel.expert=2 \
        --set mt3d.train.save_dir=/tmp/smoke-ep
elif [ "$part" = second ]; then  # FP8 after the cast reuse, and the recompute rows (uncompiled)
    eager="python3 -m mt3d.bench gpu --seq-len 2048 --micro ${MICRO:-16} --steps 6 --warmup 2"
    step gpt3-1.3b-fp8 140 $gpu --models gpt3-1.3b --fp8 tensorwise,rowwise --no-hf
    step gpt3-1.3b-recompute 100 $eager --models gpt3-1.3b --recompute none,selective,full --no-hf
    step llama-1b-fp8 130 $gpu --models llama-1b --fp8 tensorwise,rowwise --no-hf
    step llama-1b-recompute 100 $eager --models llama-1b --recompute none,selective,full --no-hf
elif [ "$part" = third ]; then  # the overheads the 2026-11-27 profile found, removed; MoE on a GPU
    moe="python3 -m mt3d.bench gpu --seq-len 2048 --micro 8 --steps 6 --warmup 2 --models qwen3-moe-1.7b $dry"
    step gpt3-1.3b 110 $gpu --models gpt3-1.3b --profile --no-hf
    # from inside .before/: python -m puts the working directory first on the path
    step gpt3-1.3b-before 80 env -C .before PYTHONPATH=/tmp/site:$PWD/.before $gpu --models gpt3-1.3b --no-hf
    step llama-1b 70 $gpu --models llama-1b --no-hf
    step qwen3-moe 110 $moe
    step qwen3-moe-compiled 100 $moe --compile-only --no-hf
    step gpu-tests 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_blocks.py
else
    echo "unknown part $part (main, second, third)" | tee -a "$LOG"
    exit 2
fi
echo "# done after $(( $(date +%s) - t_start )) s" | tee -a "$LOG"
grep '^BENCH ' "$LOG" >"$OUT/bench.jsonl" || true
