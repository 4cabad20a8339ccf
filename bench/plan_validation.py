"""How far the step-time model behind tools/plan_layout.py is from measured training speed:
the 1B benchmark on one H100 (bench/results/gpu_mfu, this repository's measurement) and
Megatron-LM's published H100 weak-scaling table (its README's model table: GPT models of 1.7B
to 462B parameters on 48 to 6,144 H100s, vocabulary 131,072, sequence 4,096).

    python bench/plan_validation.py > bench/results/plan_validation.md

For each published row the layout is Megatron's (TP, PP, DP, batch; micro-batch 1, sequence
parallel, distributed optimizer with gradient-reduce and parameter-gather overlap); what the
table does not say (virtual pipeline stages, recomputation) is what the planner itself would
choose: the least recomputation that fits in 90% of 80 GB, then the fastest virtual-stage
count. Predicted TFLOP/s per GPU use threefold's FLOP count (Megatron's of that time: the full
s x s attention product) over the predicted step time.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from plan_calibration import calibrate  # noqa: E402
from plan_layout import RECOMPUTE, SHARDING, Planner, cluster_args, layout_flags  # noqa: E402

from threefold.training.flops import training_flops_per_iteration  # noqa: E402
from threefold.training.memory_estimate import estimate_memory  # noqa: E402

GIB = 2**30
# Megatron-LM README, "model table" (images/model_table.png): size, heads, hidden, layers, TP,
# PP, DP, GPUs, batch, achieved TFLOP/s per GPU.
PUBLISHED = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]


def model_flags(heads: int, hidden: int, layers: int, batch: int) -> list[str]:
    return [
        *("--num-layers", str(layers), "--hidden-size", str(hidden)),
        *("--num-attention-heads", str(heads), "--ffn-hidden-size", str(4 * hidden)),
        *("--seq-length", "4096", "--max-position-embeddings", "4096"),
        *("--vocab-size", "131072", "--global-batch-size", str(batch)),
        *("--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer"),
    ]


def predict(row) -> tuple[float, str, float]:
    """(predicted TFLOP/s per GPU, the chosen VPP/recompute, memory GiB) for a published row."""
    _, heads, hidden, layers, tp, pp, dp, gpus, batch, _ = row
    args = cluster_args()
    base = model_flags(heads, hidden, layers, batch)
    planner = Planner(base, base, gpus, 8, args)
    best = None
    vpps = [None] + [v for v in (2, 3, 4, 6) if pp > 1 and layers % (pp * v) == 0]
    for vpp in vpps:
        for recompute, recompute_flags in RECOMPUTE.items():
            flags = layout_flags(tp, 1, pp, vpp, 1, layers)
            config = planner.config([*flags, *SHARDING["distributed optimizer"], *recompute_flags])
            if config is None:
                break
            memory = estimate_memory(config).total / GIB
            if memory > planner.budget:
                continue
            step = planner_step(planner, config)
            if best is None or step < best[0]:
                chosen = f"VPP={vpp or 1}, recompute {recompute or 'none'}"
                best = (step, config, chosen, memory)
            break
    step, config, chosen, memory = best
    flops = training_flops_per_iteration(config.model, batch, config.model.padded_vocab_size(tp))
    assert config.parallel.data_parallel_size == dp
    return flops / step / gpus / 1e12, chosen, memory


def planner_step(planner: Planner, config) -> float:
    from threefold.training.step_time import predict_step_time

    return predict_step_time(config, planner.hardware, planner.gpus_per_node).total


def main() -> int:
    print("# The step-time model against measurements\n")
    print("`python bench/plan_validation.py` (threefold/training/step_time.py, H100 constants)\n")
    constants, check = calibrate()
    error = check["predicted"] / check["measured"] - 1
    print("## One H100, the 1B benchmark (bench/results/gpu_mfu)\n")
    print(
        f"Predicted {check['predicted']:,.0f} tokens/s, measured {check['measured']:,.0f}: "
        f"**{error:+.1%}**. The constants were derived from this run's profile "
        f"({constants}), so this checks that the parts add up to the step: what is left is "
        "the GPU's idle time between kernels, which the model does not count.\n"
    )
    print("## Megatron-LM's published H100 table\n")
    print(
        "| model | GPUs | TP | PP | DP | batch | published TFLOP/s/GPU | predicted | error | "
        "chosen | memory GiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    errors = []
    for row in PUBLISHED:
        name, _, _, _, tp, pp, dp, gpus, batch, published = row
        predicted, chosen, memory = predict(row)
        errors.append(predicted / published - 1)
        print(
            f"| {name} | {gpus} | {tp} | {pp} | {dp} | {batch} | {published:.1f} | "
            f"{predicted:.1f} | {errors[-1]:+.1%} | {chosen} | {memory:.1f} |"
        )
    mean = sum(abs(e) for e in errors) / len(errors)
    print(
        f"\nMean absolute error {mean:.1%}; largest {max(errors, key=abs):+.1%}. Megatron-LM "
        "ran these with TP communication overlapped with compute (`--tp-comm-overlap`, "
        "Transformer Engine), which threefold does not have and the model does not assume."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
