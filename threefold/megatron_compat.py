"""Megatron-LM flags that threefold takes so that Megatron's own launch scripts run unchanged.

Three kinds, none of them silently dropped:
- deprecated aliases, stored as the flag they stand for (`--recompute-activations` is
  `--recompute-granularity selective`, as in Megatron-LM);
- options whose one supported value is Megatron's default: that value is accepted, any other is
  refused in one line naming the flag;
- switches that turn off an implementation path threefold does not have (Megatron's fused
  masked-softmax kernel, its async all-reduce, ...): the function computed is the same either
  way, so the run goes ahead and the start-up log names each such flag and why.

The flags of features threefold lacks are threefold/megatron_missing.py's.
"""

from __future__ import annotations

import argparse

from threefold.config import ConfigError

# flag -> (destination, the value it stands for)
ALIASES = {
    "--recompute-activations": ("model.recompute_granularity", "selective"),
    "--use-rotary-position-embeddings": ("model.position_embedding_type", "rope"),
    # threefold's default already, as Megatron-LM's (--no-yarn-correction-range-round-to-int)
    "--yarn-correction-range-round-to-int": ("model.yarn_correction_range_round_to_int", True),
    "--use-torch-fsdp2": ("parallel.distributed_strategy", "fsdp"),
    "--use-flash-attn": ("kernels.attention_backend", "flash"),
    # threefold's default already (the chunked cross-entropy); --no-cross-entropy-loss-fusion
    # selects the one-shot reference.
    "--cross-entropy-loss-fusion": ("kernels.cross_entropy_loss_fusion", True),
    # threefold's default already, as Megatron-LM's (--no-check-for-nan-in-loss-and-grad: off)
    "--check-for-nan-in-loss-and-grad": ("training.check_for_nan_in_loss_and_grad", True),
    # newer Megatron-LM's spellings of flags threefold has
    "--disable-manual-gc-eval": ("training.manual_gc_eval", False),
    "--disable-use-tokenizer-model-from-checkpoint-args": (
        "checkpoint.use_tokenizer_model_from_checkpoint_args",
        False,
    ),
    "--exit-signal-handler-for-training": ("training.exit_signal_handler", True),
    "--disable-flight-recorder-dump-on-timeout": (
        "parallel.flight_recorder_dump_on_timeout",
        False,
    ),
    "--disable-flight-recorder-include-only-active": (
        "parallel.flight_recorder_include_only_active",
        False,
    ),
    "--disable-flight-recorder-extra-dump-on-exec": (
        "parallel.flight_recorder_extra_dump_on_exec",
        False,
    ),
}

# flag -> (type, the one supported value, why no other)
ONLY_DEFAULT = {
    "--dataloader-type": (str, "single", "only Megatron's default single-pass sampler exists"),
    "--optimizer-offload-fraction": (
        float,
        1.0,
        "--optimizer-cpu-offload keeps the whole optimizer state on the CPU (Megatron-LM's "
        "default fraction)",
    ),
    "--exit-signal": (
        str,
        ("SIGTERM", "SIGUSR1"),
        "--exit-signal-handler stops on either of those (SIGUSR1: Slurm's --signal)",
    ),
}

