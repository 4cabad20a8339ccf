"""Supervised fine-tuning from a converted checkpoint: not implemented yet.

The checkpoint issue adds it (prompt/response and chat JSONL, loss on responses only, LoRA).
Until then this entry point says so and exits non-zero instead of pretending to train.
"""

import sys


def main() -> int:
    print("finetune.py: not yet implemented in threefold; use pretrain_gpt.py with --load for "
          "continued pretraining", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
