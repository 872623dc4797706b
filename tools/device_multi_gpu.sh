#!/usr/bin/env bash
# Issue 18 on a machine with several GPUs, in one device call, in parts (PARTS, default
# all); N GPUs (default: every visible one). Results in $OUT/multi_gpu.log.
#   collective  the NCCL collective against the in-process one on every visible GPU, and
#               its watchdog (crates/backend/tests/cuda_collective.rs)
#   train       `floe launch --gpus N -- train` of the embedded recipe on the GPUs, with
#               the optimizer replicated (zero_stage 0) and split (zero_stage 1), and the
#               gradients split too (zero_stage 2), against one GPU: every metric within
#               tolerance (sums in another order); the zero_stage 1 run resumed from its
#               step-3 checkpoint on N/2 GPUs and on one, the zero_stage 2 run's at stage 1
#   kill        N ranks started as torchrun would (not `floe launch`, which stops the others
#               itself); rank 1 is killed with SIGKILL after the first checkpoint; every
#               other rank must exit within seconds naming rank 1 (the liveness links),
#               at the latest within FLOE_NCCL_TIMEOUT_SECS + the grace period
#   scale       `floe bench train` at the 1.7B shape, 8 x 2048 tokens a GPU with
#               recompute, on one GPU and on N (zero stage 0, 1 and 2): tokens/s per GPU and
#               the scaling; `floe bench generate` on every GPU at once (per-GPU new tok/s)
#   tp          `floe bench generate --tensor-parallel` over the N GPUs: the 8B shape
#               against one GPU, and the 32B shape, whose bf16 weights (65 GB) leave one
#               80 GB card too little KV cache
#
# Prepare here (no GPU needed), from the repository root:
#   CARGO_TARGET_DIR=target-cuda cargo build --release -p floe-cli --features cuda
#   CARGO_TARGET_DIR=target-cuda cargo test --release -p floe-backend --features cuda \
#     --test cuda_collective --no-run          # prints the test binary's path
#   mkdir -p .device && strip -o .device/floe target-cuda/release/floe && gzip -f .device/floe
#   cp <the printed binary> .device/cuda_collective && strip .device/cuda_collective
#   cp tools/device_multi_gpu.sh recipes/embedded.toml .device/
# then run `bash .device/device_multi_gpu.sh` on the device with `.device` carried.
cd "$(dirname "$0")"
[ -f floe.gz ] && gunzip -f floe.gz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 RUST_LOG=warn PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-560}
PARTS=${PARTS:-collective train kill scale tp}
N=${N:-$(nvidia-smi -L | wc -l)}
L=${OUT:-.}/multi_gpu.log
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {  # run SECONDS CMD...: skipped when it could overrun LIMIT
  local secs=$1; shift
  echo "== $* (t=$(elapsed)s)" | tee -a "$L"
  if [ $(( $(elapsed) + secs )) -gt "$LIMIT" ]; then echo "skipped: time" | tee -a "$L"; return; fi
  timeout "$secs" "$@" 2>&1 | grep -v '^\s*$' | tail -${TAIL:-30} | tee -a "$L"
}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee -a "$L"
nvidia-smi topo -m 2>&1 | head -12 | tee -a "$L"
echo "N=$N" | tee -a "$L"

if part collective && [ -x cuda_collective ]; then
  TAIL=20 run 120 ./cuda_collective --test-threads=1 --nocapture
fi

# The embedded recipe on the GPU: a short warm start, 6 RL steps, a checkpoint every 3.
train() {  # train GPUS RUN_DIR [OVERRIDES...]
  local gpus=$1 dir=$2; shift 2
  local args=(train embedded.toml engine.device=cuda:0 engine.memory_fraction=0.3 sft.epochs=1
    trainer.logger=[] trainer.run_dir="$dir" trainer.max_training_steps=6 trainer.ckpt_interval=3
    trainer.max_ckpts_to_keep=-1 trainer.eval_interval=-1 trainer.eval_before_train=false "$@")
  if [ "$gpus" = 1 ]; then ./floe "${args[@]}"; else ./floe launch --gpus "$gpus" -- "${args[@]}"; fi
}
compare() {  # compare WHAT RUN_A RUN_B FIRST_STEP: every metric of steps >= FIRST_STEP
  python3 - "$@" <<'PY' | tee -a "$L"
import json, sys
what, a, b, first = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def load(p):
    out = {}
    for line in open(p + "/metrics.jsonl"):
        r = json.loads(line)
        if r["step"] < first:
            continue
        m = {k: v for k, v in r.get("metrics", {}).items()
             if not k.startswith("timing/") and not k.endswith("_s")}
        out.setdefault(r["step"], {}).update(m)
    return out
x, y = load(a), load(b)
worst, bad = 0.0, []
for s in sorted(x):
    for k, v in x[s].items():
        w = y.get(s, {}).get(k)
        if not isinstance(v, (int, float)) or not isinstance(w, (int, float)):
            continue
        rel = abs(v - w) / max(abs(v), abs(w), 1.0)
        worst = max(worst, rel)
        if rel > 1e-3:
            bad.append(f"  step {s} {k}: {v} vs {w}")
print(f"{what}: {sum(len(m) for m in x.values())} metrics of steps {sorted(x)}, "
      f"largest relative difference {worst:.2e}; {len(bad)} above 1e-3")
print("\n".join(bad[:20]))
PY
}
if part train; then
  rm -rf runs
  run 150 train 1 runs/one
  run 150 train "$N" runs/ddp
  compare "DDP on $N GPUs vs one" runs/ddp runs/one 1
  run 150 train "$N" runs/zero1 engine.zero_stage=1
  compare "zero stage 1 on $N GPUs vs one" runs/zero1 runs/one 1
  ls runs/zero1/checkpoints/global_step_3/engine | tee -a "$L"
  half=$(( N / 2 > 1 ? N / 2 : 1 ))
  for gpus in "$half" 1; do
    run 150 train "$gpus" runs/zero1-on-$gpus engine.zero_stage=1 \
      trainer.resume="$PWD/runs/zero1/checkpoints/global_step_3"
    compare "zero stage 1 resumed on $gpus GPUs vs straight on $N" runs/zero1-on-$gpus runs/zero1 4
  done
  run 150 train "$N" runs/zero2 engine.zero_stage=2
  compare "zero stage 2 on $N GPUs vs one" runs/zero2 runs/one 1
  run 150 train "$half" runs/zero2-on-$half engine.zero_stage=1 \
    trainer.resume="$PWD/runs/zero2/checkpoints/global_step_3"
  compare "zero stage 2 resumed at stage 1 on $half GPUs vs straight on $N" \
    runs/zero2-on-$half runs/zero2 4
