"""megatron-core's own GPTModel on CPU: writes and reads Megatron-LM torch_dist checkpoints in
the interchange tests, exactly as Megatron-LM's `save_checkpoint`/`load_checkpoint` do
(`dist_checkpointing.save` of the model's sharded state dict plus `args`, `iteration`,
`checkpoint_version` in common.pt; the tracker beside `iter_N/`).

megatron-core assumes CUDA (or Transformer Engine) in places that have nothing to do with the
function computed;
`cpu_patches()` covers them while megatron-core runs and restores torch afterwards:
- RoPE builds its frequencies on `torch.cuda.current_device()` (patched to "cpu");
- the torch_dist writer calls `torch.cuda.synchronize()` before writing (patched to a no-op);
- the default causal mask is made on "cuda", so the forward passes an explicit mask;
- attention forks the CUDA RNG tracker (for dropout, here 0): the fork is a no-op;
- tied embeddings under PP are moved with `.cuda()` before their all-reduce: it stays put;
- MLA takes Transformer Engine for present when megatron-core's TE extension imports (it
  does without TE): it is told it is not.
- the MoE router's GEMM looks up Transformer Engine's by a name bound only when TE imports: it
  is bound to None, which takes torch's.
- DSA's indexer rotates with fast_hadamard_transform, a CUDA extension: the same transform
  as Sylvester's matrix (tests/megatron_core_layers.py, with the layers megatron-core's local
  spec lacks). Its RoPE is patched to Megatron-LM's since megatron-core 0.16, which turns
  other dimensions (the same file).
The torch_dist writer also imports psutil (a test dependency) and writes from forked
processes, which Python refuses to a daemonic process such as a test's pooled rank: `write`
lifts that flag for the length of the save (the writers are joined before it returns).

tests/megatron_core_training.py also trains with megatron-core's DistributedDataParallel and
optimizer (its DistributedOptimizer included), which assume CUDA in two more places, covered by
`optimizer_patches()`: buffers made with `device="cuda"` (made on the CPU instead) and
parameter type checks that expect `torch.cuda.FloatTensor` names (a CPU tensor's type name
is reported with `.cuda.`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

import torch

from tests.megatron_core_layers import (
    MLACoreAttention,
    dsa_core_attention,
    hadamard_by_matrix,
    indexer_rope_as_megatron_lm,
)
from tests.megatron_core_shapes import DSA, MLA_FIELDS, MOE, SHAPES, YARN

TOKENS = torch.tensor([[3, 17, 91, 5, 250, 8, 42, 42, 7, 199, 64, 1, 0, 33, 120, 77]])
LOSS_MASK = torch.ones(1, 15).index_fill_(1, torch.tensor([3]), 0.0)  # of TOKENS[1:]
VOCAB = 250  # padded by Megatron-LM to 256 (--make-vocab-size-divisible-by 128 x TP 2)
PADDED_VOCAB = 256
SEQ = 16


@contextlib.contextmanager
def cuda_calls_on_the_cpu():
    """megatron-core's `.cuda()` moves and its `torch.cuda.current_device()` (RoPE's
    frequencies, fp16's loss scaler loading its scale) stay on the CPU."""
    saved = torch.Tensor.cuda, torch.cuda.current_device
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.current_device = saved


