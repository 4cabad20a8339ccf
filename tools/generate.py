"""Generate text from a threefold checkpoint, with the checkpoint's own tokenizer.

    python tools/generate.py --load checkpoints/demo --prompt "ROMEO:" --max-new-tokens 64
    torchrun --nproc_per_node 2 tools/generate.py --load ckpt_tp2 --prompt "..."   # TP=2

Run it with as many processes as the checkpoint's tensor-parallel size.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.checkpointing import load_model_weights, read_metadata, read_tracker  # noqa: E402
from threefold.config import Config, ConfigError  # noqa: E402
from threefold.data.tokenizer import build_tokenizer  # noqa: E402
from threefold.inference import generate  # noqa: E402
from threefold.model import GPTModel  # noqa: E402
from threefold.parallel import state  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (with the tracker)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        iteration = read_tracker(args.load) if os.path.isdir(args.load) else None
        if iteration is None:
            raise ConfigError(f"--load {args.load}: holds no complete checkpoint")
        config = Config.from_dict(read_metadata(args.load, iteration)["config"])
        tokenizer_file = os.path.join(args.load, f"iter_{iteration:07d}", "tokenizer.model")
        if config.data.tokenizer_type == "SentencePieceTokenizer":
            config.data.tokenizer_model = tokenizer_file
        tokenizer = build_tokenizer(config.data, config.model.vocab_size)
        if tokenizer is None:
            raise ConfigError(f"--load {args.load}: the run had no tokenizer (mock data)")
    except ConfigError as error:
        parser.exit(2, f"generate.py: error: {error}\n")

    tp = config.parallel.tensor_model_parallel_size
    if config.parallel.pipeline_model_parallel_size > 1:
        parser.exit(2, "generate.py: error: the checkpoint was saved with "
                       "--pipeline-model-parallel-size > 1; generation supports TP only so far\n")
    device = state.initialize_distributed()
    if state.global_world_size() != tp:
        parser.exit(2, f"generate.py: error: the checkpoint has tensor-parallel size {tp}; "
                       f"launch {tp} processes (torchrun --nproc_per_node {tp})\n")
    state.initialize_model_parallel(tp, 1)
    model = GPTModel(config.model, config.model.padded_vocab_size(tp)).to(device)
    load_model_weights(args.load, model, iteration)
    new_ids = generate(model, tokenizer.tokenize(args.prompt), args.max_new_tokens,
                       config.model.seq_length, tokenizer.eod, args.temperature, args.top_p,
                       args.seed)
    if state.global_rank() == 0:
        print(args.prompt + tokenizer.detokenize(new_ids), flush=True)
    state.destroy_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
