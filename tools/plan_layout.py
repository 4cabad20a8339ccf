"""Plan a training layout before buying or booking the cluster: which TP/PP/VPP/CP/DP,
micro-batch size, recomputation and optimizer sharding fit in memory, and which is fastest.

    python tools/plan_layout.py --gpus 64 --gpus-per-node 8 --gpu H100 \\
        --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention \\
        --num-query-groups 8 --ffn-hidden-size 28672 --swiglu --normalization RMSNorm \\
        --position-embedding-type rope --disable-bias-linear \\
        --untie-embeddings-and-output-weights --vocab-size 32000 \\
        --seq-length 4096 --global-batch-size 1024
    python tools/plan_layout.py --gpus 16 --hf-config path/to/config.json --seq-length 4096 \\
        --global-batch-size 512

Every layout megatron-core can build on the GPUs is considered: TP within a node (dividing
the heads and query groups, sequence parallel on), PP dividing the layers with and without
virtual stages, CP, DP for the rest, EP (MoE models) over DP x CP, micro-batch sizes that
divide the batch, the distributed optimizer (with gradient-reduce and parameter-gather
overlap) or FSDP2, and the least recomputation (none, selective, full) that fits. Memory is
threefold's estimator's (tools/estimate_memory.py, within 2.6% on an H100); a layout fits
when its fullest stage is within `--memory-fraction` of the GPU's memory. The fitting
layouts are ranked by the step-time model of threefold/training/step_time.py (constants
calibrated on an H100; see docs/plan_layout.md for its error against measurements and
Megatron-LM's published table), and the best are printed with the flags that launch them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import (  # noqa: E402
    ToolParser,
    build_parser,
    config_from_namespace,
    parse_args,
    positive,
)
from threefold.config import Config, ConfigError  # noqa: E402
from threefold.training.flops import training_flops_per_iteration  # noqa: E402
from threefold.training.memory_estimate import estimate_memory  # noqa: E402
from threefold.training.step_time import HARDWARE, StepTime, predict_step_time, tokens_per_second  # noqa: E402

GIB = 2**30
RECOMPUTE = {
    None: [],
    "selective": ["--recompute-granularity", "selective"],
    "full": [
        *("--recompute-granularity", "full", "--recompute-method", "uniform"),
        *("--recompute-num-layers", "1"),
    ],
}
SHARDING = {
    "distributed optimizer": [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
    "FSDP2": ["--use-torch-fsdp2"],
}


@dataclass
class Plan:
    flags: list[str]  # the layout's own flags
    config: Config
    memory_gib: float
    step: StepTime

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second(self.config, self.step)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(config: Config, gpus: int, gpus_per_node: int):
    """(TP, CP, PP, VPP, EP) tuples megatron-core can build on `gpus` GPUs for this model."""
    model = config.model
    for tp in _divisors(gpus_per_node):
        if model.num_attention_heads % tp or model.num_query_groups % tp:
            continue
        for cp in (1, 2, 4, 8):
            if model.seq_length % (2 * cp) or (cp > 1 and model.seq_length // cp < 1024):
                continue
            for pp in _divisors(model.num_layers):
                if gpus % (tp * cp * pp):
                    continue
                vpps = [None]
                if pp > 1:
                    vpps += [v for v in (2, 3, 4) if model.num_layers % (pp * v) == 0]
                # experts spread over the data- and context-parallel ranks (expert TP = TP)
                replicas = gpus // (tp * cp * pp) * cp
                eps = [1]
                if model.is_moe:
                    eps = [e for e in _divisors(model.num_experts) if replicas % e == 0]
                for vpp in vpps:
                    for ep in eps:
                        yield tp, cp, pp, vpp, ep


def layout_flags(
    tp: int, cp: int, pp: int, vpp: int | None, micro_batch: int, num_layers: int, ep: int = 1
) -> list[str]:
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if tp > 1:
        flags.append("--sequence-parallel")
    if cp > 1:
        flags += ["--context-parallel-size", str(cp)]
    if vpp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // (pp * vpp))]
    if ep > 1:
        flags += ["--expert-model-parallel-size", str(ep)]
    return [*flags, "--micro-batch-size", str(micro_batch)]


# What a plan chooses (layout_flags, SHARDING, RECOMPUTE), and what only fits another layout
PLANNED = {
    word
    for flags in (layout_flags(2, 2, 2, 2, 2, 8, 2), *SHARDING.values(), *RECOMPUTE.values())
    for word in flags
    if word.startswith("--")
} | {
    "--bf16",
    "--distributed-strategy",
    "--expert-tensor-parallel-size",
    "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--pipeline-model-parallel-layout",
    "--hierarchical-context-parallel-sizes",
}


def cluster_args(
    gpu: str = "H100", gpu_memory_gib: float = 80.0, memory_fraction: float = 0.9, **links
) -> SimpleNamespace:
    """The cluster settings a Planner reads, as the command line gives them (for callers that
    plan without one: bench/plan_validation.py, the tests)."""
    speeds = {key: links.get(key) for key in ("peak_tflops", "intra_node_gbps", "inter_node_gbps")}
    return SimpleNamespace(
        gpu=gpu, gpu_memory_gib=gpu_memory_gib, memory_fraction=memory_fraction, **speeds
    )


class Planner:
    """Builds and checks each layout's config with one parser (parse_args per layout would
    rebuild it every time) and keeps the ones that fit."""

    def __init__(
        self, model_flags: list[str], base: list[str], gpus: int, gpus_per_node: int, args
    ) -> None:
        self.model_flags = model_flags  # as the user gave them: the printed command's
        self.base, self.gpus, self.gpus_per_node, self.args = base, gpus, gpus_per_node, args
        self.parser = build_parser("plan_layout.py")
        self.hardware = HARDWARE[args.gpu]
        if args.peak_tflops or args.intra_node_gbps or args.inter_node_gbps:
            self.hardware = dataclasses.replace(
                self.hardware,
                peak_tflops=args.peak_tflops or self.hardware.peak_tflops,
                intra_node_gbps=args.intra_node_gbps or self.hardware.intra_node_gbps,
                inter_node_gbps=args.inter_node_gbps or self.hardware.inter_node_gbps,
            )
        self.budget = args.gpu_memory_gib * args.memory_fraction

    def config(self, flags: list[str], world_size: int | None = None) -> Config | None:
        """The validated config of base + flags on `world_size` GPUs (default: the cluster's),
        None where threefold would refuse it."""
        try:
            namespace = self.parser.parse_args(self.base + flags)
        except SystemExit:
            return None
        config = config_from_namespace(namespace)
        config.parallel.world_size = world_size or self.gpus
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                config.finalize()
        except ConfigError:
            return None
        return config

    def plans(self) -> list[Plan]:
        found = []
        # (on one GPU, as main checked it: the whole cluster at DP alone may not divide the
        # batch, where the layouts below do)
        base = self.config([], world_size=1)
        batch = base.training.global_batch_size
        for tp, cp, pp, vpp, ep in layouts(base, self.gpus, self.gpus_per_node):
            dp = self.gpus // (tp * cp * pp)
            for micro_batch in (1, 2, 4, 8):
                if batch % (micro_batch * dp):
                    continue
                for sharding, sharding_flags in SHARDING.items():
                    if sharding == "FSDP2" and vpp:
                        continue  # threefold refuses FSDP with virtual stages
                    for recompute_flags in RECOMPUTE.values():
                        flags = [
                            *layout_flags(tp, cp, pp, vpp, micro_batch, base.model.num_layers, ep),
                            *sharding_flags,
                            *recompute_flags,
                        ]
                        config = self.config(flags)
                        if config is None:
                            break  # refused: more recomputation does not change that
                        memory = estimate_memory(config).total / GIB
                        if memory <= self.budget:
                            step = predict_step_time(config, self.hardware, self.gpus_per_node)
                            found.append(Plan(flags, config, memory, step))
                            break  # the least recomputation that fits
        return sorted(found, key=_rank)


def _rank(plan: Plan) -> tuple:
    """Fastest first; among equally fast ones (to 0.1%) the simpler layout, then the leaner."""
    parallel = plan.config.parallel
    split = (
        parallel.tensor_model_parallel_size
        * parallel.context_parallel_size
        * parallel.pipeline_model_parallel_size
        * (parallel.virtual_pipeline_model_parallel_size or 1)
    )
    return (float(f"{plan.step.total:.3g}"), split, plan.memory_gib)


def describe(plan: Plan) -> str:
    parallel = plan.config.parallel
    layout = parallel.layout()
    if parallel.virtual_pipeline_model_parallel_size:
        layout += f", VPP={parallel.virtual_pipeline_model_parallel_size}"
    return layout


def print_plans(plans: list[Plan], planner: Planner, top: int) -> None:
    hardware = planner.hardware
    memory = planner.args.gpu_memory_gib
    print(
        f"> {len(plans)} layouts fit in {planner.budget:.0f} GiB of {memory:.0f} GiB on "
        f"{planner.gpus} x {hardware.name} ({planner.gpus_per_node} per node); "
        f"the fastest {min(top, len(plans))}, by predicted step time:"
    )
    if plans and plans[0].config.model.hybrid:
        print(
            "> a hybrid model: its memory is estimated layer by layer, but the step times count "
            "its Mamba layers' FLOPs at GEMM speed, not the PyTorch scan's own speed or their "
            "context-parallel all-to-alls (not calibrated on a GPU)"
        )
    header = (
        f"{'rank':>4}  {'layout':<44} {'micro':>5} {'recompute':<9} {'sharding':<21} "
        f"{'GiB':>6} {'step s':>7} {'tokens/s':>10} {'MFU':>5}  bubble/TP/PP/DP/CP/EP s"
    )
    print(header)
    for index, plan in enumerate(plans[:top], 1):
        config, step = plan.config, plan.step
        recompute = config.model.recompute_granularity or "-"
        sharding = "FSDP2" if config.parallel.distributed_strategy == "fsdp" else "dist. optimizer"
        flops = training_flops_per_iteration(
            config.model,
            config.training.global_batch_size,
            config.model.padded_vocab_size(config.parallel.tensor_model_parallel_size),
        )
        mfu = flops / step.total / (planner.gpus * hardware.peak_tflops * 1e12)
        parts = "/".join(
            f"{x:.3g}"
            for x in (
                step.bubble,
                step.tensor_parallel,
                step.pipeline_sends,
                step.data_parallel,
                step.context_parallel,
                step.expert_parallel,
            )
        )
        print(
            f"{index:>4}  {describe(plan):<44} {config.training.micro_batch_size:>5} "
            f"{recompute:<9} {sharding:<21} {plan.memory_gib:>6.1f} {step.total:>7.2f} "
            f"{plan.tokens_per_second:>10,.0f} {mfu:>5.1%}  {parts}"
        )
    if plans:
        best = plans[0]
        nodes = -(-planner.gpus // planner.gpus_per_node)
        per_node = min(planner.gpus, planner.gpus_per_node)
        print(
            f"\n> the fastest, on {nodes} node(s):\n"
            f"torchrun --nnodes {nodes} --nproc_per_node {per_node} "
            f"pretrain_gpt.py {' '.join(planner.model_flags + best.flags)} --bf16"
        )


def hf_model_flags(path: str) -> list[str]:
    """A Hugging Face config.json as pretrain_gpt.py's model flags."""
    from threefold.checkpoint.args import model_flags
    from threefold.checkpoint.hf import read_hf_config

    _, _, model = read_hf_config(path, "--hf-config")
    flags = model_flags(dataclasses.asdict(model))
    return without(flags, {"--seq-length", "--max-position-embeddings"})  # the plan's own


def without(argv: list[str], names: set[str]) -> list[str]:
    """`argv` less the flags in `names`, each with its values (the words up to the next
    flag; a negative number is a value) or in its `--flag=value` form."""
    return split_flags(argv, names)[0]


def split_flags(argv: list[str], names: set[str]) -> tuple[list[str], list[str]]:
    """`argv` as the words of flags not in `names` and those of flags in it."""
    kept, dropped, dropping = [], [], False
    for word in argv:
        if word.startswith("--"):
            dropping = word.split("=", 1)[0] in names
        (dropped if dropping else kept).append(word)
        if "=" in word and word.startswith("--"):
            dropping = False  # (its value is in the word)
    return kept, dropped


def _cluster_mistake(args: argparse.Namespace) -> str | None:
    """The line for a cluster flag no layout can be planned on, else None."""
    if not 0 < args.memory_fraction <= 1:
        return f"--memory-fraction {args.memory_fraction}: give a share above 0, at most 1"
    return None


def _refuse(message: str) -> int:
    print(f"plan_layout.py: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(
        prog="plan_layout.py",
        description=__doc__,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gpus", type=positive(int), required=True, help="GPUs in the cluster")
    parser.add_argument(
        "--gpus-per-node", type=positive(int), default=8, help="GPUs per node (default 8)"
    )
    parser.add_argument(
        "--gpu", choices=sorted(HARDWARE), default="H100", help="GPU type (default H100)"
    )
    parser.add_argument(
        "--gpu-memory-gib", type=positive(float), default=80.0, help="memory per GPU (default 80)"
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of the memory a layout may fill, the rest for the allocator (default 0.9)",
    )
    parser.add_argument(
        "--peak-tflops", type=positive(float), help="dense bf16 peak, if not the GPU's"
    )
    parser.add_argument(
        "--intra-node-gbps", type=positive(float), help="NCCL bus bandwidth in a node"
    )
    parser.add_argument("--inter-node-gbps", type=positive(float), help="per GPU across nodes")
    parser.add_argument("--hf-config", help="a Hugging Face config.json instead of model flags")
    parser.add_argument(
        "--top", type=positive(int), default=10, help="layouts to print (default 10)"
    )
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        build_parser("plan_layout.py", __doc__, parser).print_help()
        return 0
    args, rest = parser.parse_known_args(argv)
    mistake = _cluster_mistake(args)
    if mistake:
        return _refuse(mistake)
    if args.hf_config:
        if not os.path.isfile(args.hf_config):
            return _refuse(f"--hf-config {args.hf_config}: no such file")
        try:
            rest = hf_model_flags(args.hf_config) + rest
        except ConfigError as error:
            return _refuse(str(error))
    # A pretraining command's own layout is what the plan replaces: left out, and said so
    # (beside the plan's, the printed command would hold two; checked, it would be refused
    # on one GPU). --bf16 is added below.
    rest, yours = split_flags(rest, PLANNED)
    yours = without(yours, {"--bf16"})
    if yours:
        print(f"> the plans choose the layout; left out of yours: {' '.join(yours)}")
    if "--max-position-embeddings" not in rest and "--seq-length" in rest:
        rest += ["--max-position-embeddings", rest[rest.index("--seq-length") + 1]]
    base = [*rest, "--bf16", "--mock-data"]
    if "--tokenizer-type" not in rest:
        base += ["--tokenizer-type", "NullTokenizer"]
    # The model flags checked once, as pretrain_gpt.py would: a mistake is one line, exit 2.
    with contextlib.redirect_stdout(io.StringIO()):
        parse_args(base, world_size=1, prog="plan_layout.py")
    planner = Planner(rest, base, args.gpus, args.gpus_per_node, args)
    try:
        plans = planner.plans()
    except ConfigError as error:  # what only the memory estimate needs (the vocabulary size)
        return _refuse(str(error))
    print_plans(plans, planner, args.top)
    if not plans:
        print("plan_layout.py: error: no layout fits; add GPUs or memory", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
