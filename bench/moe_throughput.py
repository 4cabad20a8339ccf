"""Training tokens/s of a mixture of experts on the CPU: threefold vs Hugging Face `transformers`
Mixtral, same model, same batch, same weights, measured side by side in one run.

    python bench/moe_throughput.py > bench/results/moe_throughput.md

A Mixtral-style model is created in `transformers`, converted with tools/convert_checkpoint.py's
mapping, and both train on the same random tokens (fp32, clipping at 1.0, fused AdamW): forward,
backward, clipping and optimizer step. threefold runs its model with the same plain loop and
its full `Trainer.train_step` (gradient buffers, clipping, schedule, its own optimizer), each
with the loop over experts and with --moe-grouped-gemm (on the CPU a padded batched matmul).
The load-balancing loss is off for both (coefficient 0), as transformers leaves it out of the
loss unless asked.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpu_throughput import timed  # noqa: E402

from threefold.arguments import parse_args  # noqa: E402
from threefold.checkpoint.hf import hf_to_threefold, model_config_from_hf  # noqa: E402
from threefold.model import GPTModel  # noqa: E402
from threefold.parallel.parallel_context import ParallelContext  # noqa: E402
from threefold.training.trainer import Trainer  # noqa: E402

SHAPE = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=352,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=2048,
    max_position_embeddings=256,
    sliding_window=None,
    tie_word_embeddings=False,
    router_aux_loss_coef=0.0,
)


def trainer_flags(batch: int, seq: int, grouped: bool) -> list[str]:
    s = SHAPE
    flags = [
        "--num-layers", str(s["num_hidden_layers"]), "--hidden-size", str(s["hidden_size"]),
        "--num-attention-heads", str(s["num_attention_heads"]), "--group-query-attention",
        "--num-query-groups", str(s["num_key_value_heads"]),
        "--ffn-hidden-size", str(s["intermediate_size"]), "--seq-length", str(seq),
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--num-experts", str(s["num_local_experts"]),
        "--moe-router-topk", str(s["num_experts_per_tok"]),
        "--moe-token-dispatcher-type", "alltoall",
        "--micro-batch-size", str(batch), "--global-batch-size", str(batch),
        "--train-iters", "1000", "--lr", "1e-4", "--clip-grad", "1.0", "--mock-data",
        "--vocab-size", str(s["vocab_size"]), "--attention-dropout", "0",
        "--hidden-dropout", "0", "--log-interval", "100000", "--eval-iters", "0",
    ]  # fmt: skip
    return flags + (["--moe-grouped-gemm"] if grouped else [])


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    hf_config = transformers.MixtralConfig(**SHAPE)
    hf = transformers.MixtralForCausalLM(hf_config).train()
    architecture, model_config = model_config_from_hf(
        {**hf_config.to_dict(), "architectures": ["MixtralForCausalLM"]}
    )
    model_config.seq_length = args.seq
    full = hf_to_threefold(hf.state_dict(), model_config, architecture)

    def threefold_model(grouped: bool) -> GPTModel:
        model_config.moe_grouped_gemm = grouped
        model = GPTModel(model_config, model_config.padded_vocab_size(1))
        with torch.no_grad():
            for name, param in model.named_parameters():
                tensor = full[name]
                if tensor.shape != param.shape:  # vocabulary padding
                    padding = tensor.new_zeros(param.shape[0] - tensor.shape[0], *tensor.shape[1:])
                    tensor = torch.cat([tensor, padding])
                param.copy_(tensor)
        return model.train()

    loop, grouped = threefold_model(False), threefold_model(True)
    tokens = torch.randint(
        0,
        SHAPE["vocab_size"],
        (args.batch, args.seq + 1),
        generator=torch.Generator().manual_seed(1),
    )
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def optimizer_step(model, loss_fn):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        parameters = list(model.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model).backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()

        return step

    with torch.no_grad():  # same weights, same function: the losses agree before timing
        hf_loss = hf(tokens, labels=tokens).loss
        our_loss = loop.eval()(inputs, labels=labels).mean()
        loop.train()
    trainers = {
        grouped: Trainer(
            parse_args(trainer_flags(args.batch, args.seq, grouped)),
            torch.device("cpu"),
            ParallelContext(),
        )
        for grouped in (False, True)
    }
    contenders = {
        "transformers Mixtral (eager)": optimizer_step(hf, lambda m: m(inputs, labels=inputs).loss),
        "threefold model, same loop, loop over experts": optimizer_step(
            loop, lambda m: m(inputs, labels=labels).mean()
        ),
        "threefold model, same loop, --moe-grouped-gemm": optimizer_step(
            grouped, lambda m: m(inputs, labels=labels).mean()
        ),
        "threefold Trainer.train_step (loop over experts)": trainers[False].train_step,
        "threefold Trainer.train_step (--moe-grouped-gemm)": trainers[True].train_step,
    }
    results = {name: [] for name in contenders}
    for _ in range(args.rounds):  # interleaved, so drift hits every contender alike
        for name, step in contenders.items():
            results[name].append(timed(step, args.warmup, args.iterations))
    count = args.batch * args.seq
    best = {name: min(times) / count for name, times in results.items()}
    median = {name: statistics.median(times) / count for name, times in results.items()}
    baseline = "transformers Mixtral (eager)"
    total = sum(p.numel() for p in hf.parameters()) / 1e6
    print(f"# CPU MoE training throughput: threefold vs transformers {transformers.__version__}\n")
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Model: Mixtral-style "
        f"{total:.1f}M parameters ({SHAPE}), fp32, batch {args.batch} x {args.seq} tokens, "
        f"clipping at 1.0 and fused AdamW for all. {args.rounds} interleaved rounds of "
        f"{args.iterations} steps after {args.warmup} warm-up steps; tokens/s of the best "
        "round, ratios of the best and of the median rounds.\n"
    )
    print(
        f"Same function: initial loss transformers {hf_loss.item():.6f}, threefold "
        f"{our_loss.item():.6f}.\n"
    )
    print("| implementation | tokens/s | ratio to transformers (best) | ratio (median) |")
    print("|---|---|---|---|")
    for name in results:
        print(
            f"| {name} | {1 / best[name]:,.0f} | {best[baseline] / best[name]:.2f} | "
            f"{median[baseline] / median[name]:.2f} |"
        )


if __name__ == "__main__":
    main()
