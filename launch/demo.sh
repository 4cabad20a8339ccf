#!/usr/bin/env bash
# Train a tiny LLaMA on the default Shakespeare corpus, then print a greedy sample.
# Uses every GPU when there are any (bf16, NCCL), else 2 CPU processes (fp32, gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SAVE_DIR=${SAVE_DIR:-checkpoints/demo}
TRAIN_ITERS=${TRAIN_ITERS:-200}

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -gt 0 ]; then
  NPROC=$GPUS
  PRECISION=(--bf16)
else
  NPROC=2
  PRECISION=()
fi

rm -rf "$SAVE_DIR"
"$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" pretrain_gpt.py \
  --num-layers 4 --hidden-size 256 --num-attention-heads 8 \
  --group-query-attention --num-query-groups 4 \
  --seq-length 256 --max-position-embeddings 256 --position-embedding-type rope \
  --normalization RMSNorm --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --micro-batch-size 8 --global-batch-size 32 --train-iters "$TRAIN_ITERS" \
  --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
  --weight-decay 0.1 --clip-grad 1.0 "${PRECISION[@]}" \
  --data-path data/shakespeare_text_document \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model data/shakespeare_sp.model \
  --split 969,30,1 --log-interval 10 --eval-interval 50 --eval-iters 4 \
  --save "$SAVE_DIR" --tensorboard-dir runs/demo

echo
echo "Greedy sample from the trained model:"
"$PYTHON" tools/generate.py --load "$SAVE_DIR" --prompt "ROMEO:" --max-new-tokens 60
