#!/usr/bin/env bash
# The GPU checks of issue 5 in one device call, in parts (PARTS, default all four):
#   parity  a random Qwen3 of the 0.6B shape saved by transformers, loaded by floe: log-prob
#           error statistics of floe's CUDA (bf16) and CPU (f32) paths against transformers
#   tests   the CUDA tests (ops, transformer, sampler against the CPU)
#   bench   `floe bench --profile` against ../shared/bench/peer_torch.py on the same shapes,
#           with the per-kernel GPU time of one train step and one generation, then the
#           floe/peer ratios (tools/bench_ratios.py); MODELS (default 1.7B) lists the
#           shapes, each named alike by both (0.6B, 1.7B, 4B, 8B; the peer's `tiny` is
#           floe's preset `small`, floe's `tiny` the peer does not have)
#   train   a few GRPO steps of `floe train` on the GPU at the 0.6B and 1.7B shapes, with
#           the step-time breakdown (generate, score, log-probs, train, weight handoff)
#
# Prepare here (no GPU needed), from the repository root:
#   cargo build --release -p floe-cli --features cuda
#   cargo test -p floe-backend -p floe-model -p floe-engine --features floe-backend/cuda \
#     --test cuda_ops --test cuda_transformer --test cuda --no-run   # prints the binaries
#   mkdir -p .device && cp target/release/floe .device/ && strip .device/floe
#   cp <each printed test binary> .device/<its test name>   # and strip them
#   cp ../shared/bench/peer_torch.py tools/device_bench.sh tools/make_hf_fixtures.py \
#     tools/bench_ratios.py recipes/embedded.toml .device/
# then run `bash .device/device_bench.sh` on the device with `.device` carried. Results go
# to $OUT/bench.log; items are skipped once the call nears its time limit (LIMIT seconds).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 RUST_LOG=warn
LIMIT=${LIMIT:-540}
PARTS=${PARTS:-parity tests bench train}
B=${OUT:-.}/bench.log
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {  # run SECONDS CMD...: skipped when it could overrun LIMIT
  local secs=$1; shift
  echo "== $* (t=$(elapsed)s)" | tee -a "$B"
  if [ $(( $(elapsed) + secs )) -gt "$LIMIT" ]; then echo "skipped: time" | tee -a "$B"; return; fi
  timeout "$secs" "$@" 2>&1 | grep -v '^\s*$' | tail -${TAIL:-40} | tee -a "$B"
}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee -a "$B"
if part parity; then
  run 150 python3 make_hf_fixtures.py --scale-parity /tmp/hf_parity
  FLOE_HF_PARITY_DIR=/tmp/hf_parity run 150 ./cuda_transformer --ignored hf_parity_at_0_6b --nocapture
fi
if part tests; then
  for t in cuda_ops cuda_transformer cuda; do
    [ -x "$t" ] && run 90 ./"$t" --test-threads=1
  done
fi
if part bench; then
  for m in ${MODELS:-1.7B}; do
    TAIL=60 run 120 ./floe bench train --device cuda:0 --model $m --random-init --batch 8 --seq 2048 --iters 4 --warmup 1 --profile
    run 70 python3 peer_torch.py --model $m --mode train --batch 8 --seq 2048 --iters 4 --warmup 1
    TAIL=80 run 150 ./floe bench generate --device cuda:0 --model $m --random-init --batch 64,256 --prompt 256 --new 256 --profile
    run 70 python3 peer_torch.py --model $m --mode gen --batch 256 --prompt 256 --new 256
  done
  python3 bench_ratios.py "$B" | tee -a "$B"
fi
if part train; then
  mkdir -p runs
  for m in 0.6B 1.7B; do
    run 150 ./floe train embedded.toml engine.device=cuda:0 engine.recompute=true \
      engine.memory_fraction=${G_MEMORY_FRACTION:-0.9} model.path=embedded:$m sft.enabled=false \
      trainer.logger=[] trainer.run_dir=runs/g$m trainer.max_training_steps=3 trainer.eval_before_train=false \
      trainer.eval_interval=-1 trainer.ckpt_interval=-1 trainer.train_batch_size=32 \
      trainer.policy_mini_batch_size=32 trainer.micro_train_batch_size_per_gpu=64 \
      trainer.micro_forward_batch_size_per_gpu=128 \
      generator.sampling_params.max_generate_length=256 trainer.policy.optimizer_config.lr=1e-6
    [ -f runs/g$m/metrics.jsonl ] && cp runs/g$m/metrics.jsonl "${OUT:-.}/g${m}_metrics.jsonl"
  done
fi
echo "== done (t=$(elapsed)s)" | tee -a "$B"
