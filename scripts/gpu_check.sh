#!/usr/bin/env bash
# Every GPU check of seqshard in one run, most valuable first, each under its own time limit so
# that one hang costs only its own slot. Results (logs and JSON) go to $OUT (default
# runs/gpu-check). Run from the project root on a machine with one GPU:
#
#   bash scripts/gpu_check.sh                 # everything, about 6 minutes on an H200 (the first check compiles for 80 s)
#   STAGES="check bench" bash scripts/gpu_check.sh
#
# Stages: check   scripts/gpu_check.py: the model on GPU against the reference (f32 and bf16,
#                 cuDNN attention), explicit vs autodiff backward, the matmul paths
#         bench   scripts/bench_gpu.py on the h100-125m/350m/1b configs, causal mask
#         train   seqshard train on configs/h100-125m.yaml for 30 steps on the bundled data
#                 (data/stdlib, prepared here first if absent), a checkpoint, then eval
#         doc     scripts/bench_gpu.py on the 1B with the document mask
set -u
OUT=${OUT:-runs/gpu-check}
STAGES=${STAGES:-check bench train doc}
DEADLINE=${DEADLINE:-560}  # seconds for all stages together: each stage's limit is cut to fit
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

stage() {  # stage NAME SECONDS COMMAND...: run it, its output to the console and $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 5))
  if ((left < 20)); then echo "=== $name skipped: ${left}s left of DEADLINE=$DEADLINE"; return; fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - start))s"
}

nvidia-smi -L 2>/dev/null || true
$PY -c 'import jax; print("jax", jax.__version__, jax.devices())'

for s in $STAGES; do
  case $s in
    check) stage check 200 $PY scripts/gpu_check.py --out "$OUT/check.json" ;;
    bench) stage bench 220 $PY scripts/bench_gpu.py --masks causal \
             --configs configs/h100-1b.yaml,configs/h100-125m.yaml,configs/h100-350m.yaml --steps 6 --warmup 1 \
             --peak-repeats 10 --out "$OUT/bench.json" ;;
    train) stage train 110 $PY -m seqshard.cli train configs/h100-125m.yaml \
             run.dir="$OUT/runs" run.name=h100-125m train.steps=30 train.log_every=5 \
             train.eval_every=30 train.checkpoint_every=30 --sample-tokens 32
           stage eval 45 $PY -m seqshard.cli eval "$OUT/runs/h100-125m"
           rm -rf "$OUT/runs" ;;
    doc) stage doc 120 $PY scripts/bench_gpu.py --configs configs/h100-1b.yaml --masks document \
           --steps 6 --warmup 1 --peak-repeats 10 --out "$OUT/doc.json" ;;
    *) echo "unknown stage $s (check, bench, train, doc)"; exit 2 ;;
  esac
done
