"""Generate text from a threefold checkpoint, with the checkpoint's own tokenizer.

    python tools/generate.py --load checkpoints/demo --prompt "ROMEO:" --max-new-tokens 64
    python tools/generate.py --load checkpoints/sft --chat --prompt "Who are you?"
    torchrun --nproc_per_node 2 tools/generate.py --load ckpt --prompt "..."   # at TP=2
    torchrun --nproc_per_node 4 tools/generate.py --load ckpt --prompt "..." \
        --pipeline-model-parallel-size 2                                    # TP=2 x PP=2

--chat sends the prompt as a user message through the tokenizer's own chat template (with
the assistant's generation prompt), as `transformers` does for a chat model, and prints the
reply alone; generation stops at the tokenizer's end-of-sequence token.

The model runs over the launched processes, tensor-parallel within each of
--pipeline-model-parallel-size stages (for a model that needs PP to fit); the checkpoint may
have been saved at any TP/PP/DP layout (it is resharded on load). Greedy unless
--temperature > 0.
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
        prog="generate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--load", required=True, help="checkpoint directory (with the tracker)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0, off)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, rendered with the tokenizer's chat template",
    )
    add_tokenizer_flags(parser)
    add_layout_flags(parser)
    args = parser.parse_args()
    # The flags first, before torch is imported: --help or a mistyped flag costs a second.
    mistake = _sampling_mistake(args)
    if mistake:
        print_refusal("generate.py", mistake)
        return 2
    with frozen_imports():  # what _generate imports
        import threefold.checkpoint.load  # noqa: F401
        import threefold.data.tokenizer  # noqa: F401
        import threefold.inference  # noqa: F401

    return run_then_shut_down(lambda: _generate(parser, args))


def _sampling_mistake(args: argparse.Namespace) -> str | None:
    """The line for a sampling flag no sample can follow (a NaN or negative temperature
    reached torch.multinomial as a traceback once the model had loaded), else None."""
    if args.max_new_tokens < 0:
        return f"--max-new-tokens {args.max_new_tokens}: give 0 or more"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature {args.temperature}: give 0 (greedy) or a positive number"
    if not 0 < args.top_p <= 1:  # (a NaN fails it too)
        return f"--top-p {args.top_p}: give a probability above 0, at most 1 (1: every token)"
    if args.top_p < 1 and args.temperature == 0:  # greedy would ignore it
        return f"--top-p {args.top_p} is for sampling: give a --temperature above 0 with it"
    return None


def _generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Start this process's groups, load the model, sample from it. Whatever holds a group
    lives in this frame, gone before `state.shut_down` (which says why)."""
    from threefold.data.tokenizer import prompt_ids as encode_prompt
    from threefold.inference import generate, load_for_text, start_tool
    from threefold.parallel.refusal import print_refusal_once

    device, parallel = start_tool(parser, args)
    try:
        config, model, tokenizer = load_for_text(args, device, parallel)
        if args.chat and not getattr(tokenizer, "has_chat_template", False):
            raise ConfigError(
                f"--chat: the tokenizer of {args.load} has no chat template (a Hugging Face "
                "tokenizer_config.json with chat_template); drop --chat"
            )
        if args.chat:
            prompt_ids = tokenizer.chat_ids(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True
            )
        else:  # as fine-tuning samples begin (BOS where the tokenizer adds one)
            prompt_ids = encode_prompt(tokenizer, args.prompt)
        if not prompt_ids:
            raise ConfigError(
                f"--prompt {args.prompt!r} is no tokens (this tokenizer starts a text with no "
                "beginning-of-sequence token): give some text to continue"
            )
    except ConfigError as error:
        print_refusal_once("generate.py", error, parallel.world.rank)
        return 2
    new_ids = generate(
        model,
        prompt_ids,
        args.max_new_tokens,
        config.model.seq_length,
        tokenizer.eod,
        args.temperature,
        args.top_p,
        args.seed,
    )
    if parallel.world.rank == 0:
        if args.chat:  # the reply, without the end-of-turn token it stopped at
            reply = [i for i in new_ids if i != tokenizer.eod]
            print(tokenizer.detokenize(reply).strip(), flush=True)
        else:
            print(args.prompt + tokenizer.detokenize(new_ids), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
