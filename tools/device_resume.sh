#!/usr/bin/env bash
# Issue 20 on the GPU: kill -9 a `floe train` run on cuda:0 at a random time after its
# first checkpoint, resume it with trainer.resume=latest, and compare every metric of the
# steps after the checkpoint with an uninterrupted run of the same seed (timings and
# async/*_s wall times excluded). Prints each differing metric with both values, or that
# none differ. Results in $OUT/resume.log.
# Prepare `.device/` as tools/device_speed.sh says (floe.gz), plus recipes/embedded.toml
# and this script; run `bash .device/device_resume.sh` with `.device` carried. MODE
# (one_step_off or sync, default sync) picks the pipeline; DEVICE (cuda:0) the device.
cd "$(dirname "$0")"
[ -f floe.gz ] && gunzip -f floe.gz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 RUST_LOG=warn
B=${OUT:-.}/resume.log
MODE=${MODE:-sync}
train() {  # train RUN_DIR [OVERRIDES...]
  local dir=$1; shift
  ./floe train embedded.toml engine.device=${DEVICE:-cuda:0} engine.memory_fraction=0.3 sft.epochs=1 \
    trainer.logger=[] trainer.run_dir="$dir" trainer.max_training_steps=8 trainer.ckpt_interval=3 \
    trainer.eval_interval=-1 trainer.eval_before_train=false trainer.pipeline.mode="$MODE" "$@"
}
rm -rf runs/whole runs/killed
echo "== uninterrupted ($MODE)" | tee -a "$B"
train runs/whole 2>&1 | tail -3 | tee -a "$B"
echo "== killed after its first checkpoint, then resumed" | tee -a "$B"
train runs/killed > runs/killed.log 2>&1 &
pid=$!
until [ -d runs/killed/checkpoints/global_step_3 ] || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done
sleep "$(python3 -c 'import random; print(round(random.uniform(0, 4), 2))')"
kill -9 $pid 2>/dev/null && echo "killed with $(wc -l < runs/killed/metrics.jsonl) lines of metrics written" | tee -a "$B"
wait $pid 2>/dev/null
train runs/killed trainer.resume=latest 2>&1 | tail -3 | tee -a "$B"
python3 - "$B" <<'PY' | tee -a "$B"
import json, sys
def load(p):
    out = {}
    for line in open(p):
        r = json.loads(line)
        m = {k: v for k, v in r.get("metrics", {}).items()
             if not k.startswith("timing/") and not (k.startswith("async/") and k.endswith("_s"))}
        out.setdefault(r["step"], {}).update(m)
    return out
whole, killed = load("runs/whole/metrics.jsonl"), load("runs/killed/metrics.jsonl")
diffs = [(s, k, whole[s].get(k), killed.get(s, {}).get(k)) for s in sorted(whole) if s > 3
         for k in sorted(whole[s]) if whole[s].get(k) != killed.get(s, {}).get(k)]
for s, k, a, b in diffs[:40]:
    print(f"step {s} {k}: uninterrupted {a} resumed {b}")
print(f"{len(diffs)} metrics differ after the checkpoint (steps 4-8)")
PY
