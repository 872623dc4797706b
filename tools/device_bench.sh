#!/usr/bin/env bash
# The GPU checks of issue 5 in one device call: the CUDA tests (ops, transformer, sampler
# against the CPU), `floe bench` against ../shared/bench/peer_torch.py on the same shapes,
# then a short `floe train` on the GPU.
#
# Prepare here (no GPU needed), from the repository root:
#   cargo build --release -p floe-cli --features cuda
#   cargo test -p floe-backend -p floe-model -p floe-engine --features floe-backend/cuda \
#     --test cuda_ops --test cuda_transformer --test cuda --no-run   # prints the binaries
#   mkdir -p .device && cp target/release/floe .device/ && strip .device/floe
#   cp <each printed test binary> .device/<its test name>
#   cp ../shared/bench/peer_torch.py tools/device_bench.sh recipes/embedded.toml .device/
# then run `bash .device/device_bench.sh` on the device with `.device` carried. Results go
# to $OUT/bench.log; items are skipped once the call nears its time limit (LIMIT seconds).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 RUST_LOG=warn
LIMIT=${LIMIT:-540}
B=${OUT:-.}/bench.log
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {  # run SECONDS CMD...: skipped when it could overrun LIMIT
  local secs=$1; shift
  echo "== $* (t=$(elapsed)s)" | tee -a "$B"
  if [ $(( $(elapsed) + secs )) -gt "$LIMIT" ]; then echo "skipped: time" | tee -a "$B"; return; fi
  timeout "$secs" "$@" 2>&1 | grep -v '^\s*$' | tail -40 | tee -a "$B"
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee -a "$B"
for t in cuda_ops cuda_transformer cuda; do
  [ -x "$t" ] && run 90 ./"$t" --test-threads=1
done
for m in ${MODELS:-1.7B}; do
  run 100 ./floe bench train --device cuda:0 --model $m --random-init --batch 8 --seq 2048 --iters 4 --warmup 1
  run 70 python3 peer_torch.py --model $m --mode train --batch 8 --seq 2048 --iters 4 --warmup 1
  run 100 ./floe bench generate --device cuda:0 --model $m --random-init --batch 64,256 --prompt 256 --new 256
  run 70 python3 peer_torch.py --model $m --mode gen --batch 256 --prompt 256 --new 256
done
mkdir -p runs
run 120 ./floe train embedded.toml engine.device=cuda:0 model.path=embedded:0.6B sft.enabled=false \
  trainer.run_dir=runs/g06 trainer.max_training_steps=3 trainer.eval_before_train=false \
  trainer.eval_interval=-1 trainer.train_batch_size=32 trainer.policy_mini_batch_size=32 \
  trainer.micro_train_batch_size_per_gpu=64 trainer.micro_forward_batch_size_per_gpu=128 \
  generator.sampling_params.max_generate_length=256 trainer.policy.optimizer_config.lr=1e-6
[ -f runs/g06/metrics.jsonl ] && cp runs/g06/metrics.jsonl "${OUT:-.}/g06_metrics.jsonl"
echo "== done (t=$(elapsed)s)" | tee -a "$B"
