"""Pretrain a hybrid model, Mamba-2 layers among attention, MLP and mixture-of-experts layers
(--hybrid-layer-pattern, --mamba-*: threefold/config/hybrid.py), with Megatron-LM's command
line under Megatron-LM's entry point for them, so its scripts run unchanged. The trainer is
pretrain_gpt.py's.

torchrun --nproc_per_node 2 pretrain_hybrid.py --hybrid-layer-pattern "M-M*-" ... --mock-data
"""

import sys

from pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main(prog="pretrain_hybrid.py", hybrid=True))