# flag -> (type, why any value changes nothing here): accepted and named at start-up
ANY_VALUE = {
    "--logging-level": (
        int,
        "threefold prints its own lines; it does not route them through Python's logging",
    ),
    "--async-strategy": (
        str,
        "--async-save has one implementation here (a thread of its own with its own process "
        "group, docs/reliability.md), not Megatron-LM's nvrx or mcore writers",
    ),
    "--wgrad-deferral-limit": (
        int,
        "it tunes --defer-embedding-wgrad-compute, whose deferral threefold does not make",
    ),
    "--cross-entropy-fusion-impl": (
        str,
        "the loss is threefold's chunked vocabulary-parallel cross-entropy (the one-shot "
        "reference with --no-cross-entropy-loss-fusion), whichever implementation is named",
    ),
    "--fp8-interval": (
        int,
        "Transformer Engine ignores it since version 1.8 and Megatron-LM documents it as "
        "ignored; scales follow --fp8-recipe",
    ),
    "--tp-comm-overlap-cfg": (
        str,
        "it tunes Transformer Engine's userbuffers; --tp-comm-overlap runs threefold's own "
        "ring of slices here (parallel/tensor_parallel/comm_overlap.py)",
    ),
    "--one-logger-project": (str, "threefold sends no telemetry to NVIDIA's one-logger"),
    "--one-logger-run-name": (str, "threefold sends no telemetry to NVIDIA's one-logger"),
    "--app-tag-run-name": (str, "threefold sends no telemetry to NVIDIA's one-logger"),
    "--app-tag-run-version": (str, "threefold sends no telemetry to NVIDIA's one-logger"),
    "--dist-ckpt-format": (
        str,
        "deprecated in Megatron-LM, where it has no effect either; --ckpt-format selects the "
        "format",
    ),
    "--ddp-num-buckets": (
        int,
        "gradient buckets are sized by --ddp-bucket-size (default 40M elements, Megatron-LM's)",
    ),
    "--tiktoken-pattern": (
        str,
        "it belongs to --tokenizer-type TikTokenizer, which threefold does not have",
    ),
    # Nemotron 3's launch settings (Megatron-LM's test_cases/nemotron)
    "--high-priority-stream-groups": (
        str,
        "it raises the CUDA priority of those groups' NCCL streams; the collectives are the same",
    ),
    "--moe-hybridep-num-sms": (
        int,
        "it sizes HybridEP's kernels, and --moe-token-dispatcher-type flex runs as alltoall here",
    ),
    "--moe-flex-dispatcher-num-sms": (
        int,
        "it sizes DeepEP's and HybridEP's kernels, and --moe-token-dispatcher-type flex runs as "
        "alltoall here",
    ),
    "--log-memory-interval": (
        int,
        "threefold writes max memory with every log line on CUDA (and to --tensorboard-dir)",
    ),
    "--local-rank": (
        int,
        "each process takes its rank from the launcher's environment (LOCAL_RANK), which "
        "torchrun and torch.distributed.launch both set",
    ),
    "--tensorboard-log-interval": (
        int,
        "threefold writes TensorBoard scalars with each log line (every --log-interval iterations)",
    ),
    "--straggler-minmax-count": (
        int,
        "--log-straggler reports every rank slower than --straggler-factor x the median, not a "
        "number of the slowest and fastest",
    ),
    "--straggler-ctrlr-port": (
        int,
        "--log-straggler reports for the whole run; nothing listens for a switch",
    ),
    **dict.fromkeys(
        ("--async-ckpt-cpu-priority", "--async-ckpt-io-priority", "--dist-ckpt-workers"),
        (
            int,
            "--async-save finishes each save on a thread of the training process, not in "
            "Megatron-LM's writer processes",
        ),
    ),
    **dict.fromkeys(
        ("--ckpt-fully-parallel-load-exchange-algo", "--ckpt-fully-parallel-load-process-group"),
        (str, "each rank reads its own tensors from the files; none are exchanged"),
    ),
    "--ckpt-fully-parallel-save-process-group": (
        str,
        "torch.distributed.checkpoint spreads the writing of shared tensors over their replicas",
    ),
    "--ckpt-pg-tensors-cache-path": (
        str,
        "it caches megatron-core's plan of which rank writes what; torch.distributed.checkpoint "
        "plans each save itself",
    ),
    "--tiktoken-num-special-tokens": (
        int,
        "it belongs to --tokenizer-type TikTokenizer, which threefold does not have",
    ),
    **dict.fromkeys(
        (
            "--moe-deepep-num-sms",
            "--moe-hybridep-num-sms-preprocessing",
            "--moe-hybridep-num-blocks-permute",
            "--moe-hybridep-num-blocks-unpermute",
        ),
        (
            int,
            "it sizes DeepEP's or HybridEP's kernels, and --moe-token-dispatcher-type flex runs "
            "as alltoall here",
        ),
    ),
}

