#!/usr/bin/env bash
# Launch threefold's GPT pretraining with torchrun, on one node or many.
#
# One node (all GPUs, or 2 CPU processes on a machine without one):
#   bash launch/torchrun_gpt.sh
# Two nodes: run on each, with the first node's address and its own rank:
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 bash launch/torchrun_gpt.sh   # on node0
#   MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 bash launch/torchrun_gpt.sh   # on node1
# Model, parallelism, data and checkpoint variables: launch/gpt_args.sh.
#
# With MAX_RESTARTS > 0, torchrun restarts every worker after one fails; the restarted run
# resumes from the newest complete checkpoint in SAVE_DIR (--load is --save).
set -euo pipefail
cd "${THREEFOLD_DIR:-$(dirname "$0")/..}"
# The README's virtual environment when there is one (make setup), else the system's python3.
if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi

MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 2)")
fi
MAX_RESTARTS=${MAX_RESTARTS:-0}
for name in NNODES NODE_RANK NPROC_PER_NODE MASTER_PORT MAX_RESTARTS; do
  case ${!name} in
    '' | *[!0-9]*) echo "torchrun_gpt.sh: error: $name=${!name}: give a whole number" >&2; exit 2 ;;
  esac
done

# shellcheck source=launch/gpt_args.sh
source launch/gpt_args.sh

# Megatron's tensor-parallel overlap needs the kernels queued in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# Workers are told of SIGUSR1 too (a scheduler's "time is nearly up") and get this long to save.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-80}

# Flags and input files checked once, before any worker starts: a mistake is one line, exit 2.
WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) THREEFOLD_VALIDATE_ONLY=1 \
  "$PYTHON" pretrain_gpt.py "${GPT_ARGS[@]}"

exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  --max-restarts "$MAX_RESTARTS" --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  pretrain_gpt.py "${GPT_ARGS[@]}"
