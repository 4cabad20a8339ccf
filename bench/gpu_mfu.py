"""Training throughput and MFU of a ~1B LLaMA-style model on one GPU: threefold against what a
user would pick instead, same shapes, same GPU, one run.

    python bench/gpu_mfu.py --out bench/results/gpu_mfu          # on a GPU machine
    python bench/gpu_mfu.py --tiny --out /tmp/gpu_mfu_smoke      # the script itself, on a CPU
    python bench/gpu_mfu.py --moe --out bench/results/gpu_moe    # a Mixtral-style MoE instead

With --moe the model is a mixture of experts (8 experts, top-2, ~0.9B parameters active of
2.5B) and the contenders are threefold (its grouped GEMM: torch._grouped_mm in bf16) with and
without --compile-layers, and transformers' MixtralForCausalLM, eager and compiled (same
recipe as its LLaMA leg); no auxiliary loss in either (transformers leaves it out unless asked,
threefold's coefficient is 0). Model FLOPs count the active parameters.

Contenders, each in its own process (its own memory peak, no shared compile caches), each
logging to OUT/<name>.log:
- threefold: `Trainer.train_step` with --bf16 (bf16 weights; fp32 gradients, masters and Adam
  state) and the kernels chosen at start-up (its log line is in the raw log); and the same with
  --compile-layers (each transformer layer one torch.compile'd graph);
- transformers: LlamaForCausalLM with SDPA, fp32 weights under bf16 autocast (the recipe of
  transformers' Trainer with bf16=True), PyTorch's fused AdamW; eager and torch.compile'd;
- megatron-core: GPTModel with the local layer spec, bf16 with fp32 masters through
  megatron-core's DDP and optimizer (needs CUDA: its RoPE asks torch.cuda for the device);
  micro-batch 1 (its unfused attention's s x s scores do not fit at 2), same global batch;
- torchtitan 0.2.2: its Llama 3 model, `parallelize_llama` and loss as its Trainer runs them
  on one GPU (bf16 autocast over fp32 weights), eager and with its per-block torch.compile;
  reported as not run where it does not import (carry its wheels: bench/README.md).
With --fp8 (or named in --only) also threefold's FP8 GEMMs (delayed hybrid, Megatron-LM's
Llama recipe; compiled; with --fp8-param-gather; tensorwise; rowwise) and torchtitan with
torchao's float8 (tensorwise and rowwise, compiled as its float8 is meant to run); with --moe,
threefold's delayed hybrid and rowwise FP8 (the one that puts the experts in FP8).
Named in --only: threefold+offload, the attention's saved tensors offloaded to host memory
(--fine-grained-activation-offloading, model/activation_offload.py): its peak memory and
tokens/s beside threefold's.
--shape 8b-8l: a wider model for FP8's larger GEMMs, LLaMA-3-8B's width (hidden 4096, 32
heads, 8 KV groups; FFN 11264, what torchtitan's multiple_of makes of it) at 8 layers.

Model FLOPs per step are threefold's count (threefold/training/flops.py, docs/performance.md),
the same for every contender; MFU divides by the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gpu_contenders import megatron_core_step, torchtitan_step, transformers_step  # noqa: E402

sys.path.insert(0, ROOT)


@dataclasses.dataclass
class Shape:
    num_layers: int = 16
    hidden_size: int = 2048
    num_attention_heads: int = 16
    num_query_groups: int = 8
    ffn_hidden_size: int = 5632
    vocab_size: int = 32000
    seq_length: int = 4096
    micro_batch_size: int = 2
    # Micro-batches accumulated per optimizer step, in every contender (as their trainers do):
    # 32k tokens per step keeps the optimizer, which touches every fp32 master and moment
    # once per step, from dominating as it would at one 4k-token sequence per step.
    global_batch_size: int = 8
    # Mixture of experts (--moe): experts per layer, experts per token, each expert's FFN.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None


TINY = Shape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=176,
    vocab_size=512,
    seq_length=64,
    micro_batch_size=2,
    global_batch_size=4,
)
MOE = Shape(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2816)
# --shape 8b-8l (~1.7B parameters): FP8's gain grows with the GEMMs' size.
WIDE_8B = Shape(
    num_layers=8,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=11264,
)
TINY_MOE = dataclasses.replace(TINY, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96)
MOE_CONTENDERS = ("threefold", "threefold+compile-layers", "transformers", "transformers+compile")
CONTENDERS = (
    "threefold",
    "threefold+compile-layers",
    "transformers",
    "transformers+compile",
    "megatron-core",
    "torchtitan",
    "torchtitan+compile",
)
# FP8 GEMMs in the attention and MLP linears (--fp8-format hybrid, docs/fp8.md): with --fp8,
# or named in --only. MFU stays against the bf16 peak; the table states the FP8 peak too.
# +param-gather: the weights cast from the fp32 masters by the (one-rank) distributed optimizer
# instead of from the bf16 weights in the step's first forward (--fp8-param-gather; its FP8
# all-gather needs DP > 1 to show).
# tensorwise and rowwise beside torchtitan's float8 recipes of those names (torchao's rowwise
# is E4M3 throughout); blockwise, Megatron-LM's (TE's Float8BlockScaling), in E4M3 as usual.
# +compile-layers: the FP8 linears traced into each layer's graph, as torchtitan compiles
# torchao's (docs/fp8.md), their casts the Triton kernels as opaque operators; +fused-casts:
# the casts left to Inductor to fuse with the ops around them (--fusion-impl compile).
FP8_CONTENDERS = (
    "threefold+fp8",
    "threefold+fp8+compile-layers",
    "threefold+fp8+compile-layers+fused-casts",
    "threefold+fp8+param-gather",
    "threefold+fp8-tensorwise",
    "threefold+fp8-tensorwise+compile-layers",
    "threefold+fp8-rowwise",
    "threefold+fp8-blockwise",
    "torchtitan+float8+compile",
    "torchtitan+float8-rowwise+compile",
)
# --moe --fp8: FP8 outside the experts (delayed hybrid; the experts' grouped GEMM in bf16), and
# rowwise, whose experts run in FP8 one at a time (docs/fp8.md).
MOE_FP8_CONTENDERS = ("threefold+fp8", "threefold+fp8-rowwise")
OFFLOAD_FLAGS = ("--fine-grained-activation-offloading", "--offload-modules", "core_attn")
OFFLOAD_FLAGS += ("attn_proj", "qkv_linear")
MEMORY_CONTENDERS = ("threefold+offload",)
FP8_FLAGS = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16")
FP8_FLAGS += ("--fp8-amax-compute-algo", "max")
TENSORWISE_FLAGS = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
ROWWISE_FLAGS = ("--fp8-format", "e4m3", "--fp8-recipe", "rowwise")
BLOCKWISE_FLAGS = ("--fp8-format", "e4m3", "--fp8-recipe", "blockwise")
PARAM_GATHER_FLAGS = ("--use-distributed-optimizer", "--fp8-param-gather")


def threefold_args(shape: Shape, bf16: bool) -> list[str]:
    """pretrain_gpt.py's flags for the shape (mock data, no dropout, no evaluation)."""
    return [
        "--num-layers",
        str(shape.num_layers),
        "--hidden-size",
        str(shape.hidden_size),
        "--num-attention-heads",
        str(shape.num_attention_heads),
        "--group-query-attention",
        "--num-query-groups",
        str(shape.num_query_groups),
        "--ffn-hidden-size",
        str(shape.ffn_hidden_size),
        "--seq-length",
        str(shape.seq_length),
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--vocab-size",
        str(shape.vocab_size),
        "--make-vocab-size-divisible-by",
        "64",
        "--micro-batch-size",
        str(shape.micro_batch_size),
        "--global-batch-size",
        str(shape.global_batch_size),
        "--mock-data",
        "--train-iters",
        "100000",
        "--eval-iters",
        "0",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--lr",
        "1e-4",
        # The step as measured before NaN checking became the default (its per-iteration sync
        # is a Megatron-LM default, not measured here yet on a GPU); the other legs have none.
        "--no-check-for-nan-in-loss-and-grad",
        *(["--bf16"] if bf16 else []),
        *(
            [
                "--num-experts",
                str(shape.num_experts),
                "--moe-router-topk",
                str(shape.moe_router_topk),
                "--moe-ffn-hidden-size",
                str(shape.moe_ffn_hidden_size),
                "--moe-grouped-gemm",
                "--moe-token-dispatcher-type",
                "alltoall",
            ]
            if shape.num_experts
            else []
        ),
    ]