# flag -> why it changes nothing here
NO_COUNTERPART = {
    "--is-hybrid-model": "--hybrid-layer-pattern alone makes a model hybrid (as in Megatron-LM "
    "today)",
    "--use-mcore-models": "threefold's model has megatron-core's parameter names, QKV layout "
    "and rank order already",
    "--no-masked-softmax-fusion": "attention runs in SDPA or Transformer Engine kernels; there "
    "is no separate masked-softmax kernel",
    "--no-bias-dropout-fusion": "bias, dropout and residual add are separate ops here",
    "--no-persist-layer-norm": "apex's persistent layer-norm kernel is not used",
    "--no-async-tensor-model-parallel-allreduce": "tensor-parallel all-reduces are synchronous",
    "--attention-softmax-in-fp32": "SDPA and the reference attention accumulate the softmax in "
    "fp32 already",
    "--no-create-attention-mask-in-dataloader": "attention is causal by construction; batches "
    "carry a mask only for --reset-attention-mask",
    "--auto-detect-ckpt-format": "--load always detects the format: threefold's own or "
    "Megatron-LM's torch_dist",
    "--ckpt-fully-parallel-save": "torch.distributed.checkpoint already writes each tensor that "
    "data-parallel replicas share once, from the replica with the "
    "least to write, so the replicas share the writing",
    "--no-ckpt-fully-parallel-save": "torch.distributed.checkpoint spreads the writing of "
    "shared tensors over their replicas either way",
    "--use-cpu-initialization": "parameters are always initialized on the CPU (from --seed, "
    "the same in every layout) and then moved to the device",
    "--fp16-lm-cross-entropy": "the cross-entropy is always computed in fp32 (by default in "
    "chunks of tokens, never holding the whole fp32 logits)",
    "--log-loss-scale-to-tensorboard": "the loss scale is always written with --tensorboard-dir",
    "--use-persistent-ckpt-worker": "--async-save finishes each save on a thread of its own, "
    "with its own process group; there is no worker process to keep",
    "--ckpt-pg-tensors-cache-create": "it caches megatron-core's plan of which rank writes "
    "what; torch.distributed.checkpoint plans each save itself",
    "--disable-jit-fuser": "threefold compiles nothing with TorchScript's fuser "
    "(--compile-layers uses torch.compile)",
    "--disable-msc": "a no-op in Megatron-LM too: its Multi-Storage Client is off by default",
    **dict.fromkeys(
        ("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard"),
        "the loss scale is always written with --tensorboard-dir",
    ),
    **dict.fromkeys(
        ("--no-clone-scatter-output-in-embedding", "--disable-clone-scatter-output-in-embedding"),
        "it decides whether megatron-core copies the embedding's sequence-parallel output to "
        "free its input sooner; the function computed is the same",
    ),
    "--disable-mamba-mem-eff-path": "it selects mamba_ssm's unfused kernels; threefold's Mamba "
    "mixer computes the same function with its own",
    "--fused-residual-rmsnorm": "Transformer Engine's fusion of the residual add into "
    "RMSNorm; threefold computes the same function unfused",
    "--mla-down-proj-fusion": "a fusion of multi-latent attention's down projections; "
    "threefold computes the same function unfused",
    "--use-te-activation-func": "Transformer Engine's activation kernels compute the same "
    "function as threefold's",
    "--moe-enable-deepep": "DeepEP's kernels send the tokens the all-to-all dispatcher sends; "
    "threefold runs the all-to-all",
    "--dist-ckpt-optim-fully-reshardable": "threefold's checkpoints always load into any "
    "TP/PP/DP layout, optimizer state included",
    "--ckpt-fully-parallel-load": "each rank reads only the tensors it holds, from the "
    "checkpoint directly",
    "--apply-query-key-layer-scaling": "it only guards fp16 attention scores against "
    "overflow; threefold's attention keeps its softmax in fp32 (the function is the same)",
    "--log-validation-ppl-to-tensorboard": "validation perplexity is always written with "
    "--tensorboard-dir",
    "--async-ckpt-use-cpu-shm": "--async-save stages into pinned memory of the saving process "
    "itself, whose writer is a thread: there is no other process to share memory with",
    "--defer-embedding-wgrad-compute": "the output layer's weight-gradient GEMM runs in each "
    "micro-batch's backward here; Megatron-LM moves it into the pipeline flush to hide the "
    "flush, with the same gradient",
    "--no-overlap-p2p-communication": "threefold's pipeline sends are asynchronous and its "
    "receives wait for their data whichever is asked; the values sent are the same",
    "--overlap-p2p-communication-warmup-flush": "threefold's pipeline sends are asynchronous in "
    "every phase of the schedule already (its receives wait for their data)",
    "--overlap-param-gather-with-optimizer-step": "with --overlap-param-gather every bucket's "
    "all-gather starts as soon as the step has written its shard, asynchronously, and the "
    "next forward waits per module: Megatron-LM's flag starts the first bucket's earlier still",
    "--moe-router-fusion": "the router's top-k and scores run as PyTorch operations (Transformer "
    "Engine's fused router kernel is a CUDA kernel of the same function)",
    "--moe-permute-fusion": "the dispatcher permutes tokens with PyTorch's index operations; "
    "Transformer Engine's fused permutation computes the same order",
    "--disable-gloo-process-groups": "threefold builds no gloo copies of its process groups "
    "(Megatron-LM keeps them for the distributed optimizer's host transfers); only "
    "--async-save adds a gloo group of its own, for its writer thread",
    "--ckpt-assume-constant-structure": "each save plans its shards afresh (a few collectives "
    "per save); the files written are the same either way",
    "--log-memory-to-tensorboard": "max memory (GiB) is always written with --tensorboard-dir "
    "on CUDA",
    "--no-one-logger": "threefold sends no telemetry (NVIDIA's one-logger is off either way)",
    "--one-logger-async": "threefold sends no telemetry to NVIDIA's one-logger",
    "--use-dist-ckpt": "deprecated in Megatron-LM, where it has no effect either; "
    "--ckpt-format selects the format",
    "--ddp-pad-buckets-for-high-nccl-busbw": "gradient buckets are not padded for NCCL's bus "
    "bandwidth; the gradients are the same",
    "--no-align-param-gather": "it changes when pipeline stages start their parameter "
    "all-gathers, not what they gather",
    "--no-gradient-reduce-div-fusion": "the division of the gradients by the data-parallel "
    "size is a step of its own here either way",
    "--enable-experimental": "it unlocks Megatron-LM's experimental features; threefold's need "
    "no such gate, and those it lacks are refused by name",
    # Megatron-FSDP's memory and NCCL settings (examples/megatron_fsdp/), under
    # --use-megatron-fsdp's FSDP2
    "--fsdp-double-buffer": "FSDP2 allocates its all-gather and reduce-scatter buffers itself",
    "--use-nccl-ub": "no NCCL user buffers are registered: the collectives move the same data "
    "through NCCL's own buffers",
    "--fsdp-manual-registration": "it registers --use-nccl-ub's buffers, which threefold does not "
    "use",
    # ModelOpt's model-builder settings (megatron/post_training/arguments.py), which its
    # examples/gptoss/02_train.sh passes to pretrain_gpt.py
    "--enable-gpt-oss": "it sets GPT-OSS's YaRN in ModelOpt's model builder, which Megatron-LM's "
    "pretrain_gpt.py builds with only for a ModelOpt checkpoint or distillation; threefold "
    "builds the model the other flags describe, as Megatron-LM does without them, and refuses "
    "ModelOpt checkpoints",
    "--export-force-local-attention": "it picks megatron-core's local attention in ModelOpt's "
    "model builder, used only for a ModelOpt checkpoint or distillation; threefold's attention "
    "kernel is the > kernels: line's",
    # Nemotron 3's launch settings (Megatron-LM's test_cases/nemotron)
    "--use-fused-weighted-squared-relu": "megatron-core's kernel weighs an expert's squared "
    "ReLU by the token's routing probability before fc2 (its experts have no bias); threefold "
    "weighs the expert's output after fc2, the same product up to rounding",
    "--moe-router-padding-for-quantization": "it pads each expert's tokens to a multiple of 16 "
    "or 32 with tokens of probability 0 for Transformer Engine's FP8 grouped GEMMs; threefold's "
    "experts take any count, and no output changes",
    "--log-progress": "Megatron-LM's progress.txt of job throughput is not written; the log "
    "line carries the same figures",
    "--log-energy": "GPU energy is not measured",
    "--te-rng-tracker": "it draws the model-parallel RNG streams with Transformer Engine's "
    "tracker (which CUDA graphs need); threefold's streams are its own either way",
    "--ckpt-fully-parallel-load-per-rank-objects": "each rank reads what it holds, RNG states "
    "included, from the checkpoint directly; there is no object exchange to skip",
    "--no-ckpt-load-validate-sharding-integrity": "it skips megatron-core's check that a saved "
    "tensor's shards cover it; threefold checks that as it reads each tensor (a missing shard "
    "stops the load in one line)",
    "--ckpt-drop-redundant-extra-state": "threefold writes no Transformer Engine _extra_state; "
    "its delayed-scaling amax histories and scales are tensors of their own in the checkpoint",
    "--use-transformer-engine-op-fuser": "it builds the MLP from Transformer Engine's "
    "operation-based API, for that library's fusions of the same function; threefold's MLP "
    "is its own layers, with their own fused kernels (the > kernels: line)",
}


