#!/usr/bin/env bash
# `make smoke`: each strategy trains 2 steps and checkpoints (through the experiments harness), then is rerun to step
# 4 and must resume from that checkpoint; the harness's analysis prints the comparison. Builds the demo's corpus and
# model first when missing. Usage: examples/smoke.sh PYTHON DEMO_DIR (HF_HOME set, as the Makefile does)
set -euo pipefail
py=$1 demo=$2
out=$demo/smoke
if [ ! -f "$demo/hf_datasets/corpus/dataset_info.json" ]; then
  "$py" DATA-HF.py --data_folder examples/raw --save_dir "$demo/hf_datasets/corpus" --overwrite >/dev/null
fi
if [ ! -d "$HF_HOME/hub/models--local--tiny-llama" ]; then
  "$py" -m pipeline.tiny --out "$demo/tiny-llama" --corpus examples/raw >/dev/null
  "$py" MODEL_DOWNLOAD.py --model-name local/tiny-llama --source "$demo/tiny-llama" >/dev/null
fi
rm -rf "$out"
"$py" -m pipeline.experiments run --spec configs/experiments/smoke.yaml --output-dir "$out" --execute \
  --launcher "torchrun --standalone --nproc_per_node 2"
for name in ddp fsdp1 fsdp2 manual; do
  log=$out/logs/$name-resume.log
  if ! "$py" -m torch.distributed.run --standalone --nproc_per_node 2 fsdp1.py --config "$out/configs/$name.yaml" \
      --max-steps 4 >"$log" 2>&1 || ! grep -q "resumed from .*step-00000002 at step 2" "$log"; then
    echo "smoke: $name did not resume from its step-2 checkpoint to step 4; see $log" >&2
    exit 1
  fi
  echo "$name: resumed from step 2 and finished step 4"
done
"$py" -m pipeline.experiments analyze --experiment-dir "$out" --baseline ddp --skip-steps 1
