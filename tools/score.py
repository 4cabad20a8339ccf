"""Mean loss and perplexity of a text file under a threefold checkpoint.

    python tools/score.py --load checkpoints/demo --input some.txt
    torchrun --nproc_per_node 2 tools/score.py --load ckpt --input some.txt    # at TP=2
    torchrun --nproc_per_node 2 tools/score.py --load ckpt --input some.txt \
        --pipeline-model-parallel-size 2                                     # at PP=2

The text is tokenized with the checkpoint's own tokenizer and scored in consecutive windows of
the model's --seq-length. The model runs over the launched processes, tensor-parallel within
each of --pipeline-model-parallel-size stages; the checkpoint may have been saved at any
layout.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import ToolParser, print_refusal  # noqa: E402
from threefold.config import ConfigError  # noqa: E402
from threefold.inference_flags import add_layout_flags, add_tokenizer_flags  # noqa: E402
from threefold.startup import frozen_imports, run_then_shut_down  # noqa: E402


def main() -> int:
    parser = ToolParser(
        prog="score.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load", required=True, help="checkpoint directory (with the tracker)")
    parser.add_argument("--input", required=True, help="a UTF-8 text file")
    add_tokenizer_flags(parser)
    add_layout_flags(parser)
    args = parser.parse_args()
    try:  # (read before torch is imported: a wrong file costs a second)
        with open(args.input, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as error:
        where = f"byte {error.start}: {error.reason}"
        print_refusal("score.py", f"--input {args.input}: not UTF-8 text ({where})")
        return 2
    except OSError as error:
        print_refusal("score.py", f"--input {args.input}: {error.strerror.lower()}")
        return 2
    with frozen_imports():  # what _score imports
        import threefold.checkpoint.load  # noqa: F401
        import threefold.inference  # noqa: F401

    return run_then_shut_down(lambda: _score(parser, args, text))


def _score(parser: argparse.ArgumentParser, args: argparse.Namespace, text: str) -> int:
    """Start this process's groups, load the model, score the text. Whatever holds a group
    lives in this frame, gone before `state.shut_down` (which says why)."""
    from threefold.inference import load_for_text, score, start_tool
    from threefold.parallel.refusal import print_refusal_once

    device, parallel = start_tool(parser, args)
    try:
        config, model, tokenizer = load_for_text(args, device, parallel)
    except ConfigError as error:
        print_refusal_once("score.py", error, parallel.world.rank)
        return 2
    try:
        loss, count = score(model, tokenizer.tokenize(text), config.model.seq_length)
    except ValueError as error:  # (a text of fewer than 2 tokens)
        print_refusal_once("score.py", f"--input {args.input}: {error}", parallel.world.rank)
        return 2
    if parallel.world.rank == 0:
        print(
            f"tokens scored: {count} | mean loss: {loss:.6f} | perplexity: {math.exp(loss):.4f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