@contextlib.contextmanager
def cpu_patches():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    # MLA believes Transformer Engine present when megatron-core's TE extension imports,
    # which it does without TE, and then asks whether its layers are TE's (None here).
    have_te, multi_latent_attention.HAVE_TE = multi_latent_attention.HAVE_TE, False
    # The router's GEMM asks for Transformer Engine's GEMM by a name bound only when TE imports.
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    # The sliding window's mask is made on "cuda" (--window-size): the same mask on the CPU.
    from megatron.core.fusions import fused_softmax

    window_mask = fused_softmax.get_sliding_window_causal_mask

    def cpu_window_mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, skv - sq - window_size[0]), skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = cpu_window_mask
    # DSA's indexer's Hadamard rotation (fast_hadamard_transform: CUDA, bf16 only)
    from megatron.core.transformer.experimental_attention_variant import dsa

    rotate, rope = dsa.rotate_activation, dsa.DSAIndexer._apply_rope
    dsa.rotate_activation = hadamard_by_matrix
    dsa.DSAIndexer._apply_rope = indexer_rope_as_megatron_lm
    saved = torch.cuda.synchronize, CudaRNGStatesTracker.fork
    torch.cuda.synchronize = lambda *args, **kwargs: None
    CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
    try:
        with cuda_calls_on_the_cpu():
            yield
    finally:
        multi_latent_attention.HAVE_TE = have_te
        fused_softmax.get_sliding_window_causal_mask = window_mask
        dsa.rotate_activation, dsa.DSAIndexer._apply_rope = rotate, rope
        torch.cuda.synchronize, CudaRNGStatesTracker.fork = saved