# --- contenders: each returns a `step()` that trains one iteration and returns its loss ----


def _threefold(shape: Shape, device, bf16: bool, extra: tuple[str, ...] = ()):
    from threefold.arguments import parse_args
    from threefold.parallel.parallel_context import ParallelContext
    from threefold.training.memory_estimate import estimate_memory
    from threefold.training.trainer import Trainer

    trainer = Trainer(
        parse_args(threefold_args(shape, bf16) + list(extra)), device, ParallelContext()
    )

    def step() -> float:
        return trainer.train_step()[0]

    # What tools/estimate_memory.py predicts, beside the measured peak (FP8's terms included).
    step.estimate_gib = estimate_memory(trainer.config).total / 2**30
    return step


def run_contender(name: str, shape: Shape, steps: int, warmup: int) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    build = {
        "threefold": _threefold,
        "threefold+compile-layers": lambda *a: _threefold(*a, extra=("--compile-layers",)),
        "threefold+fp8": lambda *a: _threefold(*a, extra=FP8_FLAGS),
        "threefold+fp8+compile-layers": lambda *a: _threefold(
            *a, extra=(*FP8_FLAGS, "--compile-layers")
        ),
        "threefold+fp8+compile-layers+fused-casts": lambda *a: _threefold(
            *a, extra=(*FP8_FLAGS, "--compile-layers", "--fusion-impl", "compile")
        ),
        "threefold+fp8+param-gather": lambda *a: _threefold(
            *a, extra=(*FP8_FLAGS, *PARAM_GATHER_FLAGS)
        ),
        "threefold+fp8-tensorwise": lambda *a: _threefold(*a, extra=TENSORWISE_FLAGS),
        "threefold+fp8-tensorwise+compile-layers": lambda *a: _threefold(
            *a, extra=(*TENSORWISE_FLAGS, "--compile-layers")
        ),
        "threefold+fp8-rowwise": lambda *a: _threefold(*a, extra=ROWWISE_FLAGS),
        "threefold+fp8-blockwise": lambda *a: _threefold(*a, extra=BLOCKWISE_FLAGS),
        "threefold+offload": lambda *a: _threefold(*a, extra=OFFLOAD_FLAGS),
        "torchtitan+float8+compile": lambda *a: torchtitan_step(
            *a, compiled=True, float8="tensorwise"
        ),
        "torchtitan+float8-rowwise+compile": lambda *a: torchtitan_step(
            *a, compiled=True, float8="rowwise"
        ),
        "transformers": transformers_step,
        "transformers+compile": lambda *a: transformers_step(*a, compiled=True),
        "megatron-core": megatron_core_step,
        "torchtitan": torchtitan_step,
        "torchtitan+compile": lambda *a: torchtitan_step(*a, compiled=True),
    }[name]
    step = build(shape, device, cuda)
    losses = [step() for _ in range(warmup)]  # compilation and allocator warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses += [step() for _ in range(steps)]  # .item() synchronizes every step
    seconds = (time.perf_counter() - start) / steps
    return {
        "step_s": seconds,
        "tokens_per_s": shape.global_batch_size * shape.seq_length / seconds,
        "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "estimate_gib": getattr(step, "estimate_gib", None),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


# --- the parent: one process per contender, one table ---------------------------------------


def _flops_per_step(shape: Shape) -> float:
    from threefold.arguments import parse_args
    from threefold.training.flops import training_flops_per_iteration

    model = parse_args(threefold_args(shape, False), world_size=1).model
    return training_flops_per_iteration(model, shape.global_batch_size, model.padded_vocab_size(1))


def _failure(log: str) -> str:
    """The line of a failed contender's log that names its exception: the last unindented
    `module.Name: message` line (dynamo's closing hints are indented or have no such name),
    rank prefixes removed; else the last line."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in log.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^(\w+\.)*[A-Z]\w*: ", line)]
    return (named or lines)[-1][:200]


def _environment() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU)"
    versions = []
    # Found and read from their installed metadata, not imported: importing transformers and
    # megatron-core took 6 of a CPU check's 50 s (a contender that cannot import its library
    # says so in its own row).
    distributions = {
        "transformers": "transformers",
        "megatron.core": "megatron-core",
        "transformer_engine": "transformer-engine",
        "apex": "apex",
        "torchtitan": "torchtitan",
    }
    for package, distribution in distributions.items():
        try:
            found = importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:  # the parent package (megatron) is absent
            found = False
        if not found:
            versions.append(f"{package} absent")
            continue
        try:
            versions.append(f"{package} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:  # on the path, not installed
            versions.append(f"{package} (from source)")
    return f"{gpu}; torch {torch.__version__}, Python {platform.python_version()}; " + ", ".join(
        versions
    )


def _title(tiny: bool, moe: bool, shape: str = "1b") -> str:
    size = "tiny check model" if tiny else "Mixtral-style model" if moe else "1B LLaMA-style model"
    if shape == "8b-8l":
        size = "LLaMA-3-8B-wide model at 8 layers"
    return f"{size}{', mixture of experts' if moe and tiny else ''}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--out", help="default: bench/results/gpu_mfu; with --tiny, a new temporary directory"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model: check the script")
    parser.add_argument("--moe", action="store_true", help="a Mixtral-style mixture of experts")
    parser.add_argument(
        "--shape", choices=("1b", "8b-8l"), default="1b", help="8b-8l: 8B's width, 8 layers"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=CONTENDERS + FP8_CONTENDERS + MEMORY_CONTENDERS,
        help="default: all (--moe: four)",
    )
    parser.add_argument("--fp8", action="store_true", help="also threefold with FP8 GEMMs")
    parser.add_argument("--micro-batch-size", type=int, help="default: the shape's (2)")
    parser.add_argument("--global-batch-size", type=int, help="default: the shape's (8)")
    parser.add_argument(
        "--contender",
        choices=CONTENDERS + FP8_CONTENDERS + MEMORY_CONTENDERS,
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    shape = {(False, False): Shape(), (True, False): TINY, (False, True): MOE}.get(
        (args.tiny, args.moe), TINY_MOE
    )
    if args.shape != "1b":
        if args.tiny or args.moe:
            parser.error(f"--shape {args.shape} is a dense model of its own: drop --tiny/--moe")
        shape = WIDE_8B
    args.only = args.only or list(MOE_CONTENDERS if args.moe else CONTENDERS)
    if args.fp8:
        fp8 = MOE_FP8_CONTENDERS if args.moe else FP8_CONTENDERS
        args.only += [name for name in fp8 if name not in args.only]
    if args.moe and set(args.only) - set(MOE_CONTENDERS + MOE_FP8_CONTENDERS):
        parser.error(f"--moe runs {', '.join(MOE_CONTENDERS + MOE_FP8_CONTENDERS)}")
    for field in ("micro_batch_size", "global_batch_size"):
        if getattr(args, field):
            setattr(shape, field, getattr(args, field))
    if shape.global_batch_size % shape.micro_batch_size:
        parser.error("--global-batch-size must be a multiple of --micro-batch-size")
    if args.contender:  # a child: one contender, one RESULT line
        print(
            "RESULT " + json.dumps(run_contender(args.contender, shape, args.steps, args.warmup)),
            flush=True,
        )
        return

    from threefold.training.flops import peak_tflops

    if args.out is None:  # a check on the tiny model never writes over the GPU's results
        results_dir = os.path.join(ROOT, "bench", "results", "gpu_mfu")
        args.out = tempfile.mkdtemp(prefix="gpu_mfu_tiny_") if args.tiny else results_dir
        print(f"logs and tables in {args.out}", file=sys.stderr, flush=True)
    os.makedirs(args.out, exist_ok=True)
    environment = _environment()
    flops = _flops_per_step(shape)
    peak = None
    import torch

    if torch.cuda.is_available():
        peak = peak_tflops(torch.cuda.get_device_name(0))
    results = {}
    for name in args.only:
        log = os.path.join(args.out, f"{name.replace('+', '_')}.log")
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--contender",
            name,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        command += ["--tiny"] if args.tiny else []
        command += ["--moe"] if args.moe else []
        command += ["--shape", args.shape]
        command += [
            "--micro-batch-size",
            str(shape.micro_batch_size),
            "--global-batch-size",
            str(shape.global_batch_size),
        ]
        with open(log, "w") as stream:
            stream.write(f"$ {' '.join(command)}\n")
            stream.flush()
            run = subprocess.run(
                command,
                stdout=stream,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
            )
        text = open(log).read()
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if run.returncode == 0 and lines:
            results[name] = json.loads(lines[-1][len("RESULT ") :])
        else:
            results[name] = {"error": _failure(text)}
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)

    ours = max(
        (
            result["tokens_per_s"]
            for name, result in results.items()
            if name.startswith("threefold") and "error" not in result
        ),
        default=None,
    )
    rows = []
    for name, result in results.items():
        if "error" in result:
            rows.append(f"| {name} | not run: {result['error']} | | | | | | |")
            continue
        tflops = flops / result["step_s"] / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a (not a known GPU)"
        memory = f"{result['memory_gib']:.1f}" if result["memory_gib"] is not None else "n/a"
        estimate = result.get("estimate_gib")
        estimate = f"{estimate:.1f}" if estimate is not None else "-"
        ratio = f"{ours / result['tokens_per_s']:.2f}" if ours else "n/a"
        rows.append(
            f"| {name} | {result['tokens_per_s']:,.0f} | {tflops:.1f} | {mfu} | "
            f"{memory} | {estimate} | {result['first_loss']:.3f} -> {result['last_loss']:.3f} | "
            f"{ratio} |"
        )
    report = "\n".join(
        [
            f"# Training throughput, {_title(args.tiny, args.moe, args.shape)}",
            "",
            f"Environment: {environment}.",
            "",
            f"Shape: {dataclasses.asdict(shape)}; model FLOPs per step {flops:.4g} "
            f"(threefold/training/flops.py); {args.steps} timed steps after {args.warmup} warm-up "
            "steps; one process per contender, raw logs beside this file.",
            "",
            "| contender | tokens/s | model TFLOP/s | MFU | peak memory GiB | threefold's "
            "estimate GiB | loss first -> last | best threefold's speed-up |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    if set(args.only) & set(FP8_CONTENDERS):
        peaks = f"{peak:.0f} and {2 * peak:.0f} TFLOP/s" if peak else "unknown here"
        report += (
            "\nMFU is against the dense bf16 peak for every row, FP8 ones included; the dense "
            f"FP8 peak of Hopper is twice it (bf16 and FP8: {peaks}).\n"
        )
    with open(os.path.join(args.out, "gpu_moe.md" if args.moe else "gpu_mfu.md"), "w") as stream:
        stream.write(report)
    print(report)


if __name__ == "__main__":
    main()
