"""Megatron-LM's flags for features threefold does not have: each refused in one line naming
the feature (threefold/arguments.py), never with argparse's "unrecognized arguments". Every
flag of Megatron-LM's command line is taken by threefold's parser (its own fields and
threefold/megatron_compat.py's) or named here: tests/test_megatron_flags.py holds the two to
tests/data/megatron_flags.txt."""

from __future__ import annotations

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
        ("--log-device-memory-used", "--log-world-size-to-tensorboard"), "other logged numbers"
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
