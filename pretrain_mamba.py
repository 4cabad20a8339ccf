"""Megatron-LM's older name for pretrain_hybrid.py, kept so its scripts run unchanged."""

import sys

from pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main(prog="pretrain_mamba.py", hybrid=True))
