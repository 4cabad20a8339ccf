"""Training throughput and MFU of a ~1B LLaMA-style model on one GPU: threefold against what a
user would pick instead, same shapes, same GPU, one run.

    python bench/gpu_mfu.py --out bench/results/gpu_mfu          # on a GPU machine
    python bench/gpu_mfu.py --tiny --out /tmp/gpu_mfu_smoke      # the script itself, on a CPU

Contenders, each in its own process (its own memory peak, no shared compile caches), each
logging to OUT/<name>.log:
- threefold: `Trainer.train_step` with --bf16 (bf16 weights; fp32 gradients, masters and Adam
  state) and the kernels chosen at start-up (its log line is in the raw log); and the same with
  --compile-layers (each transformer layer one torch.compile'd graph);
- transformers: LlamaForCausalLM with SDPA, fp32 weights under bf16 autocast (the recipe of
  transformers' Trainer with bf16=True), PyTorch's fused AdamW; eager and torch.compile'd;
- megatron-core: GPTModel with the local layer spec, bf16 with fp32 masters through
  megatron-core's DDP and optimizer (needs CUDA: its RoPE asks torch.cuda for the device);
- torchtitan 0.3: its Llama 3 model, `parallelize_llama` (FSDP2 bf16 parameters, fp32
  reduction) and loss on a one-rank mesh, eager and with its per-block torch.compile; reported
  as not run where it does not import (carry its wheels: bench/README.md).

Model FLOPs per step are threefold's count (threefold/training/flops.py, docs/performance.md),
the same for every contender; MFU divides by the GPU's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    micro_batch_size: int = 1


TINY = Shape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=176, vocab_size=512, seq_length=64, micro_batch_size=2)
CONTENDERS = ("threefold", "threefold+compile-layers", "transformers", "transformers+compile",
              "megatron-core", "torchtitan", "torchtitan+compile")


def threefold_args(shape: Shape, bf16: bool) -> list[str]:
    """pretrain_gpt.py's flags for the shape (mock data, no dropout, no evaluation)."""
    return ["--num-layers", str(shape.num_layers), "--hidden-size", str(shape.hidden_size),
            "--num-attention-heads", str(shape.num_attention_heads), "--group-query-attention",
            "--num-query-groups", str(shape.num_query_groups), "--ffn-hidden-size",
            str(shape.ffn_hidden_size), "--seq-length", str(shape.seq_length),
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--vocab-size",
            str(shape.vocab_size), "--make-vocab-size-divisible-by", "64",
            "--micro-batch-size", str(shape.micro_batch_size), "--global-batch-size",
            str(shape.micro_batch_size), "--mock-data", "--train-iters", "100000",
            "--eval-iters", "0", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--lr", "1e-4", *(["--bf16"] if bf16 else [])]


def hf_llama_config(shape: Shape):
    """The same model as a `transformers` LlamaConfig (SDPA attention, untied)."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=shape.hidden_size, intermediate_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_query_groups, num_hidden_layers=shape.num_layers,
        vocab_size=shape.vocab_size, max_position_embeddings=shape.seq_length,
        tie_word_embeddings=False, attn_implementation="sdpa")


# --- contenders: each returns a `step()` that trains one iteration and returns its loss ----

def _threefold(shape: Shape, device, bf16: bool, extra: tuple[str, ...] = ()):
    from threefold.arguments import parse_args
    from threefold.training.trainer import Trainer

    trainer = Trainer(parse_args(threefold_args(shape, bf16) + list(extra)), device)
    return lambda: trainer.train_step()[0]


def _batch(shape: Shape, device):
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, shape.vocab_size, (shape.micro_batch_size, shape.seq_length),
                         generator=generator).to(device)


def _transformers(shape: Shape, device, bf16: bool, compiled: bool = False):
    import torch
    import transformers

    config = hf_llama_config(shape)
    model = transformers.LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = torch.compile(model) if compiled else model
    tokens = _batch(shape, device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return step


def _megatron_core(shape: Shape, device, bf16: bool):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if device.type != "cuda":
        raise RuntimeError("megatron-core's GPTModel needs CUDA (its RoPE calls "
                           "torch.cuda.current_device())")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, attention_dropout=0.0,
        hidden_dropout=0.0, gradient_accumulation_fusion=False)
    model = GPTModel(config=config,
                     transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                     position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).to(device)
    model = DistributedDataParallel(config=config, module=model,
                                    ddp_config=DistributedDataParallelConfig(
                                        grad_reduce_in_fp32=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=bf16, clip_grad=1.0), [model])
    tokens = _batch(shape, device)
    positions = torch.arange(shape.seq_length, device=device).expand_as(tokens)

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        return loss.item()

    return step


def _torchtitan(shape: Shape, device, bf16: bool, compiled: bool = False):
    """torchtitan 0.3's Llama 3 recipe without its data pipeline: its model (fused QKV,
    FlexAttention with the document-causal mask its trainer builds from positions),
    `parallelize_llama` on a one-rank mesh (FSDP2 with bf16 parameters and fp32 reduction,
    per-block torch.compile when `compiled`), its sum-reduced cross-entropy (compiled too, as
    its --compile.components default), fused AdamW and clipping at 1.0, as its Trainer does.
    Its Trainer itself wants a tokenizer and a dataset on disk, which this benchmark has not."""
    import importlib.util

    import torch
    import torch.distributed as dist

    if importlib.util.find_spec("torchtitan") is None:
        raise RuntimeError("torchtitan is not installed (carry torchtitan 0.3 and its "
                           "dependencies as wheels)")
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29556")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    # torchtitan builds its meshes on the accelerator it finds; the CPU check runs on gloo.
    parallel_dims_module.device_type = device.type
    dim, heads = shape.hidden_size, shape.num_attention_heads
    config = llama3.Llama3Model.Config(
        dim=dim, vocab_size=shape.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=shape.vocab_size, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=shape.vocab_size,
                              param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=shape.num_layers, dim=dim, n_heads=heads,
            n_kv_heads=shape.num_query_groups, hidden_dim=shape.ffn_hidden_size,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=shape.seq_length,
                                    theta=10000.0),
            attn_backend="flex"))
    with torch.device("meta"):
        model = config.build()
    parallelism = ParallelismConfig(data_parallel_shard_degree=1)
    precision = "bfloat16" if bf16 else "float32"
    model = llama3.parallelize_llama(
        model, parallel_dims=parallel_dims_module.ParallelDims.from_config(parallelism, 1),
        training=TrainingConfig(local_batch_size=shape.micro_batch_size,
                                seq_len=shape.seq_length, mixed_precision_param=precision),
        parallelism=parallelism, compile_config=CompileConfig(enable=compiled),
        ac_config=None, dump_folder=os.path.join("/tmp", "torchtitan_dump"))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    loss_function = torch.compile(cross_entropy_loss) if compiled else cross_entropy_loss
    tokens = _batch(shape, device)
    positions = torch.arange(shape.seq_length, device=device).expand_as(tokens)

    def step():
        optimizer.zero_grad(set_to_none=True)
        masks = model.get_attention_masks(positions=positions)  # per batch, as its Trainer
        logits = model(tokens, positions=positions, attention_masks=masks)
        loss = loss_function(logits, tokens) / tokens.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    return step


def run_contender(name: str, shape: Shape, steps: int, warmup: int) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    build = {"threefold": _threefold,
             "threefold+compile-layers": lambda *a: _threefold(*a, extra=("--compile-layers",)),
             "transformers": _transformers,
             "transformers+compile": lambda *a: _transformers(*a, compiled=True),
             "megatron-core": _megatron_core, "torchtitan": _torchtitan,
             "torchtitan+compile": lambda *a: _torchtitan(*a, compiled=True)}[name]
    step = build(shape, device, cuda)
    losses = [step() for _ in range(warmup)]  # compilation and allocator warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    losses += [step() for _ in range(steps)]  # .item() synchronizes every step
    seconds = (time.perf_counter() - start) / steps
    return {"step_s": seconds,
            "tokens_per_s": shape.micro_batch_size * shape.seq_length / seconds,
            "memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "first_loss": losses[0], "last_loss": losses[-1]}


# --- the parent: one process per contender, one table ---------------------------------------

def _flops_per_step(shape: Shape) -> float:
    from threefold.arguments import parse_args
    from threefold.training.flops import training_flops_per_iteration

    model = parse_args(threefold_args(shape, False), world_size=1).model
    return training_flops_per_iteration(model, shape.micro_batch_size,
                                        model.padded_vocab_size(1))


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
    for package in ("transformers", "megatron.core", "transformer_engine", "apex", "torchtitan"):
        try:
            module = __import__(package, fromlist=["__version__"])
            versions.append(f"{package} {getattr(module, '__version__', '?')}")
        except Exception:  # noqa: BLE001 - absent or broken: reported as such
            versions.append(f"{package} absent")
    return (f"{gpu}; torch {torch.__version__}, Python {platform.python_version()}; "
            + ", ".join(versions))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_mfu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model: check the script")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = TINY if args.tiny else Shape()
    if args.contender:  # a child: one contender, one RESULT line
        print("RESULT " + json.dumps(run_contender(args.contender, shape, args.steps,
                                                   args.warmup)), flush=True)
        return

    from threefold.training.flops import peak_tflops

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
        command = [sys.executable, os.path.abspath(__file__), "--contender", name,
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
        command += ["--tiny"] if args.tiny else []
        with open(log, "w") as stream:
            stream.write(f"$ {' '.join(command)}\n")
            stream.flush()
            run = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env={**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        text = open(log).read()
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if run.returncode == 0 and lines:
            results[name] = json.loads(lines[-1][len("RESULT "):])
        else:
            results[name] = {"error": _failure(text)}
        print(f"{name}: {results[name]}", file=sys.stderr, flush=True)

    ours = max((result["tokens_per_s"] for name, result in results.items()
                if name.startswith("threefold") and "error" not in result), default=None)
    rows = []
    for name, result in results.items():
        if "error" in result:
            rows.append(f"| {name} | not run: {result['error']} | | | | | |")
            continue
        tflops = flops / result["step_s"] / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a (not a known GPU)"
        memory = f"{result['memory_gib']:.1f}" if result["memory_gib"] is not None else "n/a"
        ratio = f"{ours / result['tokens_per_s']:.2f}" if ours else "n/a"
        rows.append(f"| {name} | {result['tokens_per_s']:,.0f} | {tflops:.1f} | {mfu} | "
                    f"{memory} | {result['first_loss']:.3f} -> {result['last_loss']:.3f} | "
                    f"{ratio} |")
    report = "\n".join([
        f"# Training throughput, {'tiny check model' if args.tiny else '1B LLaMA-style model'}",
        "", f"Environment: {environment}.", "",
        f"Shape: {dataclasses.asdict(shape)}; model FLOPs per step {flops:.4g} "
        f"(threefold/training/flops.py); {args.steps} timed steps after {args.warmup} warm-up "
        "steps; one process per contender, raw logs beside this file.", "",
        "| contender | tokens/s | model TFLOP/s | MFU | peak memory GiB | loss first -> last "
        "| best threefold's speed-up |", "|---|---|---|---|---|---|---|", *rows, ""])
    with open(os.path.join(args.out, "gpu_mfu.md"), "w") as stream:
        stream.write(report)
    print(report)


if __name__ == "__main__":
    main()
