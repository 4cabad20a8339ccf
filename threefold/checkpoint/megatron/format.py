"""Megatron-LM's torch_dist checkpoint directory, described (its common state read without torch).

    DIR/latest_checkpointed_iteration.txt   the tracker (the same file threefold writes)
    DIR/iter_0000100/metadata.json          {"sharded_backend": "torch_dist", ...}: megatron-core's
    DIR/iter_0000100/common.pt              args, iteration, checkpoint_version, LR scheduler,
                                            the optimizer's step and layout (megatron-core
                                            0.19 and later: in the shards, `common_state`)
    DIR/iter_0000100/.metadata, *.distcp    torch.distributed.checkpoint: the sharded tensors

This module tells such a directory from threefold's own, and translates between Megatron-LM's
`args` and threefold's config: what a Megatron checkpoint's model is (for `--load`,
`--use-checkpoint-args`, the tools), and the args an exported checkpoint carries so that
Megatron-LM's `--use-checkpoint-args` and its load checks find what they look for.
"""

from __future__ import annotations

import dataclasses
import json
import os

from threefold.checkpoint.megatron.common_file import read_common
from threefold.checkpoint.megatron.optimizer import MegatronOptimizer, megatron_optimizer
from threefold.config import Config, ConfigError, DataConfig, ModelConfig, ParallelConfig
from threefold.config.dsa import DSA
from threefold.config.fields import ARCHITECTURE, MODEL, checkpoint_fields, given_flags
from threefold.config.linear_attention import GATED_DELTA_NET
from threefold.config.longrope import FIELDS as LONGROPE_FIELDS

BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
CHECKPOINT_VERSION = 3.0
# Megatron-LM tokenizers threefold builds the same way from the same files.
_TOKENIZERS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "SFTTokenizer": ("tokenizer_model", "sft_tokenizer_prompt_format"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "NullTokenizer": (),
}
# Megatron-LM's args since its flags are megatron-core's config fields (2025): --norm-epsilon and
# --apply-layernorm-1p keep those fields' names (older args: norm_epsilon, apply_layernorm_1p)
MEGATRON_CORE_NAMES = {
    "layernorm_epsilon": "norm_epsilon",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
}
# args that select an architecture threefold does not build: (arg, the value it must have, what)
_UNSUPPORTED = (
    ("heterogeneous_layers_config_path", None, "heterogeneous layers"),
    # (read as the plain model they are not, these would load without an error)
    (
        "apply_residual_connection_post_layernorm",
        False,
        "residual connections taken after the norms",
    ),
)


def _hybrid_pattern(args: dict) -> str | None:
    """A hybrid model's --hybrid-layer-pattern from Megatron-LM's args, by either name."""
    return args.get("hybrid_layer_pattern") or args.get("hybrid_override_pattern")


def arg_size(args: dict, name: str, default: int = 1) -> int:
    """A parallel size of Megatron-LM's args (`default` where it is unset or None)."""
    value = args.get(name)
    return value if isinstance(value, int) and value > 0 else default


def saved_parallel(args: dict) -> ParallelConfig:
    """The TP size and pipeline layout of the run that saved, from its args."""
    vpp = args.get("virtual_pipeline_model_parallel_size")
    return ParallelConfig(
        tensor_model_parallel_size=arg_size(args, "tensor_model_parallel_size"),
        pipeline_model_parallel_size=arg_size(args, "pipeline_model_parallel_size"),
        virtual_pipeline_model_parallel_size=vpp if isinstance(vpp, int) else None,
        decoder_first_pipeline_num_layers=args.get("decoder_first_pipeline_num_layers"),
        decoder_last_pipeline_num_layers=args.get("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=bool(
            args.get("account_for_embedding_in_pipeline_split")
        ),
        account_for_loss_in_pipeline_split=bool(args.get("account_for_loss_in_pipeline_split")),
    )


def saved_layers(args: dict) -> tuple[ParallelConfig, ModelConfig]:
    """The saving run's layout and its model's layers, what `chunk_layers_of` places each
    stage's layers by: a hybrid's stages are its pattern's segments where `|` cuts it (as
    Megatron-LM cuts them), else split as a GPT model's (megatron-core 0.16's MambaStack)."""
    parallel = saved_parallel(args)
    pattern = _hybrid_pattern(args)
    if not pattern:
        return parallel, ModelConfig(num_layers=arg_size(args, "num_layers"))
    model = ModelConfig(hybrid_layer_pattern=pattern, mtp_num_layers=args.get("mtp_num_layers"))
    model.num_layers = len(model.hybrid_layers())
    layout = model.hybrid_pipeline_layout(parallel.pipeline_model_parallel_size)
    return dataclasses.replace(parallel, pipeline_model_parallel_layout=layout), model


