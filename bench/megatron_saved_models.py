"""Checkpoints saved by Megatron-LM's own code, with that code's logits:
tests/data/megatron_saved_models/ERA/, which tests/tools/test_megatron_saved_models.py loads
and holds threefold's logits to.

    python bench/megatron_saved_models.py older MEGATRON_LM_CHECKOUT
    python bench/megatron_saved_models.py current MEGATRON_LM_CHECKOUT
    python bench/megatron_saved_models.py exports MEGATRON_LM_CHECKOUT

`older`: its older GPT models (megatron/legacy, --use-legacy-models) in its legacy torch format;
the checkout must predate their removal (May 2026): its commit 39ec5ebeb4^, for one. `current`:
megatron-core's GPTModel (local spec) in torch_dist, as a recent checkout saves it (since
megatron-core 0.19 its common state is inside the .distcp files, not common.pt). Each model is
built on 4 gloo ranks (TP2 x PP2) by Megatron-LM's own builder, saved by its
`megatron.training.checkpointing.save_checkpoint` (weights only), and run forward on a fixed
batch, stage 0 sending its hidden states to stage 1 as Megatron-LM's schedule does; the last
stage's full-vocabulary logits go into logits.pt. `exports` is the other way: each current
model read by threefold and exported to Megatron-LM's layout, then loaded by Megatron-LM's own
`load_checkpoint` at one rank, whose logits must be those it computed before
(bench/results/megatron_saved_models.md). Its modules that need a GPU library stand in
as in bench/megatron_flags.py (Transformer Engine, apex and ModelOpt are absent instead: their
stand-ins would be taken for the real thing); the older models' LayerNorm (apex's fused kernel)
is torch's, the same function with the same parameters; `.cuda()`, a tensor made on "cuda",
the current CUDA device and CUDA's synchronize are the CPU's.
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
    # (current only) DeepSeek-V3's experts: a sigmoid router with its expert bias, a dense first
    # layer. Not its multi-latent attention nor its prediction depths, whose local specs
    # Megatron-LM at d98e8a64 does not build on a CPU (DotProductAttention takes no k_channels;
    # the depth's layer asks for an inference layer type a stand-in module cannot give)
    "deepseek": [
        *("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8"),
        *("--ffn-hidden-size", "32", "--swiglu", "--normalization", "RMSNorm"),
        *("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"),
        *("--moe-shared-expert-intermediate-size", "8", "--untie-embeddings-and-output-weights"),
        *("--disable-bias-linear", "--moe-token-dispatcher-type", "allgather"),
        *("--position-embedding-type", "rope", "--moe-layer-freq", "[0,1,1,1]"),
    ],
}
ERA_MODELS = {"older": ("llama", "gpt2"), "current": ("llama", "gpt2", "moe", "deepseek")}
COMMON = [
    *("--micro-batch-size", "1", "--transformer-impl", "local"),
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


def cpu_stand_ins(checkout: str, era: str) -> None:
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
    tensor = torch.tensor  # (and a tensor made on "cuda", as the load's tracker check makes one)
    torch.tensor = lambda *args, device=None, **kwargs: tensor(
        *args, device=None if device == "cuda" else device, **kwargs
    )
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


TOKENS = torch.arange(8).mul(7).remainder(60).unsqueeze(0)
POSITIONS = torch.arange(8).unsqueeze(0)
MASK = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)  # True: not attended to


def _start(rank: int, world: int, checkout: str, era: str, argv: list[str]):
    """Megatron-LM's args (its parser, its validate_args) and process groups on a gloo rank of
    `world` (TP2 x PP2 for 4, else one rank): (args, parallel_state, this stage's model)."""
    cpu_stand_ins(checkout, era)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import arguments, global_vars

    split = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    sys.argv = ["pretrain_gpt.py", *argv, *(split if world == 4 else [])]
    arguments.get_device_arch_version = lambda: 9  # (a Hopper's: no CUDA here to ask)
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    args = arguments.parse_args()
    args.rank, args.world_size = rank, world
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
    address = "tcp://127.0.0.1:29631"
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=address)
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    config = arguments.core_transformer_config_from_args(args)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    torch.manual_seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())
    return args, ps, _model(era, args, config, first, last)