# --spec's module path and function (Megatron-LM's layer specs): those of the hybrid stack,
# which --hybrid-layer-pattern builds here; threefold imports no code a command line names.
HYBRID_SPECS = (
    "megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec",
    "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec",
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM compatibility (threefold/megatron_compat.py)")
    for flag, (dest, value) in ALIASES.items():
        group.add_argument(
            flag,
            dest=dest,
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"alias of {dest}={value}",
        )
    for flag, (kind, value, why) in ONLY_DEFAULT.items():
        group.add_argument(
            flag,
            dest=_dest(flag),
            type=kind,
            default=argparse.SUPPRESS,
            help=f"only {' or '.join(map(str, value if isinstance(value, tuple) else (value,)))}: "
            f"{why}",
        )
    for flag, (kind, why) in ANY_VALUE.items():
        group.add_argument(
            flag, dest=_dest(flag), type=kind, default=argparse.SUPPRESS, help=f"no effect: {why}"
        )
    group.add_argument(
        "--spec",
        dest=_dest("--spec"),
        nargs="*",
        default=argparse.SUPPRESS,
        help="only Megatron-LM's hybrid stack spec, which --hybrid-layer-pattern builds",
    )
    for flag, why in NO_COUNTERPART.items():
        group.add_argument(
            flag,
            dest=_dest(flag),
            action="store_true",
            default=argparse.SUPPRESS,
            help=f"no effect: {why}",
        )


def _dest(flag: str) -> str:
    return "compat." + flag.lstrip("-").replace("-", "_")


def check(given: dict[str, object]) -> list[str]:
    """Check the compatibility flags given ({dest: value}; argparse stored the aliases
    already); returns a start-up note per switch with no counterpart. Raises ConfigError for an
    unsupported value."""
    by_dest = {_dest(flag): flag for flag in (*ONLY_DEFAULT, *ANY_VALUE, *NO_COUNTERPART)}
    by_dest[_dest("--spec")] = "--spec"
    notes = []
    for dest, value in given.items():
        flag = by_dest[dest]
        if flag == "--spec":
            spec = " ".join(value)
            if spec not in HYBRID_SPECS:
                raise ConfigError(
                    f"--spec {spec}: layer specs named by module path (threefold imports no code "
                    "its command line names); only the hybrid stack's is taken, which "
                    "--hybrid-layer-pattern builds: drop the flag"
                )
            notes.append(f"--spec {spec} has no effect: --hybrid-layer-pattern builds that stack")
        elif flag in ONLY_DEFAULT:
            _, supported, why = ONLY_DEFAULT[flag]
            accepted = supported if isinstance(supported, tuple) else (supported,)
            if value not in accepted:
                raise ConfigError(
                    f"{flag} {value}: {why} in threefold; use {' or '.join(map(str, accepted))} "
                    "or drop the flag"
                )
        elif flag in ANY_VALUE:
            notes.append(f"{flag} {value} has no effect: {ANY_VALUE[flag][1]}")
        else:
            notes.append(f"{flag} has no effect: {NO_COUNTERPART[flag]}")
    return notes
