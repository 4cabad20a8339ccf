"""Megatron-LM's command line, parsed into threefold's dataclass configs.

Flag names, defaults and meanings follow Megatron-LM so that an existing launch script runs.
Every flag belongs to exactly one config group; its destination is `<group>.<field>`. An unknown
flag is an argparse error that names it (exit code 2), never silently ignored.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Sequence

from threefold import megatron_compat
from threefold.checkpoint_args import flags_for_use_checkpoint_args
from threefold.config import Config, ConfigError
from threefold.training.config import LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES

# Flags that take no value; their config default is False.
_STORE_TRUE = "store_true"


def _add(group: argparse._ArgumentGroup, concern: str, name: str, *aliases: str,
         **kwargs) -> None:
    dest = name.lstrip("-").replace("-", "_")
    group.add_argument(name, *aliases, dest=f"{concern}.{kwargs.pop('field', dest)}",
                       default=argparse.SUPPRESS, **kwargs)


class _Parser(argparse.ArgumentParser):
    """Mistakes in one line, not after 150 lines of usage; a mistyped flag gets the nearest
    real one."""

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1).split("=")[0]
            near = difflib.get_close_matches(flag, list(self._option_string_actions), n=1)
            if near:
                message += f"; did you mean {near[0]}?"
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="threefold: Megatron-style 3D-parallel GPT pretraining",
        allow_abbrev=False,  # as Megatron-LM: a prefix of a flag is not that flag
    )

    g = parser.add_argument_group("model")
    _add(g, "model", "--num-layers", type=int)
    _add(g, "model", "--hidden-size", type=int)
    _add(g, "model", "--ffn-hidden-size", type=int,
         help="default 4*hidden, or 2/3 of that rounded to 64 with --swiglu")
    _add(g, "model", "--num-attention-heads", type=int)
    _add(g, "model", "--group-query-attention", action=_STORE_TRUE)
    _add(g, "model", "--num-query-groups", type=int)
    _add(g, "model", "--kv-channels", type=int, help="head size; default hidden/heads")
    _add(g, "model", "--seq-length", type=int)
    _add(g, "model", "--max-position-embeddings", type=int)
    _add(g, "model", "--position-embedding-type", choices=["learned_absolute", "rope"])
    _add(g, "model", "--use-rope-scaling", action=_STORE_TRUE,
         help="Llama 3.1's RoPE frequency scaling (original context 8192)")
    _add(g, "model", "--rope-scaling-factor", type=float, help="with --use-rope-scaling; "
         "default 8 (Llama 3.1), 32 for Llama 3.2")
    _add(g, "model", "--rotary-base", type=float)
    _add(g, "model", "--no-position-embedding", action="store_false",
         field="add_position_embedding",
         help="no learned position embedding (Megatron's deprecated form of "
              "--position-embedding-type rope, which it must come with)")
    _add(g, "model", "--normalization", choices=["LayerNorm", "RMSNorm"])
    _add(g, "model", "--norm-epsilon", type=float)
    _add(g, "model", "--apply-layernorm-1p", action=_STORE_TRUE,
         help="norm weights centred on zero, applied as 1 + weight")
    _add(g, "model", "--qk-layernorm", action=_STORE_TRUE,
         help="normalize each query and key head (--normalization, over the head size)")
    _add(g, "model", "--swiglu", action=_STORE_TRUE)
    _add(g, "model", "--disable-bias-linear", action="store_false", field="add_bias_linear")
    _add(g, "model", "--add-qkv-bias", action=_STORE_TRUE)
    _add(g, "model", "--openai-gelu", action=_STORE_TRUE, help="tanh approximation of GELU")
    _add(g, "model", "--untie-embeddings-and-output-weights", action=_STORE_TRUE)
    _add(g, "model", "--attention-dropout", type=float)
    _add(g, "model", "--hidden-dropout", type=float)
    _add(g, "model", "--init-method-std", type=float)
    _add(g, "model", "--vocab-size", type=int)
    _add(g, "model", "--make-vocab-size-divisible-by", type=int)
    _add(g, "model", "--recompute-granularity", choices=["full", "selective"],
         help="full: recompute whole layers; selective: only core attention")
    _add(g, "model", "--recompute-method", choices=["uniform", "block"],
         help="uniform: checkpoint groups of --recompute-num-layers layers; block: "
              "checkpoint the first --recompute-num-layers layers of each stage")
    _add(g, "model", "--recompute-num-layers", type=int)

    g = parser.add_argument_group("LoRA fine-tuning")
    _add(g, "model", "--lora-rank", type=int, help="add LoRA adapters of this rank; freeze "
         "everything else")
    _add(g, "model", "--lora-alpha", type=float, help="adapter scale alpha/rank (default 32)")
    _add(g, "model", "--lora-dropout", type=float)
    _add(g, "model", "--lora-target-modules", nargs="+",
         help="of linear_qkv linear_proj linear_fc1 linear_fc2 (default: all)")

    g = parser.add_argument_group("parallelism")
    _add(g, "parallel", "--tensor-model-parallel-size", type=int)
    _add(g, "parallel", "--pipeline-model-parallel-size", type=int)
    _add(g, "parallel", "--virtual-pipeline-model-parallel-size", type=int)
    _add(g, "parallel", "--num-layers-per-virtual-pipeline-stage", type=int)
    _add(g, "parallel", "--decoder-first-pipeline-num-layers", type=int)
    _add(g, "parallel", "--decoder-last-pipeline-num-layers", type=int)
    _add(g, "parallel", "--sequence-parallel", action=_STORE_TRUE)
    _add(g, "parallel", "--use-distributed-optimizer", action=_STORE_TRUE,
         help="shard fp32 master weights and Adam moments across data-parallel ranks")
    _add(g, "parallel", "--overlap-grad-reduce", action=_STORE_TRUE,
         help="all-reduce each gradient bucket as soon as backward has produced it")
    _add(g, "parallel", "--overlap-param-gather", action=_STORE_TRUE,
         help="all-gather updated parameters bucket by bucket during the next forward")
    _add(g, "parallel", "--accumulate-allreduce-grads-in-fp32", action=_STORE_TRUE,
         help="fp32 gradient buffer for fp16 models (bf16 models have one by default)")
    _add(g, "parallel", "--grad-reduce-in-bf16", action=_STORE_TRUE,
         help="with --bf16: accumulate and reduce gradients in bf16 instead of fp32")
    _add(g, "parallel", "--ddp-bucket-size", type=int, help="elements per gradient bucket")
    _add(g, "parallel", "--distributed-strategy", choices=["megatron", "ddp", "fsdp", "auto"],
         help="megatron: threefold's DP/TP/PP; ddp, fsdp: PyTorch DDP / FSDP2 (TP=PP=1); "
              "auto: chosen from the parameter count and device memory")
    _add(g, "parallel", "--distributed-backend", choices=["gloo", "nccl"],
         help="default: nccl when CUDA is available, else gloo")
    _add(g, "parallel", "--distributed-timeout-minutes", type=float)

    g = parser.add_argument_group("kernels (threefold/kernels; chosen at start-up and logged)")
    _add(g, "kernels", "--transformer-impl", choices=["local", "transformer_engine"],
         help="default: Transformer Engine's fused attention when it imports on CUDA, else local")
    _add(g, "kernels", "--attention-backend", choices=["auto", "flash", "fused", "unfused",
                                                        "local"],
         help="auto: the fastest SDPA kernel that runs the model's shapes; flash: "
              "FlashAttention; fused: cuDNN; unfused/local: plain softmax(QK^T)V")
    _add(g, "kernels", "--use-flash-attn", action="store_const", const="flash",
         field="attention_backend", help="same as --attention-backend flash")
    _add(g, "kernels", "--fusion-impl", choices=["auto", "compile", "eager"],
         help="how norms, SwiGLU/GELU, RoPE and cross-entropy chunks are fused when apex/TE do "
              "not: torch.compile or eager PyTorch (auto: compile on CUDA, eager on CPU)")
    _add(g, "kernels", "--no-norm-fusion", action="store_false", field="norm_fusion")
    _add(g, "kernels", "--no-bias-swiglu-fusion", action="store_false",
         field="bias_swiglu_fusion")
    _add(g, "kernels", "--no-bias-gelu-fusion", action="store_false", field="bias_gelu_fusion")
    _add(g, "kernels", "--no-rope-fusion", action="store_false", field="apply_rope_fusion")
    _add(g, "kernels", "--cross-entropy-loss-fusion", action=_STORE_TRUE,
         help="the chunked cross-entropy (threefold's default)")
    _add(g, "kernels", "--no-cross-entropy-loss-fusion", action="store_false",
         field="cross_entropy_loss_fusion",
         help="the one-shot reference cross-entropy (whole logits in fp32)")
    _add(g, "kernels", "--cross-entropy-chunk-tokens", type=int,
         help="tokens per chunk of the fused cross-entropy (default 4096)")
    _add(g, "kernels", "--compile-layers", action=_STORE_TRUE,
         help="torch.compile each transformer layer as one graph (torchtitan's --compile): "
              "fuses across kernels (residual adds, norms, RoPE, SwiGLU); compile time is "
              "paid once per process")

    g = parser.add_argument_group("training")
    _add(g, "training", "--micro-batch-size", type=int)
    _add(g, "training", "--global-batch-size", type=int)
    _add(g, "training", "--rampup-batch-size", type=int, nargs=3,
         metavar=("START", "INCREMENT", "SAMPLES"),
         help="grow the global batch from START by INCREMENT over SAMPLES samples (needs "
              "--train-samples)")
    _add(g, "training", "--train-iters", type=int)
    _add(g, "training", "--train-samples", type=int,
         help="train on this many samples (instead of --train-iters); the LR schedule is then "
              "in samples too")
    _add(g, "training", "--lr", type=float)
    _add(g, "training", "--min-lr", type=float)
    _add(g, "training", "--lr-decay-style", choices=LR_DECAY_STYLES)
    _add(g, "training", "--lr-wsd-decay-style", choices=WSD_DECAY_STYLES,
         help="shape of WSD's final anneal (default exponential)")
    _add(g, "training", "--lr-wsd-decay-iters", type=int,
         help="length of WSD's final anneal, ending at --lr-decay-iters")
    _add(g, "training", "--lr-wsd-decay-samples", type=int, help="with --train-samples")
    _add(g, "training", "--override-opt_param-scheduler", "--override-opt-param-scheduler",
         action=_STORE_TRUE, help="on resume, use these flags' LR/WD schedule, not the "
                                  "checkpoint's")
    _add(g, "training", "--use-checkpoint-opt_param-scheduler",
         "--use-checkpoint-opt-param-scheduler", action=_STORE_TRUE,
         help="on resume, use the checkpoint's LR/WD schedule")
    _add(g, "training", "--lr-warmup-iters", type=int)
    _add(g, "training", "--lr-warmup-fraction", type=float,
         help="warm up over this fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    _add(g, "training", "--lr-decay-iters", type=int)
    _add(g, "training", "--lr-warmup-samples", type=int, help="with --train-samples")
    _add(g, "training", "--lr-decay-samples", type=int,
         help="with --train-samples (default: --train-samples)")
    _add(g, "training", "--decoupled-lr", type=float,
         help="peak learning rate of the word embeddings and output layer (default: --lr)")
    _add(g, "training", "--decoupled-min-lr", type=float,
         help="their final learning rate (default: --min-lr)")
    _add(g, "training", "--weight-decay", type=float)
    _add(g, "training", "--start-weight-decay", type=float)
    _add(g, "training", "--end-weight-decay", type=float)
    _add(g, "training", "--weight-decay-incr-style", choices=WD_INCR_STYLES,
         help="linear or cosine: from --start- to --end-weight-decay over the run")
    _add(g, "training", "--adam-beta1", type=float)
    _add(g, "training", "--adam-beta2", type=float)
    _add(g, "training", "--adam-eps", type=float)
    _add(g, "training", "--clip-grad", type=float)
    _add(g, "training", "--calculate-per-token-loss", action=_STORE_TRUE,
         help="average the loss over the global batch's loss tokens, not over micro-batches "
              "(each the mean over its own tokens): matters when loss masks differ")
    _add(g, "training", "--bf16", action=_STORE_TRUE)
    _add(g, "training", "--fp16", action=_STORE_TRUE)
    _add(g, "training", "--optimizer-cpu-offload", action=_STORE_TRUE,
         help="keep fp32 masters and Adam moments on the CPU and step there (GPU runs)")
    _add(g, "training", "--loss-scale", type=float,
         help="a static loss scale instead of fp16's dynamic one (skipped on overflow, never "
              "changed)")
    _add(g, "training", "--initial-loss-scale", type=float)
    _add(g, "training", "--min-loss-scale", type=float)
    _add(g, "training", "--loss-scale-window", type=int)
    _add(g, "training", "--hysteresis", type=int)
    _add(g, "training", "--seed", type=int)
    _add(g, "training", "--eval-interval", type=int)
    _add(g, "training", "--eval-iters", type=int)
    _add(g, "training", "--exit-interval", type=int,
         help="save (with --save) and exit after an iteration that is a multiple of this")
    _add(g, "training", "--exit-duration-in-mins", type=float,
         help="save (with --save) and exit once training has run this long")
    _add(g, "training", "--exit-signal-handler", action=_STORE_TRUE,
         help="on SIGTERM or SIGUSR1: finish the iteration, save (with --save) and exit 0")
    _add(g, "training", "--check-for-nan-in-loss-and-grad", action=_STORE_TRUE,
         help="stop at the first non-finite loss or gradient, naming iteration and rank")
    _add(g, "training", "--check-for-spiky-loss", action=_STORE_TRUE,
         help="log the batch of any loss above --spiky-loss-factor x the recent mean")
    _add(g, "training", "--spiky-loss-factor", type=float)
    _add(g, "training", "--manual-gc", action=_STORE_TRUE,
         help="disable Python's automatic garbage collection during training (collections "
              "stall ranks at different times); collect every --manual-gc-interval iterations")
    _add(g, "training", "--manual-gc-interval", type=int,
         help="with --manual-gc: collect every this many iterations (0: only around evaluation)")
    _add(g, "training", "--no-manual-gc-eval", action="store_false", field="manual_gc_eval",
         help="with --manual-gc: no collection before and after evaluation")
    _add(g, "training", "--empty-unused-memory-level", type=int, choices=[0, 1, 2],
         help="CUDA: release cached allocator blocks; 1: after each iteration and evaluation, "
              "2: also between backward and the optimizer step")

    g = parser.add_argument_group("data")
    _add(g, "data", "--data-path", nargs="+",
         help="PREFIX of a Megatron .bin/.idx pair, or WEIGHT PREFIX WEIGHT PREFIX ... to blend")
    _add(g, "data", "--train-data-path", nargs="+",
         help="per-split [WEIGHT] PREFIX ... (finetune.py: JSONL conversations)")
    _add(g, "data", "--valid-data-path", nargs="+")
    _add(g, "data", "--test-data-path", nargs="+")
    _add(g, "data", "--data-cache-path", type=str,
         help="where megatron-core caches the document/sample/shuffle indices")
    _add(g, "data", "--mock-data", action=_STORE_TRUE)
    _add(g, "data", "--split", type=str)
    _add(g, "data", "--tokenizer-type", choices=["SentencePieceTokenizer", "HuggingFaceTokenizer",
                                                    "GPT2BPETokenizer", "NullTokenizer"])
    _add(g, "data", "--tokenizer-model", type=str)
    _add(g, "data", "--vocab-file", type=str, help="GPT2BPETokenizer: vocab.json")
    _add(g, "data", "--merge-file", type=str, help="GPT2BPETokenizer: merges.txt")
    _add(g, "data", "--num-workers", type=int)
    _add(g, "data", "--no-mmap-bin-files", action="store_false", field="mmap_bin_files",
         help="read the .bin files through file handles instead of memory-mapping them")
    _add(g, "data", "--reset-position-ids", action=_STORE_TRUE,
         help="positions restart at 0 after each end-of-document token")
    _add(g, "data", "--reset-attention-mask", action=_STORE_TRUE,
         help="tokens attend only within their own document of the sample")
    _add(g, "data", "--eod-mask-loss", action=_STORE_TRUE,
         help="no loss on predicting the token after an end-of-document token")

    g = parser.add_argument_group("checkpointing")
    _add(g, "checkpoint", "--save", type=str)
    _add(g, "checkpoint", "--load", type=str)
    _add(g, "checkpoint", "--save-interval", type=int)
    _add(g, "checkpoint", "--async-save", action=_STORE_TRUE,
         help="write checkpoints in the background while training continues")
    _add(g, "checkpoint", "--no-load-optim", action=_STORE_TRUE,
         help="load weights, scheduler and iteration, but start the optimizer afresh")
    _add(g, "checkpoint", "--no-load-rng", action=_STORE_TRUE)
    _add(g, "checkpoint", "--no-save-optim", action=_STORE_TRUE,
         help="checkpoints without optimizer state (masters, Adam moments, loss scale); "
              "loading one needs --no-load-optim or --finetune")
    _add(g, "checkpoint", "--no-save-rng", action=_STORE_TRUE,
         help="checkpoints without the ranks' RNG states; loading one needs --no-load-rng")
    _add(g, "checkpoint", "--ckpt-keep-latest", type=int, metavar="N",
         help="after each complete save, delete all but the newest N complete checkpoints "
              "(default: keep every one)")
    _add(g, "checkpoint", "--finetune", action=_STORE_TRUE,
         help="load the weights only; iteration and consumed samples start from 0")
    _add(g, "checkpoint", "--use-checkpoint-args", action=_STORE_TRUE,
         help="take the model's architecture (and tokenizer, unless --tokenizer-type is "
              "given) from the --load checkpoint; the command line may add to it")

    g = parser.add_argument_group("logging")
    _add(g, "logging", "--log-interval", type=int)
    _add(g, "logging", "--tensorboard-dir", type=str)
    _add(g, "logging", "--log-params-norm", action=_STORE_TRUE,
         help="add the L2 norm of all parameters to the log line")
    _add(g, "logging", "--log-num-zeros-in-grad", action=_STORE_TRUE,
         help="add the number of gradient elements that are exactly zero to the log line")
    _add(g, "logging", "--log-straggler", action=_STORE_TRUE,
         help="report ranks whose compute time per iteration is above --straggler-factor x "
              "the median")
    _add(g, "logging", "--straggler-factor", type=float)
    _add(g, "logging", "--timing-log-level", type=int, choices=[0, 1, 2],
         help="0: start-up and checkpoint timers; 1: + forward-backward, gradient reduction, "
              "optimizer per iteration; 2: + per micro-batch compute and pipeline communication")
    _add(g, "logging", "--timing-log-option", choices=["max", "minmax", "all"],
         help="report each timer's max over ranks, (min, max), or every rank's time")
    _add(g, "logging", "--no-barrier-with-level-1-timing", action="store_false",
         field="barrier_with_l1_time",
         help="start level-1 timers without a barrier (time includes waiting for other ranks)")
    _add(g, "logging", "--log-timers-to-tensorboard", action=_STORE_TRUE,
         help="write each per-iteration timer's max over ranks to --tensorboard-dir")
    _add(g, "logging", "--wandb-project", type=str,
         help="log to Weights & Biases (offline without credentials or with WANDB_MODE=offline)")
    _add(g, "logging", "--wandb-exp-name", type=str)
    _add(g, "logging", "--wandb-save-dir", type=str, help="default: SAVE/wandb")
    _add(g, "logging", "--wandb-entity", type=str)
    _add(g, "logging", "--profile", action=_STORE_TRUE,
         help="profile iterations --profile-step-start+1 .. --profile-step-end (CUDA: for nsys "
              "--capture-range=cudaProfilerApi)")
    _add(g, "logging", "--use-pytorch-profiler", action=_STORE_TRUE,
         help="with --profile: torch.profiler, trace written to --tensorboard-dir")
    _add(g, "logging", "--profile-step-start", type=int)
    _add(g, "logging", "--profile-step-end", type=int)
    _add(g, "logging", "--profile-ranks", type=int, nargs="+",
         help="global ranks to profile (default 0)")
    megatron_compat.add_flags(parser)
    return parser


def config_from_namespace(namespace: argparse.Namespace) -> Config:
    """The config the flags set; the compatibility flags are left to `megatron_compat.check`."""
    config = Config()
    for dest, value in vars(namespace).items():
        concern, name = dest.split(".", 1)
        if concern != "compat":
            setattr(getattr(config, concern), name, value)
    return config


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None) -> Config:
    """Parse Megatron-LM flags and validate them; exits with code 2 and one line on a mistake."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    if getattr(namespace, "checkpoint.use_checkpoint_args", False):
        # The checkpoint's flags go first so that the command line's own values win.
        try:
            prefix, note = flags_for_use_checkpoint_args(
                getattr(namespace, "checkpoint.load", None),
                getattr(namespace, "checkpoint.save", None),
                with_tokenizer=not hasattr(namespace, "data.tokenizer_type"))
        except ConfigError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        print(f"> {note}", flush=True)
        namespace = parser.parse_args(prefix + list(sys.argv[1:] if argv is None else argv))
    config = config_from_namespace(namespace)
    config.parallel.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        for note in megatron_compat.check({dest: value for dest, value in vars(namespace).items()
                                           if dest.startswith("compat.")}):
            print(f"> {note}", flush=True)
        for warning in config.finalize():
            print(f"WARNING: {warning}", flush=True)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return config
