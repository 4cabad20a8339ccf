"""Training tokens/s on the CPU: threefold vs Hugging Face `transformers`, same model, same batch,
same weights, measured side by side in one run.

    python bench/cpu_throughput.py > bench/results/cpu_throughput.md

A LLaMA-style model (RMSNorm, SwiGLU, RoPE, GQA, untied) is created in `transformers`, converted
to threefold with tools/convert_checkpoint.py's mapping, and both train on the same random
tokens (fp32, AdamW): forward, backward and optimizer step per iteration. threefold is timed
twice: its model with a plain torch AdamW (what the comparison isolates), and its full
`Trainer.train_step` (gradient buffer, global-norm clipping, LR schedule, its own optimizer).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import parse_args  # noqa: E402
from threefold.hf_conversion import hf_to_threefold, model_config_from_hf  # noqa: E402
from threefold.model import GPTModel  # noqa: E402
from threefold.parallel.sharding import shard_of  # noqa: E402
from threefold.training.trainer import Trainer  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=704, num_attention_heads=8,
             num_key_value_heads=4, num_hidden_layers=4, vocab_size=2048,
             max_position_embeddings=256)


def timed(step, warmup: int, iterations: int) -> float:
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    return (time.perf_counter() - start) / iterations


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(tie_word_embeddings=False, attn_implementation="sdpa",
                                         **SHAPE)
    hf = transformers.LlamaForCausalLM(hf_config).train()
    architecture, model_config = model_config_from_hf({**hf_config.to_dict(),
                                                       "architectures": ["LlamaForCausalLM"]})
    model_config.seq_length = args.seq
    ours = GPTModel(model_config, model_config.padded_vocab_size(1))
    full = hf_to_threefold(hf.state_dict(), model_config, architecture)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            tensor = full[name]
            if tensor.shape != param.shape:  # vocabulary padding
                tensor = torch.cat([tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0],
                                                             *tensor.shape[1:])])
            param.copy_(shard_of(tensor, param, 0, 1))
    ours.train()
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def optimizer_step(model, optimizer, loss_fn):
        def step():
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model).backward()
            optimizer.step()
        return step

    with torch.no_grad():  # same weights, same function: the losses agree before timing
        hf_loss = hf(tokens, labels=tokens).loss  # HF shifts labels itself: same s targets
        our_loss = ours(inputs, labels=labels).mean()
    hf_step = optimizer_step(hf, torch.optim.AdamW(hf.parameters(), lr=1e-4),
                             lambda m: m(inputs, labels=inputs).loss)
    our_step = optimizer_step(ours, torch.optim.AdamW(ours.parameters(), lr=1e-4),
                              lambda m: m(inputs, labels=labels).mean())
    config = parse_args([
        "--num-layers", str(SHAPE["num_hidden_layers"]), "--hidden-size",
        str(SHAPE["hidden_size"]), "--num-attention-heads", str(SHAPE["num_attention_heads"]),
        "--group-query-attention", "--num-query-groups", str(SHAPE["num_key_value_heads"]),
        "--ffn-hidden-size", str(SHAPE["intermediate_size"]), "--seq-length", str(args.seq),
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--vocab-size",
        str(SHAPE["vocab_size"]), "--micro-batch-size", str(args.batch), "--global-batch-size",
        str(args.batch), "--mock-data", "--train-iters", "1000", "--eval-iters", "0",
        "--attention-dropout", "0", "--hidden-dropout", "0"])
    trainer = Trainer(config, torch.device("cpu"))

    rows = []
    # Interleaved rounds, so drift in the machine's speed hits every contender alike.
    results = {"transformers": [], "threefold model": [], "threefold Trainer.train_step": []}
    for _ in range(3):
        results["transformers"].append(timed(hf_step, args.warmup, args.iterations))
        results["threefold model"].append(timed(our_step, args.warmup, args.iterations))
        results["threefold Trainer.train_step"].append(
            timed(trainer.train_step, args.warmup, args.iterations))
    per_token = {name: min(times) / (args.batch * args.seq) for name, times in results.items()}
    baseline = per_token["transformers"]
    for name, seconds in per_token.items():
        rows.append(f"| {name} | {1 / seconds:,.0f} | {baseline / seconds:.2f} |")
    print(f"# CPU training throughput: threefold vs transformers {transformers.__version__}\n")
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads. Model: LLaMA-style "
          f"{sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters ({SHAPE}), fp32, "
          f"batch {args.batch} x {args.seq} tokens, AdamW. Best of 3 rounds of "
          f"{args.iterations} steps after {args.warmup} warm-up steps.\n")
    print(f"Same function: initial loss transformers {hf_loss.item():.6f}, threefold "
          f"{our_loss.item():.6f}.\n")
    print("| implementation | tokens/s | ratio to transformers |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