fi

if part kill && [ "$N" -ge 2 ]; then
  echo "== kill rank 1 of $N after the first checkpoint (t=$(elapsed)s)" | tee -a "$L"
  rm -rf runs/kill && mkdir -p runs/kill
  export FLOE_NCCL_TIMEOUT_SECS=60 FLOE_NCCL_ABORT_GRACE_SECS=10
  pids=()
  for r in $(seq 0 $(( N - 1 ))); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$N MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
      ./floe train embedded.toml engine.device=cuda:0 engine.memory_fraction=0.3 sft.epochs=1 \
      trainer.logger=[] trainer.run_dir=runs/kill trainer.max_training_steps=40 \
      trainer.ckpt_interval=3 trainer.eval_interval=-1 trainer.eval_before_train=false \
      > runs/kill/rank-$r.log 2>&1 &
    pids+=($!)
  done
  until [ -d runs/kill/checkpoints/global_step_3 ] || ! kill -0 "${pids[0]}" 2>/dev/null; do sleep 0.5; done
  kill -9 "${pids[1]}"; killed=$(date +%s)
  echo "killed rank 1 at t=$(elapsed)s" | tee -a "$L"
  for r in $(seq 0 $(( N - 1 ))); do
    [ "$r" = 1 ] && continue
    waited=0
    while kill -0 "${pids[$r]}" 2>/dev/null && [ $waited -lt 150 ]; do sleep 1; waited=$(( waited + 1 )); done
    if kill -0 "${pids[$r]}" 2>/dev/null; then
      echo "rank $r: still running $(( $(date +%s) - killed ))s after the kill (HANGS)" | tee -a "$L"
      kill -9 "${pids[$r]}"
    else
      wait "${pids[$r]}"; code=$?
      echo "rank $r: exited with $code $(( $(date +%s) - killed ))s after the kill:" | tee -a "$L"
      grep -v '^\s*$' runs/kill/rank-$r.log | tail -3 | sed 's/^/    /' | tee -a "$L"
    fi
  done
  unset FLOE_NCCL_TIMEOUT_SECS FLOE_NCCL_ABORT_GRACE_SECS
fi

if part scale; then
  bench=(bench train --device cuda:0 --model 1.7B --batch 8 --seq 2048 --iters 3 --warmup 1)
  TAIL=4 run 120 ./floe "${bench[@]}"
  TAIL=4 run 150 ./floe launch --gpus "$N" -- "${bench[@]}"
  TAIL=4 run 150 ./floe launch --gpus "$N" -- "${bench[@]}" --zero-stage 1
  TAIL=4 run 150 ./floe launch --gpus "$N" -- "${bench[@]}" --zero-stage 2
  TAIL=$(( 2 * N + 2 )) run 120 ./floe launch --gpus "$N" -- bench generate --device cuda:0 \
    --model 1.7B --batch 256 --prompt 256 --new 256
fi
if part tp; then
  gen=(bench generate --device cuda:0 --batch 64,256 --prompt 256 --new 256)
  TAIL=4 run 120 ./floe "${gen[@]}" --model 8B
  TAIL=4 run 150 ./floe launch --gpus "$N" -- "${gen[@]}" --model 8B --tensor-parallel
  TAIL=4 run 200 ./floe launch --gpus "$N" -- "${gen[@]}" --model 32B --tensor-parallel
fi
echo "done at t=$(elapsed)s" | tee -a "$L"
