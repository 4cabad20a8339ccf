"""The other frameworks' training steps for bench/gpu_mfu.py, at its `Shape`: transformers
(eager and compiled), megatron-core's GPTModel, torchtitan's Llama 3. Each builder returns a
`step()` that trains one iteration and returns its loss; the recipes are gpu_mfu.py's
docstring's.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_mfu import Shape


def hf_llama_config(shape: Shape):
    """The same model as a `transformers` LlamaConfig (SDPA attention, untied), or under --moe
    a MixtralConfig."""
    import transformers

    common = dict(
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups,
        num_hidden_layers=shape.num_layers,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.seq_length,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if shape.num_experts:
        return transformers.MixtralConfig(
            intermediate_size=shape.moe_ffn_hidden_size,
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.moe_router_topk,
            sliding_window=None,
            **common,
        )
    return transformers.LlamaConfig(intermediate_size=shape.ffn_hidden_size, **common)


def _micro_batches(shape: Shape, device):
    """One step's micro-batches of random tokens, the same every step."""
    import torch

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, shape.vocab_size, (shape.global_batch_size, shape.seq_length), generator=generator
    ).to(device)
    return tokens.split(shape.micro_batch_size)


def transformers_step(shape: Shape, device, bf16: bool, compiled: bool = False):
    import torch
    import transformers

    config = hf_llama_config(shape)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model
    batches = _micro_batches(shape, device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = forward(tokens, labels=tokens).loss / len(batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(total)

    return step


def megatron_core_step(shape: Shape, device, bf16: bool):
    if device.type != "cuda":  # said before megatron-core's 2.5 s import
        raise RuntimeError(
            "megatron-core's GPTModel needs CUDA (its RoPE calls torch.cuda.current_device())"
        )
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.seq_length,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).to(device)
    model = DistributedDataParallel(
        config=config,
        module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=bf16, clip_grad=1.0), [model]
    )
    # Micro-batch 1, same global batch: the local spec's attention is unfused and keeps the
    # s x s scores of every layer for backward, which at micro-batch 2 and s = 4096 does not
    # fit in 80 GB.
    batches = _micro_batches(dataclasses.replace(shape, micro_batch_size=1), device)
    positions = torch.arange(shape.seq_length, device=device).expand_as(batches[0])

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        total = 0.0
        for tokens in batches:  # grads accumulate in the buffer; one sync at the end
            loss = model(tokens, positions, None, labels=tokens).float().mean() / len(batches)
            loss.backward()
            total += loss.detach()
        model.finish_grad_sync()
        optimizer.step()
        return float(total)

    return step


def torchtitan_step(shape: Shape, device, bf16: bool, compiled: bool = False, float8=None):
    """torchtitan 0.2.2's Llama 3 recipe on one GPU without its data pipeline, as its Trainer
    runs it there: its model (SDPA causal attention, the default `llama3` flavour),
    `parallelize_llama` on a one-rank `ParallelDims` (no FSDP on one GPU: fp32 weights under
    bf16 autocast, its `maybe_enable_amp`; per-block torch.compile when `compiled`), its
    sum-reduced cross-entropy (compiled too, as its `--compile.components` default), gradient
    accumulation over micro-batches, fused AdamW and clipping at 1.0. (0.2.2 is the newest
    release that imports under torch 2.11; 0.3 needs newer FSDP2 names.) Its Trainer itself
    wants a tokenizer and a dataset on disk, which this benchmark has not. `float8`: its
    float8 converter (torchao's Float8Linear) with that recipe ("tensorwise", "rowwise"), as
    `--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name ...`,
    its output layer left in bf16 (`filter_fqns output`) as threefold leaves its own."""
    import importlib.util

    import torch
    import torch.distributed as dist

    if importlib.util.find_spec("torchtitan") is None:
        raise RuntimeError(
            "torchtitan is not installed (carry torchtitan 0.2.2 and its "
            "dependencies as wheels: bench/gpu_wheels.sh)"
        )
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import maybe_enable_amp
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    job = JobConfig()
    job.training.seq_len = shape.seq_length
    job.training.local_batch_size = shape.micro_batch_size
    job.training.mixed_precision_param = "bfloat16" if bf16 else "float32"
    job.compile.enable = compiled
    job.job.dump_folder = os.path.join("/tmp", "torchtitan_dump")
    # Its SwiGLU width: 2/3 of 4h rounded up to `multiple_of` (5461 -> 5632 for h = 2048).
    args = TransformerModelArgs(
        dim=shape.hidden_size,
        n_layers=shape.num_layers,
        n_heads=shape.num_attention_heads,
        n_kv_heads=shape.num_query_groups,
        vocab_size=shape.vocab_size,
        multiple_of=_multiple_of(shape),
        max_seq_len=shape.seq_length,
    )
    with torch.device("meta"):
        model = Transformer(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    if float8 is not None:  # as its Trainer: converted before parallelize_llama
        import torchtitan.components.quantization.float8  # noqa: F401  (registers it)
        from torchtitan.protocols.model_converter import build_model_converters

        job.model.converters = ["quantize.linear.float8"]
        job.quantize.linear.float8.recipe_name = float8
        job.quantize.linear.float8.filter_fqns = ["output"]
        build_model_converters(job, dims).convert(model)
    model = parallelize_llama(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=1e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=device.type == "cuda",
    )
    loss_function = build_cross_entropy_loss(job)
    amp = maybe_enable_amp(dims, job.training.mixed_precision_param, device.type)
    batches = _micro_batches(shape, device)
    step_tokens = shape.global_batch_size * shape.seq_length

    def step():
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in batches:  # its Trainer's gradient accumulation: sum / step's tokens
            with amp:
                logits = model(tokens)
                loss = loss_function(logits, tokens) / step_tokens
            del logits
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return float(total)

    return step


def _multiple_of(shape: Shape) -> int:
    """The `multiple_of` that makes torchtitan's FFN width the shape's."""
    width = int(2 * 4 * shape.hidden_size / 3)
    for multiple in (1024, 512, 256, 128, 64, 32, 16, 8):
        if -(-width // multiple) * multiple == shape.ffn_hidden_size:
            return multiple
    raise ValueError(
        f"torchtitan cannot make FFN width {shape.ffn_hidden_size} from hidden "
        f"size {shape.hidden_size}"
    )
