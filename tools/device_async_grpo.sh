#!/usr/bin/env bash
# GRPO at the 1.7B shape on one GPU, sync against one_step_off (issue 24): the step times
# and the async/* split of each, in $OUT/async.log, $OUT/sync.jsonl, $OUT/one_step_off.jsonl.
# Prepare `.device/` as tools/device_speed.sh says (floe.gz), plus recipes/embedded.toml and
# this script; run `bash .device/device_async_grpo.sh` with `.device` carried. STEPS (4)
# RL steps per mode; random weights earn no reward, so this measures time only.
cd "$(dirname "$0")"
[ -f floe.gz ] && gunzip -f floe.gz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 RUST_LOG=warn
B=${OUT:-.}/async.log
for mode in sync one_step_off; do
  echo "== $mode" | tee -a "$B"
  timeout 120 ./floe train embedded.toml engine.device=cuda:0 engine.memory_fraction=0.9 \
    model.path=embedded:1.7B sft.enabled=false trainer.logger=[] trainer.run_dir=runs/$mode \
    trainer.max_training_steps=${STEPS:-4} trainer.eval_before_train=false trainer.eval_interval=-1 \
    trainer.ckpt_interval=-1 trainer.train_batch_size=16 trainer.policy_mini_batch_size=16 \
    trainer.max_tokens_per_microbatch=16384 generator.n_samples_per_prompt=8 \
    generator.sampling_params.max_generate_length=512 trainer.pipeline.mode=$mode \
    trainer.policy.optimizer_config.lr=1e-6 2>&1 | tail -12 | tee -a "$B"
  [ -f runs/$mode/metrics.jsonl ] && cp runs/$mode/metrics.jsonl "${OUT:-.}/$mode.jsonl"
done