def saved_chunks(args: dict) -> list[tuple[int, int, bool]]:
    """The saving run's model chunks in the order its layers run (chunk g is virtual stage
    g // PP of pipeline rank g % PP): each one's first layer, its number of layers and whether
    it holds the multi-token prediction depths. From --pipeline-model-parallel-layout (a
    hybrid's: its pattern's `|` segments), whose depths may sit on a stage of their own before
    the loss, as DeepSeek-V3's "Et*3|(tt|)*29,m|L" puts them; else as megatron-core splits
    the layers, the depths on the last stage."""
    from threefold.config.pipeline_layout import parse_layout
    from threefold.parallel.pipeline_parallel.layout import chunk_layers_of

    parallel, model = saved_layers(args)
    layout = args.get("pipeline_model_parallel_layout") or parallel.pipeline_model_parallel_layout
    if layout:
        letters = parse_layout(layout)
        counts, depths = [chunk.count("t") for chunk in letters], ["m" in c for c in letters]
    else:
        pp = parallel.pipeline_model_parallel_size
        per_rank = [chunk_layers_of(parallel, model, rank) for rank in range(pp)]
        counts = [per_rank[g % pp][g // pp][1] for g in range(sum(map(len, per_rank)))]
        depths = [False] * (len(counts) - 1) + [bool(args.get("mtp_num_layers"))]
    return [(sum(counts[:g]), count, depths[g]) for g, count in enumerate(counts)]


def is_megatron_checkpoint(path: str) -> bool:
    """Whether `path` (an iter_N directory) was written by megatron-core's dist_checkpointing."""
    try:
        with open(os.path.join(path, "metadata.json")) as f:
            return "sharded_backend" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


def _model_config(args: dict, source: str) -> dict:
    variant = args.get("experimental_attention_variant")
    if variant not in (None, *GATED_DELTA_NET, DSA):
        raise ConfigError(
            f"{source}: a Megatron-LM checkpoint of a model with --experimental-attention-variant "
            f"{variant}; threefold builds gated_delta_net and dsa only"
        )
    ratios = [name for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio") if args.get(name)]
    if ratios and not _hybrid_pattern(args):
        raise ConfigError(
            f"{source}: a Megatron-LM checkpoint of a hybrid model whose layers its "
            f"{' and '.join(ratios)} placed; threefold places a hybrid's layers by "
            "--hybrid-layer-pattern only"
        )
    for name, allowed, what in _UNSUPPORTED:
        value = args.get(name)
        if value is None or value == allowed or (allowed is None and not value):
            continue
        raise ConfigError(
            f"{source}: a Megatron-LM checkpoint of a model with {what} "
            f"({name} = {args[name]!r}); threefold does not build that architecture"
        )
    if args.get("position_embedding_type") not in (
        None,
        "learned_absolute",
        "rope",
        "yarn",
        "none",
    ):
        raise ConfigError(
            f"{source}: a Megatron-LM checkpoint with --position-embedding-type "
            f"{args['position_embedding_type']}; threefold builds learned_absolute, rope, yarn "
            "and none"
        )
    fields = {f.name for f in checkpoint_fields(ModelConfig, ARCHITECTURE, MODEL)}
    model = {name: args[name] for name in fields if args.get(name) is not None}
    if "position_embedding_type" not in args and args.get("use_rotary_position_embeddings"):
        model["position_embedding_type"] = "rope"  # (args before that flag, mid-2023)
    for theirs, ours in MEGATRON_CORE_NAMES.items():
        if args.get(theirs) is not None:  # newer Megatron-LM's args name them so
            model[ours] = args[theirs]
    if not args.get("group_query_attention"):
        # Megatron-LM's model has a key/value head per query head then, whatever its
        # --num-query-groups (default 1) says; its FLOPs count sets it to the head count, so
        # only a run saved before its first iteration (a conversion) still holds the 1.
        model["num_query_groups"] = model.get("num_attention_heads")
    if _hybrid_pattern(args):  # (older Megatron-LM's args name it --hybrid-override-pattern)
        model["hybrid_layer_pattern"] = _hybrid_pattern(args)
        if args.get("mtp_hybrid_override_pattern"):  # a depth's, repeated --mtp-num-layers
            model["mtp_hybrid_override_pattern"] = args["mtp_hybrid_override_pattern"]
    for name in ("export_qk_l2_norm", "export_moe_apply_probs_on_input"):
        if args.get(name):  # Megatron-LM's flags of megatron-core's Llama 4 fields
            model[name.removeprefix("export_")] = True
    if model.get("qk_l2_norm"):  # megatron-core then normalizes by the L2 norm alone
        model["qk_layernorm"] = False
    for name in (
        "moe_layer_freq",
        "linear_attention_freq",
        "window_attn_skip_freq",
        "no_rope_freq",
    ):
        if name in model:  # Megatron-LM's args hold the parsed N or [0, 1, ...]
            model[name] = str(model[name]).replace(" ", "")
    if isinstance(model.get("window_size"), (tuple, list)):  # its args hold (L, R)
        model["window_size"] = ",".join(map(str, model["window_size"]))
    balancing = model.get("moe_router_load_balancing_type")
    if isinstance(balancing, list) and len(balancing) == 1:  # megatron-core's list form
        (model["moe_router_load_balancing_type"],) = balancing
    if "max_position_embeddings" in args:
        model["max_position_embeddings"] = args["max_position_embeddings"]
    for name, value in model.items():
        if not isinstance(value, (int, float, str, list)):
            raise ConfigError(
                f"{source}: common.pt's args.{name} is {value!r}, not a plain value; "
                "the checkpoint is damaged or was not written by Megatron-LM"
            )
    # The embedding's rows as saved: Megatron-LM pads the tokenizer's vocabulary (and keeps
    # only the padded size in args); every row is kept, so the logits are Megatron's.
    model["vocab_size"] = args.get("padded_vocab_size") or args.get("vocab_size")
    model["make_vocab_size_divisible_by"] = args.get("make_vocab_size_divisible_by", 128)
    for name in ("attention_dropout", "hidden_dropout", "init_method_std"):
        if args.get(name) is not None:
            model[name] = args[name]
    return model


def _data_config(args: dict) -> dict:
    kind = args.get("tokenizer_type")
    if kind not in _TOKENIZERS:
        return {}
    data = {"tokenizer_type": kind}
    data.update({name: args[name] for name in _TOKENIZERS[kind] if args.get(name)})
    return data


def described_model(args: dict, own: object, source: str) -> ModelConfig:
    """The model Megatron-LM's `args` describe (`own`: common.pt's `threefold` entry, of a
    checkpoint threefold wrote), as a --load of it builds and compares it with the run's."""
    model = _model_config(args, source)
    if isinstance(own, dict) and isinstance(own.get("vocab_size"), int):
        model["vocab_size"] = own["vocab_size"]  # exported by threefold: its unpadded size
    model_config = ModelConfig(**model)
    try:  # a hybrid's layers and depths as Megatron-LM's validate_args takes them from its pattern
        model_config.finalize_hybrid()
    except ConfigError as error:
        raise ConfigError(f"{source}: the checkpoint's {error}") from None
    return model_config


def megatron_metadata(path: str) -> dict:
    """A Megatron-LM checkpoint's `iter_N` directory described as threefold's metadata.json
    describes its own: the config (model from args; tokenizer where threefold has Megatron's;
    the saved layout), the iteration, consumed samples and LR schedule position, and whether
    its optimizer state is one threefold reads (checkpoint/megatron/optimizer.py; the layout
    under `megatron.optimizer`). Megatron's RNG states are not read; the streams a run here
    saved beside them (checkpoint/megatron/training_save.py) are, in the ranks' layout it
    names (`rng_layout`)."""
    if os.path.isdir(os.path.join(path, "modelopt_state")):
        # Megatron-LM builds such a model with ModelOpt's builder (its quantizers, and
        # --enable-gpt-oss's YaRN, which its args do not record): not the model its args say.
        raise ConfigError(
            f"--load {path}: a ModelOpt checkpoint (modelopt_state/), which Megatron-LM builds "
            "with ModelOpt's model builder; threefold has none: load the checkpoint it was made "
            "from, or export it from ModelOpt to Hugging Face and convert that"
        )
    common = read_common(path)
    args = saved_args(common, f"--load {path}: its common state")
    # (torch, only here: describing threefold's own checkpoints stays torch-free)
    from threefold.checkpoint.megatron.buckets import dp_reshardable_optimizer, has_buckets
    from threefold.safe_loading import SafeFileSystemReader

    reader = SafeFileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    sizes = {k: tuple(v.size) for k, v in stored.items() if hasattr(v, "size")}
    optimizer = megatron_optimizer(common, sizes)
    if optimizer.layout == "dp_reshardable" and has_buckets(sizes):
        optimizer = dp_reshardable_optimizer(reader, stored.keys(), sizes, args)
    return described(path, common, optimizer)


def saved_args(common: dict, source: str) -> dict:
    """The Megatron-LM args a checkpoint's common state holds (a one-line refusal without)."""
    args = common.get("args")
    if not isinstance(args, dict):
        raise ConfigError(
            f"{source} has no Megatron-LM args; only checkpoints written by Megatron-LM's "
            "training loop (or tools/convert_checkpoint.py --saver megatron) describe their "
            "model"
        )
    return args


def described(path: str, common: dict, optimizer: MegatronOptimizer) -> dict:
    """The metadata of a Megatron-LM checkpoint (`megatron_metadata`) from its common state
    (common.pt's dict; a legacy checkpoint's model_optim_rng.pt without the model) and what it
    holds of the optimizer."""
    args = saved_args(common, f"--load {path}")
    parallel = {
        name: args[name]
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "world_size",
            "use_distributed_optimizer",
        )
        if isinstance(args.get(name), (int, bool))
    }
    own = common.get("threefold")
    config = Config(
        model=described_model(args, own, f"--load {path}"),
        data=DataConfig(**_data_config(args)),
        parallel=ParallelConfig(**parallel),
    )
    iteration = int(common.get("iteration", 0) or 0)
    scheduler = common.get("opt_param_scheduler")
    train_state = {
        "iteration": iteration,
        "consumed_train_samples": int(args.get("consumed_train_samples") or 0),
    }
    # Where Megatron-LM's checkpoint says 0, Megatron-LM counts them from the iteration, as
    # threefold's loader does for a train state without them.
    if args.get("consumed_valid_samples"):
        train_state["consumed_valid_samples"] = int(args["consumed_valid_samples"])
    return {
        "iteration": iteration,
        "megatron": {
            "checkpoint_version": common.get("checkpoint_version"),
            "optimizer": optimizer.layout,
            "optimizer_step": optimizer.step,
            "optimizer_reason": optimizer.reason,
            # (its --vocab-size as given, where Megatron-LM wrote it: a NullTokenizer's ids
            # before its end-of-document one; the model's rows are the padded count)
            "vocab_size": args.get("vocab_size") if own is None else None,
        },
        "optimizer_saved": optimizer.readable,
        # (a run here saves its ranks' streams beside Megatron-LM's layout, and says so)
        "rng_saved": bool(own.get("rng_saved")) if isinstance(own, dict) else False,
        "rng_layout": own.get("rng_layout") if isinstance(own, dict) else None,
        "train_state": train_state,
        # (in samples, those of the iterations that updated; none without the optimizer)
        "scheduler": {"num_steps": int(scheduler["num_steps"])}
        if isinstance(scheduler, dict) and "num_steps" in scheduler
        else {},
        "loss_scaler": optimizer.loss_scaler or {},
        "config": dataclasses.asdict(config),
    }


# The model options threefold has from transformers that Megatron-LM's args cannot hold.
BEYOND_MEGATRON = (
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "qk_l2_norm_rope_layers_only",
    "attention_chunk_size",
    "attn_temperature_tuning",
    "embedding_multiplier",
    "post_sublayer_norm",
    "geglu",
    "softmax_scale",
    "window_rotary_base",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "parallel_attention_mlp",
    "sublayer_input_norms",
    "qk_layernorm_across_heads",
    "parallel_attention_mlp_shared_norm",
    "layernorm_bias",
    "logit_scale",
    "residual_multiplier",
    "output_layer_bias",
    "qk_layernorm_per_head",
    "add_mlp_bias",
    *LONGROPE_FIELDS,
)


def moe_layer_freq(model: ModelConfig) -> int | list[int]:
    """--moe-layer-freq as Megatron-LM's args hold it: N, or one 0/1 per layer. megatron-core
    keeps the layers of a checkpoint per layer, not stacked, for anything but 1."""
    if model.moe_layer_freq.isdigit():
        return int(model.moe_layer_freq)
    return model.moe_layer_pattern(model.num_layers)


def linear_attention_freq(model: ModelConfig) -> int | list[int] | None:
    """--linear-attention-freq as Megatron-LM's args hold it (None without gated delta nets).
    megatron-core keeps the layers of a checkpoint per layer for a list, or N other than 1.
    (A hybrid's pattern marks its gated delta nets: None.)"""
    if not model.gated_delta_net or model.hybrid:
        return None
    if model.linear_attention_freq.strip().isdigit():
        return int(model.linear_attention_freq)
    return model.linear_attention_pattern(model.num_layers)


def window_args(model: ModelConfig) -> dict:
    """--window-size and --window-attn-skip-freq as Megatron-LM's args hold them: (L, R), and
    N or one 0/1 per layer."""
    if model.window_size is None:
        return {"window_size": None, "window_attn_skip_freq": None}
    freq = model.window_attn_skip_freq
    if freq is not None:
        freq = int(freq) if freq.strip().isdigit() else model.window_pattern(model.num_layers)
    window = tuple(int(part) for part in model.window_size.split(","))
    return {"window_size": window, "window_attn_skip_freq": freq}


def no_rope_freq(model: ModelConfig) -> int | list[int] | None:
    """--no-rope-freq as Megatron-LM's args hold it: N, or one 0/1 per layer."""
    freq = model.no_rope_freq
    if freq is None:
        return None
    return int(freq) if freq.isdigit() else model.no_rope_pattern(model.num_layers)


def megatron_args(config: Config, iteration: int, train_state: dict | None = None) -> dict:
    """Megatron-LM's args (as a dict) for a checkpoint of this model at TP = PP = 1: every
    field Megatron-LM's `load_args_from_checkpoint` and its load-time checks read.
    `train_state` (threefold's) gives the samples read so far, which Megatron-LM's data
    loaders skip on resuming; without it, 0, which Megatron-LM counts again from the iteration
    at a constant batch size."""
    train_state = train_state or {}
    model = config.model
    beyond = given_flags(model, ModelConfig, BEYOND_MEGATRON)
    if beyond:
        raise ConfigError(
            f"Megatron-LM builds no {' '.join(beyond)} (options of transformers' models), and "
            "would load this model as another: export it with --saver hf"
        )
    heads = model.num_attention_heads
    args = {
        f.name: getattr(model, f.name) for f in checkpoint_fields(ModelConfig, ARCHITECTURE, MODEL)
    }
    args.update(
        group_query_attention=(model.num_query_groups or heads) != heads,
        num_query_groups=model.num_query_groups or heads,
        kv_channels=model.kv_channels or model.hidden_size // heads,
        ffn_hidden_size=model.ffn_hidden_size,
        # (the --no-position-embedding flag as the run had it: Megatron-LM's --load compares it)
        add_position_embedding=model.add_position_embedding,
        use_rotary_position_embeddings=model.position_embedding_type == "rope",
        apply_query_key_layer_scaling=False,
        **{theirs: getattr(model, ours) for theirs, ours in MEGATRON_CORE_NAMES.items()},
        moe_layer_freq=moe_layer_freq(model),
        linear_attention_freq=linear_attention_freq(model),
        **window_args(model),
        no_rope_freq=no_rope_freq(model),
        export_qk_l2_norm=model.qk_l2_norm,
        export_moe_apply_probs_on_input=model.moe_apply_probs_on_input,
        vocab_size=model.vocab_size,
        padded_vocab_size=model.padded_vocab_size(1),
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        attention_dropout=model.attention_dropout,
        hidden_dropout=model.hidden_dropout,
        init_method_std=model.init_method_std,
        tokenizer_type=config.data.tokenizer_type,
        tokenizer_model=config.data.tokenizer_model,
        vocab_file=config.data.vocab_file,
        merge_file=config.data.merge_file,
        sft_tokenizer_prompt_format=config.data.sft_tokenizer_prompt_format,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        world_size=1,
        data_parallel_size=1,
        ckpt_format="torch_dist",
        use_distributed_optimizer=False,
        transformer_impl="local",
        spec=None,
        iteration=iteration,
        consumed_train_samples=int(train_state.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(train_state.get("consumed_valid_samples", 0)),
        bf16=config.training.bf16,
        fp16=config.training.fp16,
        # (its weights saved dequantized from FP8: not its fp32 masters rounded)
        fp8_param_gather=config.fp8.fp8_param_gather,
    )
    return args
