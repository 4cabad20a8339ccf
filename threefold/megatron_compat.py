"""Megatron-LM flags that threefold takes so that Megatron's own launch scripts run unchanged.

Three kinds, none of them silently dropped:
- deprecated aliases, stored as the flag they stand for (`--recompute-activations` is
  `--recompute-granularity selective`, as in Megatron-LM);
- options whose one supported value is Megatron's default: that value is accepted, any other is
  refused in one line naming the flag;
- switches that turn off an implementation path threefold does not have (Megatron's fused
  masked-softmax kernel, its async all-reduce, ...): the function computed is the same either
  way, so the run goes ahead and the start-up log names each such flag and why.
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


# Megatron-LM flags of features threefold does not have: refused in one line naming the
# feature, not with argparse's "unrecognized arguments". A key ending in "-" is a prefix.
MISSING = {
    "--fp8-dot-product-attention": "FP8 attention (Transformer Engine's)",
    "--fp8-multi-head-attention": "FP8 attention (Transformer Engine's)",
    "--fp8-quantizer-factory": "custom FP8 recipes",
    "--fp8-output-proj": "an FP8 output layer (MXFP8)",
    "--fp4-": "FP4 training",
    "--mtp-": "multi-token prediction variants (hidden-state mixing, detached heads)",
    "--dsa-": "DeepSeek sparse attention's other options (threefold has --dsa-indexer-n-heads, "
    "-head-dim, -topk, -loss-coeff, -use-sparse-loss, -rope-interleaved and -k-norm-epsilon)",
    # (--fine-grained-activation-offloading and its flags: config/activation_offload.py)
    "--delay-offload-until-cuda-graph": "CUDA graphs",
    # (--use-megatron-fsdp and its sharding and dtype flags run as FSDP2: config/megatron_fsdp.py)
    "--megatron-fsdp-": "Megatron-FSDP's other options",
    "--lion-": "the Lion optimizer (threefold has adam and muon)",
    "--no-use-layer-wise-param-layout": "Megatron-LM's layer-wise distributed optimizer for Muon",
    "--adaptive-muon-": "adaptive Muon (threefold has adam and muon)",
    "--sgd-momentum": "the SGD optimizer (threefold has adam and muon)",
    "--export-": "ModelOpt export and distillation",
    "--cuda-graph-": "CUDA graphs",
    "--enable-cuda-graph": "CUDA graphs",
    "--inference-": "Megatron-LM's inference engine (threefold samples with tools/generate.py)",
    "--max-tokens-to-oom": "Megatron-LM's inference engine",
    "--num-tokens-to-generate": "Megatron-LM's inference engine",
    "--prompts": "Megatron-LM's inference engine",
    "--incoming-requests-per-sec": "Megatron-LM's inference engine",
    "--enable-chunked-prefill": "Megatron-LM's inference engine",
    "--return-log-probs": "Megatron-LM's inference engine",
    "--rl-": "reinforcement learning (GRPO)",
    "--grpo-": "reinforcement learning (GRPO)",
    "--perform-rl-step": "reinforcement learning (GRPO)",
    "--langrl-env-config": "reinforcement learning (GRPO)",
    # flags Megatron-LM itself no longer takes (its validate_args stops on them)
    "--batch-size": "removed from Megatron-LM: use --micro-batch-size",
    "--warmup": "removed from Megatron-LM: use --lr-warmup-fraction or --lr-warmup-iters",
    "--model-parallel-size": "removed from Megatron-LM: use --tensor-model-parallel-size",
    "--checkpoint-activations": "removed from Megatron-LM: use --recompute-activations or "
    "--recompute-granularity",
    "--inprocess-": "in-process restarts (NVIDIA Resiliency Extension)",
    "--enable-ft-package": "the fault-tolerance package (NVIDIA Resiliency Extension)",
    "--calc-ft-timeouts": "the fault-tolerance package (NVIDIA Resiliency Extension)",
    "--ft-num-warmup-iters": "the fault-tolerance package (NVIDIA Resiliency Extension)",
    "--yaml-cfg": "YAML configuration files (give the flags)",
    "--hybrid-": "other layouts of a hybrid model (threefold takes --hybrid-layer-pattern)",
    "--mamba-": "other Mamba options (threefold has --mamba-state-dim, -head-dim, -num-groups "
    "and -num-heads)",
    "--heterogeneous-layers-config-": "heterogeneous layers",
    "--kitchen-": "custom quantization recipes",
    "--te-precision-config-file": "custom quantization recipes",
    "--logits-": "distillation from saved logits",
    "--otel-": "OpenTelemetry tracing",
    # Megatron-LM's flags of 2026 (tests/data/megatron_flags.txt)
    "--distribute-saved-activations": "recomputation's saved inputs spread over the "
    "tensor-parallel ranks",
    "--mlp-chunks-for-training": "an MLP computed in chunks of the sequence",
    **dict.fromkeys(
        (
            "--cache-mla-latents",
            "--flash-decode",
            "--mlp-chunks-for-prefill",
            "--nccl-all-reduce-for-prefill",
            "--num-speculative-tokens",
            "--use-legacy-static-engine",
            "--no-inference-",
            "--use-same-sampling-seed-across-dp-ranks",
        ),
        "Megatron-LM's inference engine (threefold samples with tools/generate.py)",
    ),
    **dict.fromkeys(
        ("--no-rl-", "--refit-method", "--moe-enable-routing-replay"),
        "reinforcement learning (GRPO)",
    ),
    **dict.fromkeys(
        (
            "--decode-only-cuda-graphs",
            "--external-cuda-graph",
            "--optimizer-cuda-graph",
            "--moe-pad-experts-for-cuda-graph-inference",
        ),
        "CUDA graphs",
    ),
    **dict.fromkeys(
        (
            "--chat-template",
            "--tokenizer-hf-",
            "--tokenizer-metadata",
            "--tokenizer-sentencepiece-",
            "--no-tokenizer-sentencepiece-",
            "--disable-tokenizer-sentencepiece-",
            "--tokenizer-special-tokens",
            "--use-gigatoken",
            "--null-tokenizer-",
        ),
        "options of Megatron-LM's tokenizer library (threefold's tokenizers take --tokenizer-type "
        "and its files)",
    ),
    "--trust-remote-code": "tokenizers that run code from their files (threefold runs no code a "
    "file names)",
    "--ckpt-convert-": "converting checkpoints in a training run (threefold: "
    "tools/convert_checkpoint.py)",
    **dict.fromkeys(
        (
            "--non-persistent-local-",
            "--persistent-save-interval",
            "--replication",
            "--replication-",
        ),
        "local checkpoints (NVIDIA Resiliency Extension)",
    ),
    "--override-ckpt-iteration": "overriding a checkpoint's iteration",
    "--load-main-params-from-ckpt": "loading fp32 masters without the optimizer state",
    "--use-mp-args-from-checkpoint-args": "taking the parallel layout from a checkpoint "
    "(threefold loads any checkpoint into the command line's layout)",
    **dict.fromkeys(
        ("--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load"),
        "partial loads of fsdp_dtensor checkpoints",
    ),
    **dict.fromkeys(
        ("--no-save-tokenizer-assets", "--disable-save-tokenizer-assets"),
        "checkpoints without their tokenizer's files",
    ),
    "--dist-ckpt-save-pre-mcore-014": "megatron-core's torch_dist layout before 0.14",
    "--distrib-optim-fully-reshardable-mem-efficient": "megatron-core's low-memory fully "
    "reshardable save",
    "--disable-ckpt-load-validate-sharding-integrity": "loading without checking a checkpoint's "
    "sharding",
    "--config-logger-dir": "dumping each entry point's config (threefold's is in every "
    "checkpoint's metadata)",
    **dict.fromkeys(
        (
            "--create-all-gather-group",
            "--ddp-param-name-patterns-for-fp32-local-accumulation",
            "--ddp-reduce-scatter-with-fp32-accumulation",
            "--no-align-grad-reduce",
            "--disable-align-grad-reduce",
        ),
        "Megatron-LM's variants of gradient reduction",
    ),
    **dict.fromkeys(
        (
            "--gtp-",
            "--tensor-parallel-num-weight-shards",
            "--expert-tensor-parallel-num-weight-shards",
        ),
        "GTP weight rematerialization",
    ),
    **dict.fromkeys(
        ("--data-parallel-random-init", "--no-initialization"), "other weight initializations"
    ),
    **dict.fromkeys(
        (
            "--dataloader-defer-npy-index-mmap",
            "--dataloader-fast-cache-load",
            "--per-dataset-sequences-path",
            "--no-data-sharding",
            "--sample-rate",
        ),
        "megatron-core's other data-loading options",
    ),
    **dict.fromkeys(
        ("--enable-msc", "--object-storage-cache-path"),
        "object storage (NVIDIA's Multi-Storage Client)",
    ),
    **dict.fromkeys(
        ("--decrease-batch-size-if-needed", "--phase-transition-iterations"),
        "changing the batch during a run",
    ),
    **dict.fromkeys(
        ("--no-dsa-indexer-", "--disable-dsa-indexer-"),
        "DSA indexers without the Hadamard rotation or the score ReLU",
    ),
    **dict.fromkeys(
        (
            "--enable-full-sharding-in-hsdp",
            "--fsdp-db-use-persist-buf-on-alloc-fail",
            "--suggested-communication-unit-size",
            "--keep-fp8-transpose-cache",
        ),
        "Megatron-FSDP's other options",
    ),
    **dict.fromkeys(
        ("--enable-mhc-connections", "--mhc-"), "manifold-constrained hyper-connections (mHC)"
    ),
    "--gdp-": "Gated Delta Product layers",
    **dict.fromkeys(
        (
            "--ep-overlap-early-attn-memory-release",
            "--high-priority-a2a-comm-stream",
            "--overlap-dispatch-backward-with-experts-wgrad",
        ),
        "other options of the expert-parallel overlap",
    ),
    "--exit-signal-handler-for-dataloader": "signal handlers in data-loader workers",
    **dict.fromkeys(
        ("--adlr-autoresume", "--adlr-autoresume-interval"),
        "ADLR's autoresume (threefold stops cleanly with --exit-duration-in-mins and "
        "--exit-signal-handler)",
    ),
    "--allow-ambiguous-pad-tokens": "pad tokens that share an id with other special tokens",
    **dict.fromkeys(
        ("--apply-residual-connection-post-layernorm", "--fp32-residual-connection"),
        "other residual connections",
    ),
    **dict.fromkeys(
        ("--batch-invariant-mode", "--batch-invariant-backend"), "batch-invariant kernels"
    ),
    **dict.fromkeys(("--fake-process-group", "--lazy-mpu-init"), "fake or deferred process groups"),
    "--fault-injector-": "the fault injector (NVIDIA Resiliency Extension)",
    "--freeze-all-layers": "freezing layers",
    **dict.fromkeys(
        (
            "--use-grouped-gemm-for-dense-mlp",
            "--use-grouped-gemm-for-shared-expert",
            "--moe-use-grouped-tensor",
            "--moe-single-grouped-weight",
            "--moe-single-grouped-bias",
            "--moe-mlp-glu-interleave-size",
            "--moe-shared-expert-glu-interleave-size",
        ),
        "Transformer Engine's grouped and interleaved weight layouts",
    ),
    **dict.fromkeys(
        (
            "--moe-combine-bwd-dtype",
            "--moe-dispatch-fwd-dtype",
            "--moe-ncclep-zero-copy",
            "--moe-permute-fusion-into-hybridep",
            "--moe-hybridep-pad-uneven-dispatch-inputs",
        ),
        "options of the flex dispatcher's kernels",
    ),
    **dict.fromkeys(
        (
            "--moe-expert-rank-capacity-factor",
            "--moe-input-jitter-eps",
            "--moe-router-force-biased",
            "--moe-router-padding-for-fp8",
            "--moe-router-quantile-balancing-ema",
        ),
        "other router options",
    ),
    **dict.fromkeys(
        ("--moe-paged-stash", "--moe-paged-stash-"), "paged stashing of expert activations"
    ),
    "--moe-routing-trace-": "router decision traces",
    "--mrope-section": "multimodal rotary embeddings",
    "--mup-width-mult": "giving muP's width multiplier (threefold computes it as --hidden-size / "
    "--mup-base-hidden-size)",
    **dict.fromkeys(
        ("--head-lr-mult", "--iter-per-epoch", "--vocab-extra-ids"),
        "Megatron-LM's BERT, T5, vision and retrieval models (threefold trains GPT models)",
    ),
    **dict.fromkeys(
        (
            "--log-device-memory-used",
            "--log-max-attention-logit",
            "--log-world-size-to-tensorboard",
        ),
        "other logged numbers",
    ),
    "--max-seqlen-per-dp-cp-rank": "dynamic context-parallel sequence balancing",
    **dict.fromkeys(
        (
            "--memory-snapshot-path",
            "--record-memory-history",
            "--nvtx-ranges",
            "--record-shapes",
            "--pytorch-profiler-collect-",
            "--run-workload-inspector-server",
            "--gpu-sniff-test-interval",
        ),
        "other profiling tools (threefold has --profile)",
    ),
    **dict.fromkeys(
        (
            "--save-activations-interval",
            "--save-dgrads-interval",
            "--save-params-interval",
            "--save-tokens-per-expert-interval",
            "--save-wgrads-interval",
            "--dump-param-to-param-group-map",
        ),
        "dumping tensors during training",
    ),
    **dict.fromkeys(
        (
            "--nccl-communicator-config-path",
            "--sharp-enabled-group",
            "--use-sharp",
            "--symmetric-ar-type",
            "--disable-symmetric-registration",
            "--use-ring-exchange-p2p",
            "--pipeline-model-parallel-comm-backend",
            "--distributed-timeout-seconds-after-init",
            "--train-sync-interval",
        ),
        "other communication settings",
    ),
    **dict.fromkeys(
        (
            "--no-pin-cpu-grads",
            "--no-pin-cpu-params",
            "--overlap-cpu-optimizer-d2h-h2d",
            "--use-torch-optimizer-for-cpu-offload",
        ),
        "other options of the optimizer's CPU offload",
    ),
    "--no-weight-decay-cond-type": "other weight-decay conditions (biases and norms are free of "
    "decay)",
    "--onnx-safe": "ONNX export",
    "--output-logit-dtype": "another dtype for the output layer's GEMM",
    **dict.fromkeys(
        ("--padded-vocab-size", "--no-pad-vocab-size", "--disable-pad-vocab-size"),
        "a vocabulary size given padded (threefold pads --vocab-size to "
        "--make-vocab-size-divisible-by)",
    ),
    **dict.fromkeys(("--qk-clip", "--qk-clip-"), "QK-clip (MuonClip)"),
    "--reuse-grad-buf-for-mxfp8-param-ag": "MXFP8",
    **dict.fromkeys(
        (
            "--tp-comm-bootstrap-backend",
            "--tp-comm-overlap-rs-dgrad",
            "--no-tp-comm-",
            "--disable-tp-comm-",
        ),
        "Transformer Engine's userbuffers options (--tp-comm-overlap runs threefold's own ring of "
        "slices)",
    ),
    "--use-kitchen-attention": "custom quantization recipes",
    "--disable-straggler-on-startup": "switching the straggler report on and off during a run",
    "--flash-attention-version": "pinning a FlashAttention generation (--attention-backend "
    "chooses the kernels)",
    # Megatron-LM's BERT, T5, vision and retrieval models share its parser
    **dict.fromkeys(
        (
            "--bert-",
            "--biencoder-",
            "--ict-",
            "--dino-",
            "--retriever-",
            "--vision-",
            "--swin-backbone-type",
            "--img-h",
            "--img-w",
            "--num-channels",
            "--patch-dim",
            "--num-classes",
            "--classes-fraction",
            "--data-per-class-fraction",
            "--mask-type",
            "--mask-prob",
            "--mask-factor",
            "--block-data-path",
            "--evidence-data-path",
            "--titles-data-path",
            "--embedding-path",
            "--indexer-batch-size",
            "--indexer-log-interval",
            "--query-in-block-prob",
            "--use-one-sent-docs",
            "--short-seq-prob",
            "--output-bert-embeddings",
            "--encoder-num-layers",
            "--encoder-seq-length",
            "--decoder-num-layers",
            "--decoder-seq-length",
            "--relative-attention-",
        ),
        "Megatron-LM's BERT, T5, vision and retrieval models (threefold trains GPT models)",
    ),
}
# (flag, value) -> the feature a Megatron-LM choice selects that threefold does not have
MISSING_CHOICES = {
    ("--transformer-impl", "inference_optimized"): "Megatron-LM's inference-optimized layers",
    ("--position-embedding-type", "mrope"): "multimodal rotary embeddings",
    ("--experimental-attention-variant", "gdn2"): "Gated DeltaNet 2 (megatron-core's GDN2)",
}


def missing_feature(flag: str) -> str | None:
    """The Megatron-LM feature an unknown flag belongs to, when threefold knows it lacks it."""
    if flag in MISSING:
        return MISSING[flag]
    prefixes = [key for key in MISSING if key.endswith("-") and flag.startswith(key)]
    return MISSING[max(prefixes, key=len)] if prefixes else None
