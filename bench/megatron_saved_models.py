"""Checkpoints saved by Megatron-LM's own code, with that code's logits:
tests/data/megatron_saved_models/ERA/, which tests/tools/test_megatron_saved_models.py loads
and holds threefold's logits to.

    python bench/megatron_saved_models.py older MEGATRON_LM_CHECKOUT
    python bench/megatron_saved_models.py current MEGATRON_LM_CHECKOUT

`older`: its older GPT models (megatron/legacy, --use-legacy-models) in its legacy torch format;
the checkout must predate their removal (May 2026): its commit 39ec5ebeb4^, for one. `current`:
megatron-core's GPTModel (local spec) in torch_dist, as a recent checkout saves it (since
megatron-core 0.19 its common state is inside the .distcp files, not common.pt). Each model is
built on 4 gloo ranks (TP2 x PP2) by Megatron-LM's own builder, saved by its
`megatron.training.checkpointing.save_checkpoint` (weights only), and run forward on a fixed
batch, stage 0 sending its hidden states to stage 1 as Megatron-LM's schedule does; the last
stage's full-vocabulary logits go into logits.pt. Its modules that need a GPU library stand in
as in bench/megatron_flags.py (Transformer Engine, apex and ModelOpt are absent instead: their
stand-ins would be taken for the real thing); the older models' LayerNorm (apex's fused kernel)
is torch's, the same function with the same parameters; `.cuda()`, the current CUDA device
and CUDA's synchronize are the CPU's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "megatron_saved_models")
SHAPE = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "4"]
SHAPE += ["--seq-length", "8", "--max-position-embeddings", "8", "--vocab-size", "60"]
SHAPE += ["--make-vocab-size-divisible-by", "32"]  # (padded to 64 at TP2)
# name -> its architecture's flags
MODELS = {
    # grouped query attention, SwiGLU, RMSNorm, RoPE, untied output layer, no biases (and norms'
    # epsilons other than the default: newer Megatron-LM's args name it `layernorm_epsilon`)
    "llama": [
        *("--group-query-attention", "--num-query-groups", "2", "--swiglu"),
        *("--normalization", "RMSNorm", "--position-embedding-type", "rope"),
        *("--ffn-hidden-size", "24", "--untie-embeddings-and-output-weights"),
        *("--disable-bias-linear", "--norm-epsilon", "1e-3"),
    ],
    # learned positions, LayerNorm and biases, GELU, the output layer tied to the embedding
    "gpt2": [
        *("--position-embedding-type", "learned_absolute", "--ffn-hidden-size", "32"),
        *("--norm-epsilon", "1e-4"),
    ],
    # (current only) a mixture of experts: 4 experts of which 2 route, a shared expert
    "moe": [
        *("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8"),
        *("--ffn-hidden-size", "32"),  # (its default at this width: 0)
        *("--moe-shared-expert-intermediate-size", "8", "--swiglu", "--normalization", "RMSNorm"),
        *("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
        *("--disable-bias-linear", "--moe-token-dispatcher-type", "allgather"),
        *("--moe-router-load-balancing-type", "aux_loss"),
    ],
}
ERA_MODELS = {"older": ("llama", "gpt2"), "current": ("llama", "gpt2", "moe")}
COMMON = [
    *("--micro-batch-size", "1", "--transformer-impl", "local"),
    *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
    *("--tokenizer-type", "NullTokenizer", "--use-cpu-initialization"),
    *("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion"),
    *("--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-save-optim", "--no-save-rng"),
    "--no-rope-fusion",
    *("--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234"),
    *("--init-method-std", "0.2", "--distributed-backend", "gloo", "--save-interval", "1"),
]
ITERATION = 7
# era -> its flags
ERAS = {
    "older": ["--use-legacy-models", "--ckpt-format", "torch"],
    "current": ["--ckpt-format", "torch_dist"],
}


def _setup(checkout: str, era: str) -> None:
    """The checkout importable on a CPU machine (bench/megatron_flags.py's stand-ins)."""
    import typing

    import typing_extensions

    sys.path.insert(0, ROOT)
    from bench import megatron_flags

    typing.override = getattr(typing, "override", typing_extensions.override)
    absent = ("transformer_engine", "apex", "modelopt")
    megatron_flags.STAND_INS = (
        *(m for m in megatron_flags.STAND_INS if m not in absent),
        "omegaconf",  # (its config container's; not used here)
    )
    sys.path.insert(0, checkout)
    sys.meta_path.insert(0, megatron_flags._StandIns())
    # (the tied embedding's copy is made on the GPU, a save synchronizes it: here, the CPU)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    if era == "older":
        from megatron.legacy.model import utils

        class TorchLayerNorm(torch.nn.LayerNorm):  # apex's MixedFusedLayerNorm's function
            def __init__(self, hidden_size, eps=1e-5, **_):
                super().__init__(hidden_size, eps=eps)

        utils.LayerNorm = TorchLayerNorm  # (what its get_norm builds)


def _model(era: str, args, config, first: bool, last: bool):
    """Megatron-LM's model of `era` for this stage, as its pretrain_gpt.py builds it."""
    if era == "older":
        from megatron.legacy.model import GPTModel

        return GPTModel(config, 0, parallel_output=False, pre_process=first, post_process=last)
    from gpt_builders import gpt_builder

    return gpt_builder(args, first, last, config=config)


def _rank(rank: int, checkout: str, era: str, name: str, save: str) -> None:
    _setup(checkout, era)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import arguments, checkpointing, global_vars

    sys.argv = ["pretrain_gpt.py", *SHAPE, *MODELS[name], *COMMON, *ERAS[era], "--save", save]
    arguments.get_device_arch_version = lambda: 9  # (a Hopper's: no CUDA here to ask)
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    args = arguments.parse_args()
    args.rank, args.world_size = rank, 4
    arguments.validate_args(args)
    # what Megatron-LM's tokenizer and model provider set, and what its older models still read
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args)
    args.model_type = ModelType.encoder_or_decoder
    args.apply_layernorm_1p, args.iteration = False, ITERATION
    global_vars.set_args(args)
    global_vars._build_tokenizer(args)  # (a save writes its files)
    init_num_microbatches_calculator(rank, None, 1, 1, 1)
    # (dropout is 0: no CUDA RNG state to fork into)
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    dist.init_process_group("gloo", rank=rank, world_size=4, init_method="tcp://127.0.0.1:29631")
    ps.initialize_model_parallel(2, 2)
    config = arguments.core_transformer_config_from_args(args)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    torch.manual_seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())
    model = _model(era, args, config, first, last)
    checkpointing.get_rng_state = lambda *args, **kwargs: None  # (CUDA's; --no-save-rng)
    checkpointing.save_checkpoint(ITERATION, [model], None, None, 0)

    tokens = torch.arange(8).mul(7).remainder(60).unsqueeze(0)
    positions = torch.arange(8).unsqueeze(0)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)  # True: not attended to
    model.eval()
    with torch.no_grad():
        if first:
            hidden = model(tokens, positions, mask)
            dist.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        else:
            hidden = torch.empty(8, 1, 16)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
            gather = {} if era == "older" else {"runtime_gather_output": True}
            logits = model(tokens, positions, mask, **gather)  # [b, s, vocabulary]
            if ps.get_tensor_model_parallel_rank() == 0:
                torch.save({"tokens": tokens, "logits": logits}, os.path.join(save, "logits.pt"))
    dist.barrier()
    dist.destroy_process_group()


WHAT = {
    "older": "its older GPT models (megatron/legacy) in its legacy torch format",
    "current": "megatron-core's GPTModel (local spec) in torch_dist",
}


def main() -> None:
    era, checkout = sys.argv[1], sys.argv[2]
    commit = subprocess.run(
        ["git", "-C", checkout, "log", "-1", "--format=%H (%cs)"], capture_output=True, text=True
    ).stdout.strip()
    out = os.path.join(OUT, era)
    shutil.rmtree(out, ignore_errors=True)
    for name in ERA_MODELS[era]:
        mp.spawn(_rank, args=(checkout, era, name, os.path.join(out, name)), nprocs=4)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(
            f"Written by `python bench/megatron_saved_models.py {era} CHECKOUT` from Megatron-LM "
            f"{commit}: {WHAT[era]}, saved at TP2 x PP2 by its own save_checkpoint, and their "
            "logits on one batch (logits.pt).\n"
        )
    for name in ERA_MODELS[era]:
        print(era, name, sorted(os.listdir(os.path.join(out, name))))


if __name__ == "__main__":
    main()
