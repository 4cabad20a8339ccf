"""Predict per-device memory for a model and parallel layout, without running it.

Takes pretrain_gpt.py's flags (model, layout, precision, recompute, micro-batch) plus the
number of devices, and prints what each pipeline stage's ranks need:

    python tools/estimate_memory.py --world-size 8 --num-layers 32 --hidden-size 4096 \\
        --num-attention-heads 32 --seq-length 4096 --swiglu --ffn-hidden-size 11008 \\
        --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \\
        --untie-embeddings-and-output-weights --vocab-size 32000 --bf16 \\
        --micro-batch-size 1 --use-distributed-optimizer --recompute-granularity full \\
        --recompute-method uniform --recompute-num-layers 1 [--gpu-memory-gib 80]

The model's data flags are not needed (a vocabulary size is). See
threefold/training/memory_estimate.py and activation_estimate.py for what is counted.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import (  # noqa: E402
    ToolParser,
    build_parser,
    config_from_namespace,
    parse_args,
    positive,
    print_refusal,
)
from threefold.config import Config, ConfigError  # noqa: E402
from threefold.training.memory_estimate import estimate_stage, parameter_count  # noqa: E402

GIB = 2**30


def format_estimate(config: Config, device_memory_gib: float | None = None) -> str:
    parallel = config.parallel
    count = parameter_count(config.model, config.model.padded_vocab_size(1))
    optimizer = (
        "distributed optimizer" if parallel.use_distributed_optimizer else "replicated optimizer"
    )
    lines = [
        f"model: {count / 1e9:.2f}B parameters; layout: {parallel.layout(' ')}, "
        f"{parallel.distributed_strategy}, {optimizer}, {config.training.params_dtype_name}",
        "stage  params GiB  grads GiB  optimizer GiB  activations GiB (micro-batches)  total GiB",
    ]
    fp8 = config.fp8.enabled
    if fp8:  # the step's FP8 weight copies, between activations and the total
        lines[1] = lines[1].replace("  total GiB", "  fp8 weights GiB  total GiB")
    for stage in range(parallel.pipeline_model_parallel_size):
        e = estimate_stage(config, stage)
        fits = ""
        if device_memory_gib is not None:
            fits = "  fits" if e.total / GIB <= device_memory_gib else "  DOES NOT FIT"
        lines.append(
            f"{stage:>5}  {e.parameters / GIB:>10.2f}  {e.gradients / GIB:>9.2f}  "
            f"{e.optimizer / GIB:>13.2f}  {e.activations / GIB:>15.2f} "
            f"({e.micro_batches_in_flight:>2})            "
            + (f"{e.fp8_weights / GIB:>15.2f}  " if fp8 else "")
            + f"{e.total / GIB:>9.2f}{fits}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(
        prog="estimate_memory.py",
        description=__doc__,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--world-size",
        type=positive(int),
        default=None,
        help="number of devices (default: TP x PP x CP, i.e. DP=1)",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=positive(float),
        default=None,
        help="say whether each stage fits in this much device memory",
    )
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        build_parser("estimate_memory.py", __doc__, parser).print_help()
        return 0
    own, rest = parser.parse_known_args(argv)
    if "--mock-data" not in rest and "--data-path" not in rest:
        rest.append("--mock-data")  # the estimate needs no data
    if own.world_size is None:  # DP=1: the flags' TP x PP x CP, before validation
        own.world_size = config_from_namespace(
            build_parser("estimate_memory.py").parse_args(rest)
        ).parallel.ranks_per_replica
    config = parse_args(rest, world_size=own.world_size, prog="estimate_memory.py")
    try:
        print(format_estimate(config, own.gpu_memory_gib))
    except ConfigError as error:  # what the flags leave open: the vocabulary, for one
        print_refusal("estimate_memory.py", error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
