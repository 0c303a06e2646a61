#!/usr/bin/env bash
# The training part of `make demo`: start the run (2 CPU processes, or one process per GPU), stop it with SIGTERM (as
# a preemption would) once its first checkpoint is complete, then rerun the very same command, which resumes where
# it stopped.
# Usage: examples/demo_train.sh PYTHON SAVE_DIR EXPERIMENT [fsdp1.py flags...]
set -euo pipefail
py=$1 save_dir=$2 name=$3
shift 3
nproc=$("$py" -c 'import torch; print(torch.cuda.device_count() or 2)')
cmd=("$py" fsdp1.py --nproc-per-node "$nproc" -e "$name" --save-dir "$save_dir" "$@")
run_dir=$save_dir/$name
rm -rf "$run_dir"  # the demo's own previous run: start clean so the interruption happens every time
mkdir -p "$save_dir"

echo "== training: ${cmd[*]}"
"${cmd[@]}" &
pid=$!
while [ ! -f "$run_dir/state.json" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
kill -TERM "$pid" 2>/dev/null || true
code=0
wait "$pid" || code=$?
echo
echo "== exit code $code (128 + SIGTERM's 15): interrupted after $(grep -o '"step": [0-9]*' "$run_dir/state.json" | head -1); rerunning the same command"
"${cmd[@]}"
