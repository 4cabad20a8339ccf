#!/usr/bin/env bash
# Pretrain a GPT with threefold under Slurm. Copy this file, edit the #SBATCH lines and the
# variables below (or set them in the environment), then, from the repository root:
#   sbatch launch/slurm_gpt.sh
#   NUM_LAYERS=2 HIDDEN_SIZE=64 TRAIN_ITERS=20 sbatch --nodes 1 launch/slurm_gpt.sh
#
# Preemption and time limits: Slurm sends SIGUSR1 90 s before the end (--signal) and so does
# `scancel --signal=USR1 JOBID`. torchrun passes it to the workers, which finish the iteration,
# save a checkpoint and exit. If the run is not finished and that save made progress, this
# script requeues the job (--requeue), and the requeued job resumes from the checkpoint.
#
#SBATCH --job-name=threefold-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts one worker per GPU
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out      # relative to the submission directory
#SBATCH --open-mode=append           # a requeued job appends to its own log
#SBATCH --signal=USR1@90
#SBATCH --requeue
set -uo pipefail

cd "${THREEFOLD_DIR:-${SLURM_SUBMIT_DIR:-.}}" || exit 1  # the repository root
# The README's virtual environment when there is one (make setup), else the system's python3.
if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi
# GPUs per node as Slurm granted them; 2 gloo processes per node on CPU-only clusters.
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}
NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
if [ "$NPROC_PER_NODE" -eq 0 ]; then
  NPROC_PER_NODE=2
fi
MAX_REQUEUES=${MAX_REQUEUES:-20}

# Everything of one job under one directory; a requeued job keeps its SLURM_JOB_ID and so
# finds its own checkpoints.
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-threefold-gpt}-${SLURM_JOB_ID}}
SAVE_DIR=${SAVE_DIR:-$RUN_DIR/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$RUN_DIR/tensorboard}
mkdir -p "$RUN_DIR" logs

# shellcheck source=launch/gpt_args.sh
source launch/gpt_args.sh

# Rendezvous: the first node of the allocation hosts the c10d store.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# NCCL settings; uncomment what the cluster needs.
export CUDA_DEVICE_MAX_CONNECTIONS=1      # Megatron's TP overlap needs in-order kernels
export NCCL_ASYNC_ERROR_HANDLING=1        # a failed or stuck collective ends the job
# export NCCL_SOCKET_IFNAME=ib0           # the interface for NCCL's bootstrap
# export NCCL_IB_HCA=mlx5                 # InfiniBand adapters to use
# export NCCL_DEBUG=INFO                  # log NCCL's topology and transport choices
# Workers get this long after SIGUSR1 to save before torchrun kills them (less than 90 s).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-80}

tracker="$SAVE_DIR/latest_checkpointed_iteration.txt"
saved_before=$(cat "$tracker" 2>/dev/null || echo 0)
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST:" \
  "$SLURM_NNODES nodes x $NPROC_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT," \
  "resuming from iteration $saved_before"

# Flags and input files checked once on the batch host, before any worker starts.
WORLD_SIZE=$((SLURM_NNODES * NPROC_PER_NODE)) THREEFOLD_VALIDATE_ONLY=1 \
  "$PYTHON" pretrain_gpt.py "${GPT_ARGS[@]}" || exit $?

srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \
  --nnodes "$SLURM_NNODES" --nproc_per_node "$NPROC_PER_NODE" \
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  pretrain_gpt.py "${GPT_ARGS[@]}"
status=$?

saved_after=$(cat "$tracker" 2>/dev/null || echo 0)
if [ "$saved_after" -ge "$TRAIN_ITERS" ]; then
  echo "job $SLURM_JOB_ID: training complete at iteration $saved_after"
  exit 0
fi
if [ "$saved_after" -gt "$saved_before" ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]
then
  echo "job $SLURM_JOB_ID: stopped at iteration $saved_after of $TRAIN_ITERS; requeueing"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "job $SLURM_JOB_ID: failed (exit $status) with no new checkpoint; not requeueing" >&2
exit "${status:-1}"