def _logits(era: str, ps, model) -> torch.Tensor | None:
    """The last stage's full-vocabulary logits [b, s, vocabulary] of TOKENS (None elsewhere),
    stage 0 sending its hidden states to stage 1 as Megatron-LM's schedule does."""
    import torch.distributed as dist

    model.eval()
    gather = {} if era == "older" else {"runtime_gather_output": True}
    with torch.no_grad():
        if ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage():
            return model(TOKENS, POSITIONS, MASK, **gather)
        if ps.is_pipeline_first_stage():
            hidden = model(TOKENS, POSITIONS, MASK)
            dist.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
        hidden = torch.empty(8, 1, 16)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
        return model(TOKENS, POSITIONS, MASK, **gather)


def _save_rank(rank: int, checkout: str, era: str, name: str, save: str) -> None:
    """A rank of the TP2 x PP2 run that saves `name` and writes its logits beside it."""
    import torch.distributed as dist

    argv = [*SHAPE, *MODELS[name], *COMMON, *ERAS[era], "--save", save]
    _, ps, model = _start(rank, 4, checkout, era, argv)
    from megatron.training import checkpointing

    checkpointing.get_rng_state = lambda *args, **kwargs: None  # (CUDA's; --no-save-rng)
    checkpointing.save_checkpoint(ITERATION, [model], None, None, 0)
    logits = _logits(era, ps, model)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
        torch.save({"tokens": TOKENS, "logits": logits}, os.path.join(save, "logits.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _load_rank(rank: int, checkout: str, name: str, load: str, out: str) -> None:
    """One rank of Megatron-LM that loads `load` (a threefold export) with its own
    load_checkpoint, weights only, and writes its logits into `out`."""
    import torch.distributed as dist

    argv = [*SHAPE, *MODELS[name], *COMMON, *ERAS["current"], "--load", load]
    _, ps, model = _start(rank, 1, checkout, "current", [*argv, "--finetune", "--no-load-rng"])
    from megatron.training import checkpointing

    checkpointing.load_checkpoint([model], None, None)
    torch.save(_logits("current", ps, model), out)
    dist.destroy_process_group()


WHAT = {
    "older": "its older GPT models (megatron/legacy) in its legacy torch format",
    "current": "megatron-core's GPTModel (local spec) in torch_dist",
}


RESULTS = os.path.join(ROOT, "bench", "results", "megatron_saved_models.md")


def _convert(loader: str, saver: str, load: str, save: str) -> None:
    command = [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py")]
    command += ["--loader", loader, "--saver", saver, "--load-dir", load, "--save-dir", save]
    subprocess.run(command, check=True, capture_output=True)


def exports(checkout: str, commit: str) -> None:
    """Out: each current model read by threefold and exported (tools/convert_checkpoint.py,
    through threefold's format), then loaded by Megatron-LM's own load_checkpoint at one rank,
    whose logits must be the ones Megatron-LM computed before the round trip."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in ERA_MODELS["current"]:
            saved = os.path.join(OUT, "current", name)
            ours, exported = os.path.join(scratch, name), os.path.join(scratch, f"{name}-mlm")
            _convert("megatron", "threefold", saved, ours)
            _convert("threefold", "megatron", ours, exported)
            out = os.path.join(scratch, f"{name}.pt")
            mp.spawn(_load_rank, args=(checkout, name, exported, out), nprocs=1)
            before = torch.load(os.path.join(saved, "logits.pt"), weights_only=True)["logits"]
            after = torch.load(out, weights_only=True)
            rows.append(f"| {name} | {(after - before).abs().max().item():.2e} |")
    with open(RESULTS, "w") as f:
        f.write(
            f"Megatron-LM {commit}, `python bench/megatron_saved_models.py exports CHECKOUT`: "
            "each current fixture (saved by Megatron-LM at TP2 x PP2) read by threefold, "
            "exported with `tools/convert_checkpoint.py --loader threefold --saver megatron`, and "
            "loaded by Megatron-LM's own `load_checkpoint` at one rank (`--finetune "
            "--no-load-rng`). The largest difference of its logits from those Megatron-LM "
            "computed before the round trip:\n\n| model | largest difference |\n| --- | ---: |\n"
        )
        f.write("\n".join(rows) + "\n")
    print(open(RESULTS).read())


def main() -> None:
    era, checkout = sys.argv[1], sys.argv[2]
    commit = subprocess.run(
        ["git", "-C", checkout, "log", "-1", "--format=%H (%cs)"], capture_output=True, text=True
    ).stdout.strip()
    if era == "exports":
        return exports(checkout, commit)
    out = os.path.join(OUT, era)
    shutil.rmtree(out, ignore_errors=True)
    for name in ERA_MODELS[era]:
        mp.spawn(_save_rank, args=(checkout, era, name, os.path.join(out, name)), nprocs=4)
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