@contextlib.contextmanager
def optimizer_patches():
    factories = ("tensor", "zeros", "empty", "ones", "full")
    saved = {name: getattr(torch, name) for name in factories}
    saved_type = torch.Tensor.type

    def on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    def cuda_type_name(self, *args, **kwargs):
        name = saved_type(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    for name in factories:
        setattr(torch, name, on_cpu(saved[name]))
    torch.Tensor.type = cuda_type_name
    try:
        with cuda_calls_on_the_cpu():
            yield
    finally:
        for name, factory in saved.items():
            setattr(torch, name, factory)
        torch.Tensor.type = saved_type


def config_fields(shape: dict, tensor_parallel: int, pipeline_parallel: int) -> dict:
    """megatron-core's TransformerConfig fields of a shape that every model here shares: the
    sizes, norm and MLP, the layout, fp32 on the CPU, no dropout."""
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu, squared_relu

    return dict(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        normalization=shape["normalization"],
        layernorm_epsilon=shape["norm_epsilon"],
        gated_linear_unit=shape["swiglu"] or shape.get("quick_geglu", False),
        activation_func=squared_relu
        if shape["squared_relu"]
        else quick_gelu
        if shape.get("quick_geglu")
        else (F.silu if shape["swiglu"] else F.gelu),
        glu_linear_offset=shape.get("glu_linear_offset", 0.0),
        softmax_type=shape.get("softmax_type", "vanilla"),
        activation_func_clamp_value=shape.get("activation_func_clamp_value"),
        add_bias_linear=shape["add_bias_linear"],
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=0.05,
        gradient_accumulation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        pipeline_model_parallel_layout=shape.get("pipeline_model_parallel_layout"),
    )


def build(
    kind: str,
    tensor_parallel: int,
    pipeline_parallel: int,
    seed: int = 0,
    expert_parallel: int = 1,
    virtual_stages: int | None = None,
    vp_stage: int | None = None,
):
    """megatron-core's GPTModel (local layer spec) for this rank of a TP x PP (x EP) layout;
    with `virtual_stages`, its model chunk `vp_stage` (the groups are set up by chunk 0's)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = SHAPES[kind]
    if not vp_stage:
        parallel_state.initialize_model_parallel(
            tensor_parallel,
            pipeline_parallel,
            virtual_pipeline_model_parallel_size=virtual_stages,
            expert_model_parallel_size=expert_parallel,
        )
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank())
    mla = {name: shape[name] for name in MLA_FIELDS if shape.get("multi_latent_attention")}
    mla.update({name: shape[name] for name in DSA if name in shape})
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        TransformerConfig = MLATransformerConfig  # noqa: N806 (megatron-core's class)
        mla["apply_rope_fusion"] = False  # its fused MLA RoPE is a CUDA kernel
        mla["rotary_base"] = shape["rotary_base"]  # Megatron-LM's config takes --rotary-base
    moe = {}
    if shape.get("num_experts"):
        moe = {name: shape[name] for name in MOE if name != "num_experts"}
        moe.update(
            num_moe_experts=shape["num_experts"],
            expert_model_parallel_size=expert_parallel,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
        )
    if shape.get("mtp_num_layers"):
        moe.update(
            mtp_num_layers=shape["mtp_num_layers"],
            mtp_loss_scaling_factor=shape["mtp_loss_scaling_factor"],
        )
    config = TransformerConfig(
        **config_fields(shape, tensor_parallel, pipeline_parallel),
        virtual_pipeline_model_parallel_size=virtual_stages,
        rotary_interleaved=shape["rotary_interleaved"],
        window_size=shape.get("window_size"),
        window_attn_skip_freq=shape.get("window_attn_skip_freq"),
        no_rope_freq=shape.get("no_rope_freq"),
        qk_l2_norm=shape.get("qk_l2_norm", False),
        moe_apply_probs_on_input=shape.get("moe_apply_probs_on_input", False),
        **mla,
        **moe,
    )
    # (a field of Megatron-LM's config since megatron-core 0.16, read by the patched RoPE)
    config.dsa_indexer_rope_interleaved = shape.get("dsa_indexer_rope_interleaved", False)
    if shape["position_embedding_type"] == "yarn":  # as Megatron-LM's arguments set them
        config.yarn_rotary_scaling_factor = shape["rotary_scaling_factor"]
        for name in ("mscale", "mscale_all_dim"):
            setattr(config, f"yarn_{name}", shape[name])
        for name in YARN:
            if name.startswith("yarn_"):
                setattr(config, name, shape[name])
    spec = get_gpt_layer_local_spec(
        normalization=shape["normalization"],
        multi_latent_attention=bool(mla),
        qk_layernorm=shape.get("qk_layernorm", False),
        qk_l2_norm=shape.get("qk_l2_norm", False),
    )
    if mla:
        spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
    if shape.get("experimental_attention_variant") == "dsa":
        spec.submodules.self_attention.submodules.core_attention = dsa_core_attention()
    if shape.get("num_experts"):  # dense and MoE layers as --moe-layer-freq says
        spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=shape["normalization"],
            qk_l2_norm=shape.get("qk_l2_norm", False),
        )
    mtp = None
    if shape.get("mtp_num_layers"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    # Norm weights start at 1 and biases at 0: make them random too, so a mix-up shows.
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=PADDED_VOCAB,  # Megatron-LM passes args.padded_vocab_size
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
        position_embedding_type=shape["position_embedding_type"],
        rotary_base=int(shape["rotary_base"]),
        rotary_percent=shape["rotary_percent"],
        share_embeddings_and_output_weights=not shape["untie_embeddings_and_output_weights"],
        mtp_block_spec=mtp,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # a buffer, zero at first: it chooses experts
                buffer.add_(torch.randn_like(buffer) * 0.1)
    return model


def megatron_args(kind: str, tensor_parallel: int, pipeline_parallel: int) -> argparse.Namespace:
    """The part of Megatron-LM's `args` a checkpoint's readers look at, as pretrain_gpt.py
    would have them for this model."""
    shape = SHAPES[kind]
    from megatron.core.transformer.enums import AttnBackend

    defaults = dict(
        qk_layernorm=False,
        multi_latent_attention=False,
        num_experts=None,
        mtp_num_layers=None,
        window_size=None,
        window_attn_skip_freq=None,
        quick_geglu=False,
        glu_linear_offset=0.0,
        activation_func_clamp_value=None,
        softmax_type="vanilla",
        no_rope_freq=None,
    )
    given = defaults | {k: v for k, v in shape.items() if k != "mixer_conv_own"}
    # (Megatron-LM's args name megatron-core's Llama 4 fields after ModelOpt's flags)
    for name in ("qk_l2_norm", "moe_apply_probs_on_input"):
        given[f"export_{name}"] = given.pop(name, False)
    return argparse.Namespace(
        **given,
        group_query_attention=shape["num_query_groups"] != shape["num_attention_heads"],
        kv_channels=shape["hidden_size"] // shape["num_attention_heads"],
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        add_position_embedding=shape["position_embedding_type"] == "learned_absolute",
        use_rotary_position_embeddings=shape["position_embedding_type"] == "rope",
        add_qkv_bias=False,
        apply_layernorm_1p=False,
        openai_gelu=False,
        attention_dropout=0.0,  # as `build` makes the model
        hidden_dropout=0.0,
        vocab_size=None,
        padded_vocab_size=PADDED_VOCAB,
        make_vocab_size_divisible_by=128,
        tokenizer_type="GPT2BPETokenizer",
        vocab_file="/data/gpt2-vocab.json",
        merge_file="/data/gpt2-merges.txt",
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        world_size=tensor_parallel * pipeline_parallel,
        ckpt_format="torch_dist",
        use_distributed_optimizer=True,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        consumed_train_samples=640,
        consumed_valid_samples=24,
        attention_backend=AttnBackend.auto,
        transformer_impl="local",  # (`build`'s layer spec)
    )


def write(state: dict, root: str, iteration: int, content_metadata: dict | None = None):
    """dist_checkpointing.save into root/iter_N and the tracker, as Megatron-LM does."""
    import multiprocessing

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    process = multiprocessing.current_process()
    daemon = process._config.get("daemon")
    process._config["daemon"] = False
    path = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path, content_metadata=content_metadata)
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    process._config["daemon"] = daemon
    dist.barrier()


def save(
    kind: str,
    root: str,
    iteration: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int = 1,
):
    """One rank's part of a Megatron-LM torch_dist save (run on TP x PP (x DP) gloo ranks)."""
    import torch.distributed as dist

    with cpu_patches():
        model = build(kind, tensor_parallel, pipeline_parallel, expert_parallel=expert_parallel)
        args = megatron_args(kind, tensor_parallel, pipeline_parallel)
        args.world_size, args.expert_model_parallel_size = dist.get_world_size(), expert_parallel
        state = {
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model.sharded_state_dict(),
            "opt_param_scheduler": {"num_steps": 640, "max_lr": 3e-4},
            "num_floating_point_operations_so_far": 1.0e12,
        }
        write(state, root, iteration)


def save_both(
    kind: str,
    root: str,
    legacy_root: str,
    iteration: int,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int = 1,
    virtual_stages: int | None = None,
):
    """One rank's part of Megatron-LM saving the same model twice: as torch_dist under `root`
    and in its legacy `--ckpt-format torch` under `legacy_root`, as its `save_checkpoint` does
    for a `CheckpointType.LEGACY` save (`generate_state_dict` with each model chunk's
    `state_dict_for_save_checkpoint()`, `model0`, `model1`, ... under virtual stages; one
    `torch.save` per model-parallel rank, by its expert-data-parallel rank 0, into
    `get_checkpoint_name`'s mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt). A hybrid `kind`:
    megatron-core's MambaModel (tests/megatron_core_hybrid.py)."""
    import random

    import numpy
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests import megatron_core_hybrid as mh

    with mh.hybrid_patches():  # (the CPU's, and a hybrid's Mamba mixers)
        stages = range(virtual_stages or 1)
        if "hybrid_layer_pattern" in SHAPES[kind]:
            chunks = [mh.build(kind, tensor_parallel, 0, pipeline_parallel, expert_parallel)]
        else:
            chunks = [
                build(
                    kind,
                    tensor_parallel,
                    pipeline_parallel,
                    expert_parallel=expert_parallel,
                    virtual_stages=virtual_stages,
                    vp_stage=stage if virtual_stages else None,
                )
                for stage in stages
            ]
        args = megatron_args(kind, tensor_parallel, pipeline_parallel)
        args.world_size, args.expert_model_parallel_size = dist.get_world_size(), expert_parallel
        args.virtual_pipeline_model_parallel_size = virtual_stages
        names = [f"model{stage}" for stage in stages] if virtual_stages else ["model"]
        common = {
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "opt_param_scheduler": {"num_steps": 640, "max_lr": 3e-4},
            "num_floating_point_operations_so_far": 1.0e12,
        }
        # (a stage of multi-token prediction ties its embedding copy over DP x CP)
        metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        models = {
            name: chunk.sharded_state_dict(metadata=metadata) for name, chunk in zip(names, chunks)
        }
        write({"args": args, **common, **models}, root, iteration)
        legacy = argparse.Namespace(**(vars(args) | {"ckpt_format": "torch"}))
        state = {
            "args": legacy,
            **common,
            **{name: chunk.state_dict_for_save_checkpoint() for name, chunk in zip(names, chunks)},
            # (a distributed optimizer's state_dict: its groups; its buffers in distrib_optim.pt)
            "optimizer": {"optimizer": {"param_groups": [{"lr": 3e-4, "step": iteration}]}},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": numpy.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                }
            ],
        }
        directory = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        if pipeline_parallel > 1:
            directory += f"_{ps.get_pipeline_model_parallel_rank():03d}"
        if expert_parallel > 1:
            directory += f"_{ps.get_expert_model_parallel_rank():03d}"
        path = os.path.join(legacy_root, f"iter_{iteration:07d}", directory)
        if ps.get_expert_data_parallel_rank() == 0:
            os.makedirs(path, exist_ok=True)
            torch.save(state, os.path.join(path, "model_optim_rng.pt"))
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(legacy_root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))


