#!/usr/bin/env bash
# Speed work in one device call: the CUDA tests of a new build, then the same benchmarks
# with the new binary and a baseline binary side by side (same card, same call), then the
# peers. Parts (PARTS, default all):
#   tests   the CUDA test binaries present (TESTS, default cuda_ops cuda_transformer cuda
#           cuda_decode cuda_collective); full output in $OUT/<name>.log
#   kernels cuda_ops's timing table, new and (if present) base/cuda_ops, and torch's
#           GEMMs at the same decode shapes (decode_gemm_torch.py)
#   gen     `floe bench generate` at the 1.7B shape: batch 64,256 × 256+256 and batch 128 ×
#           1024+1024, new and base
#   graphs  decode CUDA graphs on and off (FLOE_CUDA_GRAPHS=0), same binary: batch 8,64,256
#           × 256+256 and the GRPO shape, with each run's graph counts
#   grpo    GRPO-shaped generation (8 prompts x 16 samples of a 4096-token prompt, 512
#           new): new with cascade attention and with FLOE_CASCADE=0, and base
#   train   `floe bench train` at the 1.7B shape, 8 × 2048: new and base with recompute,
#           new without and with `auto`
#   serve   64 concurrent native sample calls against one call of the same 64 requests
#           (256 + 256 tokens) on one 1.7B engine of `floe serve`
#   peers   ../shared/bench/peer_torch.py: generate with --compile (batch 256, 256+256) and
#           train with Liger (8 × 2048, checkpointing; installs the wheel)
#   long    one 32768-token sequence, new and base, and Liger (after peers)
#   spec    speculative decoding (n-gram drafts, K=4) against it off, 1.7B, batch 64
#           256+256, greedy and temperature 1
#   host    the host's memory bandwidth and torch's fused CPU AdamW (host_bandwidth.py),
#           the bound on the offloaded optimizer
#
# Prepare here, from the repository root (`.device/` is in .git/info/exclude):
#   CARGO_TARGET_DIR=target-cuda cargo build --release -p floe-cli --features cuda
#   cp target-cuda/release/floe .device/ && strip .device/floe && gzip .device/floe
#   cp the test binaries (cargo test ... --no-run prints them) to .device/<test name>
#   a baseline build's floe (and cuda_ops) to .device/base/
#   cp ../shared/bench/peer_torch.py ../shared/bench/wheels/liger*.whl tools/device_speed.sh \
#     tools/host_bandwidth.py crates/server/bench/concurrent_sample.py \
#     crates/backend/dev/decode_gemm_torch.py .device/
# then run `bash .device/device_speed.sh` with `.device` carried. Results in $OUT/speed.log.
cd "$(dirname "$0")"
# Binaries travel gzipped (the carried folder is capped at 64 MiB).
for z in floe.gz base/floe.gz; do [ -f "$z" ] && gunzip -f "$z"; done
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 RUST_LOG=warn
LIMIT=${LIMIT:-560}
PARTS=${PARTS:-tests kernels gen graphs grpo train serve peers long}
B=${OUT:-.}/speed.log
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {  # run SECONDS CMD...: skipped when it could overrun LIMIT
  local secs=$1; shift
  echo "== $* (t=$(elapsed)s)" | tee -a "$B"
  if [ $(( $(elapsed) + secs )) -gt "$LIMIT" ]; then echo "skipped: time" | tee -a "$B"; return; fi
  timeout "$secs" "$@" 2>&1 | grep -v '^\s*$' | tail -${TAIL:-30} | tee -a "$B"
}
part() { [[ " $PARTS " == *" $1 "* ]]; }
bins() { echo ./floe; [ -x base/floe ] && echo base/floe; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee -a "$B"
if part tests; then
  # Full output per binary in $OUT/<name>.log; the summary and any failure here.
  for t in ${TESTS:-cuda_ops cuda_transformer cuda cuda_decode cuda_collective}; do
    [ -x "$t" ] || continue
    echo "== $t (t=$(elapsed)s)" | tee -a "$B"
    timeout 150 ./"$t" --test-threads=1 --nocapture > "${OUT:-.}/$t.log" 2>&1
    grep -E "^test |test result|panicked|FAILED|rel L2 .*(e-0[01]|e\+|NaN)" "${OUT:-.}/$t.log" | grep -v " ok$" | tail -20 | tee -a "$B"
  done
fi
if part kernels; then
  for t in ./cuda_ops base/cuda_ops; do
    [ -x "$t" ] && TAIL=60 run 60 "$t" --ignored timing_table --nocapture
  done
  [ -f decode_gemm_torch.py ] && TAIL=16 run 60 python3 decode_gemm_torch.py
fi
if part gen; then
  for f in $(bins); do
    TAIL=12 run 100 "$f" bench generate --device cuda:0 --model 1.7B --random-init --batch 64,256 --prompt 256 --new 256
    TAIL=8 run 100 "$f" bench generate --device cuda:0 --model 1.7B --random-init --batch 128 --prompt 1024 --new 1024
  done
  TAIL=45 run 100 ./floe bench generate --device cuda:0 --model 1.7B --random-init --batch 256 --prompt 256 --new 256 --profile
fi
if part graphs; then
  for g in 1 0; do
    for shape in "--batch 8,64,256 --prompt 256 --new 256" \
                 "--batch 128 --samples-per-prompt 16 --prompt 4096 --new 512"; do
      echo "== FLOE_CUDA_GRAPHS=$g $shape" | tee -a "$B"
      FLOE_CUDA_GRAPHS=$g timeout 100 ./floe bench generate --device cuda:0 --model 1.7B --random-init $shape 2>&1 \
        | grep -E "^1\.7B|^model|RESULT" | sed -E 's/^RESULT .*("graphs":\{[^}]*\}).*/  \1/' | tee -a "$B"
    done
  done
fi
if part grpo; then
  grpo="bench generate --device cuda:0 --model 1.7B --random-init --batch 128 --samples-per-prompt 16 --prompt 4096 --new 512"
  TAIL=8 run 100 ./floe $grpo
  TAIL=8 run 100 env FLOE_CASCADE=0 ./floe $grpo
  [ -x base/floe ] && TAIL=8 run 100 base/floe $grpo
  TAIL=45 run 100 ./floe $grpo --profile
fi
if part train; then
  for f in $(bins); do
    TAIL=8 run 90 "$f" bench train --device cuda:0 --model 1.7B --random-init --batch 8 --seq 2048 --iters 4 --warmup 1
  done
  for r in false auto; do
    TAIL=10 run 90 ./floe bench train --device cuda:0 --model 1.7B --random-init --batch 8 --seq 2048 --iters 4 --warmup 1 --recompute=$r
  done
fi
if part serve; then
  # 64 concurrent native sample calls against one call of the same 64 requests, on one
  # 1.7B engine of `floe serve` (crates/server/bench/concurrent_sample.py).
  for f in ./floe; do
    d=$(mktemp -d)
    "$f" serve --model q=embedded:1.7B --device cuda:0 --insecure-loopback --port 8123 --data-dir "$d" > "$d/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 60); do curl -sf http://127.0.0.1:8123/api/v1/healthz > /dev/null && break; sleep 1; done
    run 150 python3 concurrent_sample.py --url http://127.0.0.1:8123 --model q --requests 64 --prompt-len 256 --new-tokens 256
    kill $pid; wait $pid 2>/dev/null
    grep -i "error\|sample batch" "$d/serve.log" | tail -3 | tee -a "$B"
  done
fi
if part peers; then
  python3 -m pip install --no-deps -q liger_kernel-*.whl 2>&1 | tail -2
  run 150 python3 peer_torch.py --model 1.7B --mode gen --batch 256 --prompt 256 --new 256 --compile
  run 90 python3 peer_torch.py --model 1.7B --mode train --batch 8 --seq 2048 --iters 4 --warmup 1 --liger
fi
if part long; then
  for f in $(bins); do
    TAIL=8 run 100 "$f" bench train --device cuda:0 --model 1.7B --random-init --batch 1 --seq 32768 --iters 2 --warmup 1
  done
  run 100 python3 peer_torch.py --model 1.7B --mode train --batch 1 --seq 32768 --iters 2 --warmup 1 --liger
fi
if part spec; then
  for t in 0 1; do
    for spec in "" "--speculative-ngram 4"; do
      TAIL=8 run 100 ./floe bench generate --device cuda:0 --model 1.7B --random-init --batch 64 --prompt 256 --new 256 --temperature $t $spec
    done
  done
fi
if part host; then
  run 90 python3 host_bandwidth.py
fi
echo "== done (t=$(elapsed)s)" | tee -a "$B"
