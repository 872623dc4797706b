#!/usr/bin/env bash
# GRPO on the embedded task at batch sizes a laptop cannot afford, several runs side by
# side on one GPU, plus a 0.6B-shape GRPO run with its step timing. Prepared like
# device_bench.sh (floe built with `--features cuda`, recipes/embedded.toml copied beside).
# Each line of $SWEEP (default sweep.txt) is `NAME OVERRIDES...`; metrics and logs come back
# in $OUT/sweep.tgz. NO_G06=1 skips the 0.6B run. Example: `NO_G06=1 bash device_grpo_sweep.sh`.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 RUST_LOG=warn
OUT=${OUT:-.}
mkdir -p runs
common="engine.device=cuda:0 engine.memory_fraction=0.04 engine.threads=2 trainer.logger=[]"
sweep() {  # sweep NAME OVERRIDES...
  local name=$1; shift
  timeout ${RUN_LIMIT:-420} ./floe train embedded.toml $common trainer.run_dir=runs/$name "$@" \
    > runs/$name.log 2>&1
  echo "$name rc=$?" >> runs/status
}
if [ -z "$NO_G06" ]; then
  timeout 150 ./floe train embedded.toml engine.device=cuda:0 engine.recompute=true \
    model.path=embedded:0.6B sft.enabled=false trainer.run_dir=runs/g06 trainer.logger=[] \
    trainer.max_training_steps=4 trainer.eval_before_train=false trainer.eval_interval=-1 \
    trainer.train_batch_size=32 trainer.policy_mini_batch_size=32 \
    trainer.micro_train_batch_size_per_gpu=64 trainer.micro_forward_batch_size_per_gpu=128 \
    generator.sampling_params.max_generate_length=256 trainer.policy.optimizer_config.lr=1e-6 \
    > runs/g06.log 2>&1
  echo "g06 rc=$?" >> runs/status
fi
while read -r line; do
  [ -n "$line" ] && sweep $line &
done < "${SWEEP:-sweep.txt}"
wait
cat runs/status
tar czf "$OUT/sweep.tgz" runs/*.log runs/status runs/*/metrics.jsonl runs/*/evals 2>/dev/null
