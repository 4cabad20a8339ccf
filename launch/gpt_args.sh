# shellcheck shell=bash
# The pretrain_gpt.py arguments every launcher uses, built from environment variables with
# defaults. Sourced (not run) by torchrun_gpt.sh and slurm_gpt.sh; sets GPT_ARGS.
#
# The default is a GPT-2-medium-sized LLaMA-style model (RoPE, RMSNorm, SwiGLU, ~350M
# parameters) on the embedded Shakespeare corpus (`make data` writes it). Override any variable:
#   NUM_LAYERS=2 HIDDEN_SIZE=64 TRAIN_ITERS=20 bash launch/torchrun_gpt.sh

# --- model ------------------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-24}
HIDDEN_SIZE=${HIDDEN_SIZE:-1024}
NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-16}
NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-$NUM_ATTENTION_HEADS}
SEQ_LENGTH=${SEQ_LENGTH:-1024}

# --- parallelism ------------------------------------------------------------------------------
TP=${TP:-1}              # --tensor-model-parallel-size
PP=${PP:-1}              # --pipeline-model-parallel-size
# DP is what is left: world size / (TP x PP).

# --- training ---------------------------------------------------------------------------------
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-64}
TRAIN_ITERS=${TRAIN_ITERS:-2000}
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
# 100 warm-up iterations, or a tenth of a short run (warm-up must end before the decay does).
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$(( TRAIN_ITERS < 1000 ? TRAIN_ITERS / 10 : 100 ))}
# bf16 on GPUs, fp32 on CPU-only machines (gloo).
PRECISION=${PRECISION:-auto}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-500}
EVAL_ITERS=${EVAL_ITERS:-10}

# --- data -------------------------------------------------------------------------------------
DATA_PATH=${DATA_PATH:-data/shakespeare_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/shakespeare_sp.model}

# --- checkpoints and logs ---------------------------------------------------------------------
# --load points at --save: a restarted or requeued run resumes from the newest complete
# checkpoint there, and a first run starts from scratch.
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt}
SAVE_INTERVAL=${SAVE_INTERVAL:-500}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$SAVE_DIR/tensorboard}
EXTRA_ARGS=${EXTRA_ARGS:-}   # anything else, e.g. "--sequence-parallel --use-distributed-optimizer"

if [ "$PRECISION" = auto ]; then
  if "${PYTHON:-python3}" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    PRECISION=bf16
  else
    PRECISION=fp32
  fi
fi
PRECISION_ARGS=()
if [ "$PRECISION" != fp32 ]; then
  PRECISION_ARGS=("--$PRECISION")
fi

# EXTRA_ARGS is meant to split into flags; GPT_ARGS is used by the scripts that source this.
# shellcheck disable=SC2206,SC2034
GPT_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE"
  --num-attention-heads "$NUM_ATTENTION_HEADS"
  --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
  --lr-warmup-iters "$LR_WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
  "${PRECISION_ARGS[@]}"
  --data-path "$DATA_PATH" --split "969,30,1"
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "$SAVE_INTERVAL"
  --tensorboard-dir "$TENSORBOARD_DIR"
  --exit-signal-handler
  $EXTRA_ARGS
)
