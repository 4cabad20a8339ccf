"""Training tokens/s on the CPU: threefold vs Hugging Face `transformers`, same model, same batch,
same weights, measured side by side in one run.

    python bench/cpu_throughput.py > bench/results/cpu_throughput.md

A LLaMA-style model (RMSNorm, SwiGLU, RoPE, GQA, untied) is created in `transformers`, converted
to threefold with tools/convert_checkpoint.py's mapping, and both train on the same random
tokens (fp32, gradient clipping at 1.0 and PyTorch's fused AdamW everywhere): forward,
backward, clipping and optimizer step per iteration. `transformers` runs eager and under
torch.compile; threefold runs its model with the same plain loop (what the comparison
isolates) and its full `Trainer.train_step` (gradient buffer, clipping, LR schedule, its own
optimizer), with eager kernels (the CPU default), with `--fusion-impl compile`
(torch.compile'd norms, SwiGLU, RoPE, cross-entropy chunks) and with `--compile-layers`
(each transformer layer one compiled graph, as torchtitan's --compile; set against
`transformers` + torch.compile, which compiles the whole model).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_contenders import hf_llama_config  # noqa: E402
from gpu_mfu import Shape, threefold_args  # noqa: E402

from threefold.arguments import parse_args  # noqa: E402
from threefold.checkpoint.hf import hf_to_threefold, model_config_from_hf  # noqa: E402
from threefold.kernels.dispatch import configure_for_model  # noqa: E402
from threefold.model import GPTModel  # noqa: E402
from threefold.parallel.parallel_context import ParallelContext  # noqa: E402
from threefold.parallel.tensor_parallel.sharding import shard_of  # noqa: E402
from threefold.training.trainer import Trainer  # noqa: E402

SHAPE = Shape(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=704,
    vocab_size=2048,
    seq_length=256,
    micro_batch_size=8,
)


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
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = dataclasses.replace(SHAPE, seq_length=args.seq, micro_batch_size=args.batch)
    hf_config = hf_llama_config(shape)
    hf = transformers.LlamaForCausalLM(hf_config).train()
    architecture, model_config = model_config_from_hf(
        {**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    )
    model_config.seq_length = args.seq
    ours = GPTModel(model_config, model_config.padded_vocab_size(1))
    full = hf_to_threefold(hf.state_dict(), model_config, architecture)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            tensor = full[name]
            if tensor.shape != param.shape:  # vocabulary padding
                tensor = torch.cat(
                    [tensor, tensor.new_zeros(param.shape[0] - tensor.shape[0], *tensor.shape[1:])]
                )
            param.copy_(shard_of(tensor, param, 0, 1))
    ours.train()
    tokens = torch.randint(
        0, shape.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def optimizer_step(model, optimizer, loss_fn):
        parameters = [p for group in optimizer.param_groups for p in group["params"]]

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model).backward()
            # Gradient clipping at 1.0: the default of transformers' Trainer and of Megatron-LM
            # (--clip-grad), which Trainer.train_step applies too.
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()

        return step

    with torch.no_grad():  # same weights, same function: the losses agree before timing
        hf_loss = hf(tokens, labels=tokens).loss  # HF shifts labels itself: same s targets
        our_loss = ours(inputs, labels=labels).mean()
    hf_step = optimizer_step(
        hf,
        torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True),
        lambda m: m(inputs, labels=inputs).loss,
    )
    our_step = optimizer_step(
        ours,
        torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True),
        lambda m: m(inputs, labels=labels).mean(),
    )
    config = parse_args(threefold_args(shape, bf16=False))
    trainer = Trainer(config, torch.device("cpu"), ParallelContext())
    layers_config = parse_args(threefold_args(shape, bf16=False) + ["--compile-layers"])
    compiled_layers_trainer = Trainer(layers_config, torch.device("cpu"), ParallelContext())
    # Kernels are chosen per process; each contender re-selects its own before it is timed.
    kernels = {
        impl: dataclasses.replace(config.kernels, fusion_impl=impl) for impl in ("eager", "compile")
    }

    def select(impl: str):
        return lambda: configure_for_model(
            kernels[impl], config.model, 1, torch.device("cpu"), torch.float32
        )

    hf_compiled = torch.compile(hf)
    hf_compiled_step = optimizer_step(
        hf_compiled,
        torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True),
        lambda m: m(inputs, labels=inputs).loss,
    )
    contenders = {  # name: (kernel selection, step)
        "transformers (eager)": (None, hf_step),
        "transformers + torch.compile": (None, hf_compiled_step),
        "threefold model, same loop (eager kernels)": (select("eager"), our_step),
        "threefold Trainer.train_step (eager kernels)": (select("eager"), trainer.train_step),
        "threefold Trainer.train_step (--fusion-impl compile)": (
            select("compile"),
            trainer.train_step,
        ),
        "threefold Trainer.train_step (--compile-layers)": (
            select("eager"),
            compiled_layers_trainer.train_step,
        ),
    }
    results = {name: [] for name in contenders}
    # Interleaved rounds, so drift in the machine's speed hits every contender alike.
    for _ in range(args.rounds):
        for name, (prepare, step) in contenders.items():
            if prepare is not None:
                prepare()
            results[name].append(timed(step, args.warmup, args.iterations))
    tokens = args.batch * args.seq
    best = {name: min(times) / tokens for name, times in results.items()}
    median = {name: statistics.median(times) / tokens for name, times in results.items()}
    baseline = "transformers (eager)"
    rows = [
        f"| {name} | {1 / best[name]:,.0f} | {best[baseline] / best[name]:.2f} | "
        f"{median[baseline] / median[name]:.2f} |"
        for name in results
    ]
    print(f"# CPU training throughput: threefold vs transformers {transformers.__version__}\n")
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads. Model: LLaMA-style "
        f"{sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M parameters "
        f"({dataclasses.asdict(shape)}), fp32, "
        f"batch {args.batch} x {args.seq} tokens, clipping at 1.0 and fused AdamW for all. "
        f"{args.rounds} interleaved rounds of {args.iterations} steps, each after "
        f"{args.warmup} warm-up steps; tokens/s of the best round, ratios of the best and of "
        "the median rounds (their difference is this machine's noise).\n"
    )
    print(
        f"Same function: initial loss transformers {hf_loss.item():.6f}, threefold "
        f"{our_loss.item():.6f}.\n"
    )
    print(
        "| implementation | tokens/s | ratio to transformers (best) | ratio (median) |\n"
        "|---|---|---|---|"
    )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
