"""megatron-core's own GPTModel on CPU: writes and reads Megatron-LM torch_dist checkpoints in
the interchange tests, exactly as Megatron-LM's `save_checkpoint`/`load_checkpoint` do
(`dist_checkpointing.save` of the model's sharded state dict plus `args`, `iteration`,
`checkpoint_version` in common.pt; the tracker beside `iter_N/`).

megatron-core assumes CUDA in three places that have nothing to do with the function computed;
`cpu_patches()` covers them while megatron-core runs and restores torch afterwards:
- RoPE builds its frequencies on `torch.cuda.current_device()` (patched to "cpu");
- the torch_dist writer calls `torch.cuda.synchronize()` before writing (patched to a no-op);
- the default causal mask is made on "cuda", so the forward passes an explicit mask;
- attention forks the CUDA RNG tracker (for dropout, here 0): the fork is a no-op;
- tied embeddings under PP are moved with `.cuda()` before their all-reduce: it stays put.
The torch_dist writer also imports psutil (a test dependency) and writes from forked
processes, which Python refuses to a daemonic process such as a test's pooled rank: `save`
lifts that flag for the length of the save (the writers are joined before it returns).
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch

TOKENS = torch.tensor([[3, 17, 91, 5, 250, 8, 42, 42, 7, 199, 64, 1, 0, 33, 120, 77]])
SHAPES = {
    "llama": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        rotary_base=500000.0,
        norm_epsilon=1e-5,
    ),
    "gpt2": dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=256,
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False,
        rotary_base=10000.0,
        norm_epsilon=1e-5,
    ),
}
VOCAB = 250  # padded by Megatron-LM to 256 (--make-vocab-size-divisible-by 128 x TP 2)
PADDED_VOCAB = 256
SEQ = 16


@contextlib.contextmanager
def cpu_patches():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    saved = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        CudaRNGStatesTracker.fork,
        torch.Tensor.cuda,
    )
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.synchronize = lambda *args, **kwargs: None
    CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        (
            torch.cuda.current_device,
            torch.cuda.synchronize,
            CudaRNGStatesTracker.fork,
            torch.Tensor.cuda,
        ) = saved


def build(kind: str, tensor_parallel: int, pipeline_parallel: int, seed: int = 0):
    """megatron-core's GPTModel (local layer spec) for this rank of a TP x PP layout."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = SHAPES[kind]
    parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel)
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank())
    config = TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        normalization=shape["normalization"],
        layernorm_epsilon=shape["norm_epsilon"],
        gated_linear_unit=shape["swiglu"],
        activation_func=F.silu if shape["swiglu"] else F.gelu,
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
    )
    # Norm weights start at 1 and biases at 0: make them random too, so a mix-up shows.
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=shape["normalization"]),
        vocab_size=PADDED_VOCAB,  # Megatron-LM passes args.padded_vocab_size
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type=shape["position_embedding_type"],
        rotary_base=int(shape["rotary_base"]),
        share_embeddings_and_output_weights=not shape["untie_embeddings_and_output_weights"],
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def megatron_args(kind: str, tensor_parallel: int, pipeline_parallel: int) -> argparse.Namespace:
    """The part of Megatron-LM's `args` a checkpoint's readers look at, as pretrain_gpt.py
    would have them for this model."""
    shape = SHAPES[kind]
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        **shape,
        group_query_attention=shape["num_query_groups"] != shape["num_attention_heads"],
        kv_channels=shape["hidden_size"] // shape["num_attention_heads"],
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        add_position_embedding=shape["position_embedding_type"] == "learned_absolute",
        use_rotary_position_embeddings=shape["position_embedding_type"] == "rope",
        rotary_percent=1.0,
        rotary_interleaved=False,
        add_qkv_bias=False,
        apply_layernorm_1p=False,
        squared_relu=False,
        openai_gelu=False,
        qk_layernorm=False,
        num_experts=None,
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
        attention_backend=AttnBackend.auto,
    )


def save(kind: str, root: str, iteration: int, tensor_parallel: int, pipeline_parallel: int):
    """One rank's part of a Megatron-LM torch_dist save (run on TP x PP gloo ranks)."""
    import multiprocessing

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    process = multiprocessing.current_process()
    daemon = process._config.get("daemon")
    process._config["daemon"] = False
    with cpu_patches():
        model = build(kind, tensor_parallel, pipeline_parallel)
        state = {
            "args": megatron_args(kind, tensor_parallel, pipeline_parallel),
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model.sharded_state_dict(),
            "opt_param_scheduler": {"num_steps": 640, "max_lr": 3e-4},
            "num_floating_point_operations_so_far": 1.0e12,
        }
        path = os.path.join(root, f"iter_{iteration:07d}")
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, path)
        if dist.get_rank() == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
    process._config["daemon"] = daemon
    dist.barrier()


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
