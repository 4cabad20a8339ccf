#!/usr/bin/env bash
# Launch threefold's GPT pretraining on a Ray cluster (Ray Train's TorchTrainer), with the
# model, parallelism, data and checkpoint variables of launch/gpt_args.sh.
#
# A cluster you started (`ray start --head` ...) or a KubeRay RayJob (launch/k8s/rayjob.yaml):
#   NUM_WORKERS=16 USE_GPU=1 RAY_ADDRESS=auto bash launch/ray_gpt.sh
# This machine alone (Ray starts a local cluster; 2 CPU workers without GPUs):
#   NUM_LAYERS=2 HIDDEN_SIZE=64 TRAIN_ITERS=20 bash launch/ray_gpt.sh
#
# A failed worker restarts the whole worker group (up to MAX_FAILURES times); it resumes from
# the newest complete checkpoint in SAVE_DIR, which every node must see.
set -euo pipefail
cd "${THREEFOLD_DIR:-$(dirname "$0")/..}"
if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi

USE_GPU=${USE_GPU:-$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")}
NUM_WORKERS=${NUM_WORKERS:-$([ "$USE_GPU" = 1 ] && "$PYTHON" -c "import torch; print(torch.cuda.device_count())" || echo 2)}
CPUS_PER_WORKER=${CPUS_PER_WORKER:-1}
MAX_FAILURES=${MAX_FAILURES:-3}
RAY_STORAGE=${RAY_STORAGE:-}   # Ray's run directory (its logs); default ~/ray_results

# shellcheck source=launch/gpt_args.sh
source launch/gpt_args.sh
# Ray runs the trainer in a worker thread, where no signal handler can be installed; Ray stops
# its workers itself.
TRAINER_ARGS=()
for arg in "${GPT_ARGS[@]}"; do
  [ "$arg" = --exit-signal-handler ] || TRAINER_ARGS+=("$arg")
done

LAUNCHER_ARGS=(--num-workers "$NUM_WORKERS" --cpus-per-worker "$CPUS_PER_WORKER"
  --max-failures "$MAX_FAILURES")
if [ "$USE_GPU" = 1 ]; then LAUNCHER_ARGS+=(--use-gpu); fi
if [ -n "$RAY_STORAGE" ]; then LAUNCHER_ARGS+=(--storage-path "$RAY_STORAGE"); fi

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "$PYTHON" launch/ray_gpt.py "${LAUNCHER_ARGS[@]}" -- "${TRAINER_ARGS[@]}"
