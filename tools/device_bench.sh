#!/usr/bin/env bash
# The GPU comparison of issue 5 in one device call: `floe bench` against
# ../shared/bench/peer_torch.py on the same shapes, then the engine's CUDA test.
#
# Prepare here (no GPU needed), from the repository root:
#   cargo build --release -p floe-cli --features cuda
#   cargo test --workspace --all-features --no-run   # prints the path of the engine's `cuda` test
#   mkdir -p .device && cp target/release/floe .device/ && strip .device/floe
#   cp <target/debug/deps/cuda-HASH of crates/engine/tests/cuda.rs> .device/engine_cuda
#   cp ../shared/bench/peer_torch.py tools/device_bench.sh .device/
# then run `bash .device/device_bench.sh` on the device with `.device` carried. Results go
# to $OUT/bench.log; items are skipped once the call nears its time limit (LIMIT seconds).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 PYTHONUNBUFFERED=1 RUST_LOG=warn
LIMIT=${LIMIT:-500}
B=${OUT:-.}/bench.log
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
run() {  # run SECONDS CMD...: skipped when it could overrun LIMIT
  local secs=$1; shift
  echo "== $* (t=$(elapsed)s)" | tee -a "$B"
  if [ $(( $(elapsed) + secs )) -gt "$LIMIT" ]; then echo "skipped: time" | tee -a "$B"; return; fi
  timeout "$secs" "$@" 2>&1 | grep -v '^\s*$' | tee -a "$B"
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv | tee -a "$B"
for m in 1.7B 0.6B; do
  run 90 ./floe bench train --device cuda:0 --model $m --random-init --batch 8 --seq 2048 --iters 4 --warmup 1
  run 60 python3 peer_torch.py --model $m --mode train --batch 8 --seq 2048 --iters 4 --warmup 1
  run 90 ./floe bench generate --device cuda:0 --model $m --random-init --batch 64,256 --prompt 256 --new 256
  run 60 python3 peer_torch.py --model $m --mode gen --batch 256 --prompt 256 --new 256
done
run 60 ./engine_cuda --test-threads=1
echo "== done (t=$(elapsed)s)" | tee -a "$B"