def logits(kind: str, path: str) -> torch.Tensor:
    """megatron-core's logits of TOKENS from the checkpoint directory `path` (an iter_N), read
    by dist_checkpointing.load into a one-rank GPTModel."""
    from megatron.core import dist_checkpointing

    with cpu_patches():
        model = build(kind, 1, 1, seed=123)  # other weights: the load must replace them all
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(state["model"])
        model.eval()
        positions = torch.arange(TOKENS.shape[1])[None]
        mask = torch.triu(torch.ones(TOKENS.shape[1], TOKENS.shape[1]), 1).bool()[None, None]
        with torch.no_grad():
            return model(TOKENS, positions, mask)


# Two documents in TOKENS[:-1]: positions restart and attention stops at the eighth token
# (--reset-position-ids, --reset-attention-mask).
DOCUMENT_POSITIONS = torch.cat([torch.arange(7), torch.arange(8)])[None]


def document_mask() -> torch.Tensor:
    """[1, 1, s, s], True where attention may go: causal within each document."""
    document = (DOCUMENT_POSITIONS == 0).cumsum(-1)[0]
    same = document[:, None] == document[None, :]
    return (same & torch.ones(len(document), len(document)).tril().bool())[None, None]


def gradients(
    kind: str, path: str, documents: bool = False
) -> tuple[float, dict[str, torch.Tensor]]:
    """megatron-core's training-mode loss of TOKENS (the mean over LOSS_MASK) and its
    gradients by parameter name, from the checkpoint `path`; a multi-token prediction
    model's depths add their losses' gradients (MTPLossAutoScaler at scale 1). `documents`:
    DOCUMENT_POSITIONS and document_mask()."""
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    with cpu_patches():
        model = build(kind, 1, 1, seed=123)
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(state["model"])
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        length = SEQ - 1
        positions = torch.arange(length)[None]
        mask = torch.triu(torch.ones(length, length), 1).bool()[None, None]
        if documents:  # (megatron-core's mask: True where attention may not go)
            positions, mask = DOCUMENT_POSITIONS, ~document_mask()
        tokens, labels = TOKENS[:, :-1], TOKENS[:, 1:]
        per_token = model(tokens, positions, mask, labels=labels, loss_mask=LOSS_MASK)
        loss = (per_token * LOSS_MASK).sum() / LOSS_MASK.sum()
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
