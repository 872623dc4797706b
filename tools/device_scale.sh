#!/usr/bin/env bash
# The one-GPU scale checks of issue 22 in one device call, in parts (PARTS, default all):
#   tests   the CUDA tests: ops, the transformer (and LoRA) against the CPU, the sampler,
#           and the optimizer in host memory against the one on the device
#   bench   `floe bench train`, 8 x 2048 tokens with recompute: the 1.7B shape with the
#           optimizer on the device, the 8B shape with it in host memory (the memory plan,
#           the time to make the weights, tokens/s, the optimizer step's time, GPU memory)
#   grpo    5 GRPO steps of `floe train` at the 8B shape (embedded:8B: random weights over
#           the embedded 1k-id tokenizer), full parameters, optimizer in host memory,
#           8 prompts x 8 samples of up to 1024 new tokens, with the step-time breakdown
#   lora    3 GRPO steps of embedded:8B with rank-32 LoRA adapters on a frozen bf16 base
#   lora32  the same at the 32B shape (an H200; not in the default PARTS)
#   lora32s the 32B shape on an 80 GB card: 1 prompt x 8 samples of up to 512 new tokens,
#           4096-token micro-batches (not in the default PARTS)
#   long    long sequences: the 4B shape with 8 x 4096 tokens (first with the optimizer
#           on the device, which the memory plan should refuse, then in host memory),
#           and the 1.7B shape with one 32768-token sequence
#   plan    `floe plan` of the 1.7B, 8B and 32B recipes at this card's memory
#
# Prepare here (no GPU needed), from the repository root:
#   CARGO_TARGET_DIR=target-cuda cargo build --release -p floe-cli --features cuda
#   CARGO_TARGET_DIR=target-cuda cargo test -p floe-backend -p floe-model -p floe-engine \
#     --features floe-backend/cuda --test cuda_ops --test cuda_transformer --test cuda --no-run
#   mkdir -p .device && cp target-cuda/release/floe .device/ && strip .device/floe
#   cp <each printed test binary> .device/<its test name>   # and strip them
#   cp tools/device_scale.sh recipes/*.toml .device/
# then run `bash .device/device_scale.sh` on the device with `.device` carried. Results go
# to $OUT/scale.log; items are skipped once the call nears its time limit (LIMIT seconds).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 RUST_LOG=warn
LIMIT=${LIMIT:-560}
PARTS=${PARTS:-tests bench grpo lora long plan}
L=${OUT:-.}/scale.log
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {  # run SECONDS CMD...: skipped when it could overrun LIMIT
  local secs=$1; shift
  echo "== $* (t=$(elapsed)s)" | tee -a "$L"
  if [ $(( $(elapsed) + secs )) -gt "$LIMIT" ]; then echo "skipped: time" | tee -a "$L"; return; fi
  /usr/bin/time -f "wall %es, peak host RSS %MkB" timeout "$secs" "$@" 2>&1 \
    | grep -v '^\s*$' | tail -${TAIL:-40} | tee -a "$L"
}
part() { [[ " $PARTS " == *" $1 "* ]]; }
gpu_watch() {  # the largest GPU memory in use while the named run lasts, every 0.5 s
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "/tmp/gpu_$1.csv" &
  echo $!
}
peak() { echo "peak GPU memory in use: $(sort -n "/tmp/gpu_$1.csv" | tail -1) MiB" | tee -a "$L"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$L"
free -g | head -2 | tee -a "$L"
if part tests; then
  for t in cuda_ops cuda_transformer cuda; do
    # TESTS_FILTER runs only the tests whose names contain it.
    [ -x "$t" ] && TAIL=25 run 120 ./"$t" --test-threads=1 --nocapture ${TESTS_FILTER:-}
  done
fi
if part bench; then
  w=$(gpu_watch b17)
  TAIL=30 run 100 ./floe bench train --device cuda:0 --model 1.7B --batch 8 --seq 2048 --iters 3 --warmup 1
  kill "$w"; peak b17
  w=$(gpu_watch b8)
  TAIL=30 run 200 ./floe bench train --device cuda:0 --model 8B --batch 8 --seq 2048 --iters 3 --warmup 1 \
    --offload-optimizer
  kill "$w"; peak b8
fi
if part grpo; then
  mkdir -p runs
  w=$(gpu_watch g8)
  TAIL=30 run "${GRPO_SECS:-400}" ./floe train embedded.toml engine.device=cuda:0 engine.recompute=true \
    engine.offload_optimizer=true engine.memory_fraction=0.92 model.path=embedded:8B sft.enabled=false \
    trainer.logger=[] trainer.run_dir=runs/g8B trainer.max_training_steps=5 trainer.eval_before_train=false \
    trainer.eval_interval=-1 trainer.ckpt_interval=-1 trainer.train_batch_size=8 \
    trainer.policy_mini_batch_size=8 trainer.max_tokens_per_microbatch=8192 \
    trainer.micro_forward_batch_size_per_gpu=64 generator.n_samples_per_prompt=8 \
    generator.sampling_params.max_generate_length=1024 generator.eval_sampling_params.max_generate_length=1024 \
    trainer.policy.optimizer_config.lr=1e-6
  kill "$w"; peak g8
  [ -f runs/g8B/metrics.jsonl ] && cp runs/g8B/metrics.jsonl "${OUT:-.}/g8B_metrics.jsonl"
fi
# GRPO with LoRA adapters on a frozen bf16 base: grpo_lora SIZE STEPS SECS [PROMPTS NEW_TOKENS
# MICRO_BATCH_TOKENS] (8B on an H100, 32B on an H200: the grpo part's batch by default).
grpo_lora() {
  local prompts=${4:-8} new=${5:-1024} micro=${6:-8192}
  mkdir -p runs
  w=$(gpu_watch "l$1")
  TAIL=30 run "$3" ./floe train embedded.toml engine.device=cuda:0 engine.recompute=true \
    engine.memory_fraction=0.92 model.path=embedded:$1 model.lora.rank=32 sft.enabled=false \
    trainer.logger=[] trainer.run_dir=runs/l$1 trainer.max_training_steps=$2 trainer.eval_before_train=false \
    trainer.eval_interval=-1 trainer.ckpt_interval=-1 trainer.train_batch_size=$prompts \
    trainer.policy_mini_batch_size=$prompts trainer.max_tokens_per_microbatch=$micro \
    trainer.micro_forward_batch_size_per_gpu=64 generator.n_samples_per_prompt=8 \
    generator.sampling_params.max_generate_length=$new generator.eval_sampling_params.max_generate_length=$new \
    trainer.policy.optimizer_config.lr=1e-5
  kill "$w"; peak "l$1"
  [ -f "runs/l$1/metrics.jsonl" ] && cp "runs/l$1/metrics.jsonl" "${OUT:-.}/l$1_metrics.jsonl"
}
part lora && grpo_lora 8B 3 280
part lora32 && grpo_lora 32B 3 520
part lora32s && grpo_lora 32B 3 "${LORA32S_SECS:-300}" 1 512 4096
if part long; then
  w=$(gpu_watch b4)
  TAIL=30 run 60 ./floe bench train --device cuda:0 --model 4B --batch 8 --seq 4096 --iters 2 --warmup 1
  TAIL=30 run 160 ./floe bench train --device cuda:0 --model 4B --batch 8 --seq 4096 --iters 2 --warmup 1 \
    --offload-optimizer
  kill "$w"; peak b4
  w=$(gpu_watch b32k)
  TAIL=30 run 90 ./floe bench train --device cuda:0 --model 1.7B --batch 1 --seq 32768 --iters 2 --warmup 1
  kill "$w"; peak b32k
fi
if part plan; then
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print $1/1024}')
  for r in qwen3-1.7b-bird qwen3-8b-bird qwen3-32b-bird; do
    size=${r#qwen3-}; size=${size%-bird}
    run 20 ./floe plan "$r.toml" model.path=embedded:${size^^} --gpu-memory-gib "$gib"
  done
fi
echo "== done (t=$(elapsed)s)" | tee -a "$L"
