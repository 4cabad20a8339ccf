"""tools/estimate_memory.py's predictions match what real (CPU) runs hold."""

import contextlib
import functools
import os
import subprocess
import sys

import pytest

from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, LLAMA_MHA_STYLE, LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.training.activation_estimate import micro_batch_activation_bytes
from threefold.training.memory import measure_activation_bytes, measure_bytes_per_parameter
from threefold.training.memory_estimate import estimate_stage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "96", "--moe-router-topk", "2"]
MOE += ["--moe-shared-expert-intermediate-size", "64"]
FP8 = ["--bf16", "--fp8-format", "hybrid"]
# Wider than the parity models so the layers, not the logits, dominate the activations.
WIDE = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "32"]
# Attention sinks over a longer sequence: their blocks keep a log-sum-exp, no S x S matrix
# (written out, they kept several per head, 2 to 4 times these runs' activations); and a
# query width a d twice the hidden size, as GPT-OSS's exceeds its
SINKS = ["--softmax-type", "learnable"]
LONG = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "256"]
LONG += ["--max-position-embeddings", "256"]
# LLaMA with multi-latent attention: a query latent, latent norms, values narrower than the
# query/key heads
MLA = LLAMA_MHA_STYLE + ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "32"]
# Gated delta nets in the odd layers (the chunked rule's fp32 intermediates dominate)
GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2"]
GDN += ["--linear-num-key-heads", "4", "--linear-num-value-heads", "8"]
GDN += ["--linear-key-head-dim", "16", "--linear-value-head-dim", "16"]
MLA += ["--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm"]
# A hybrid stack: Mamba, attention, MLP and MoE layers
MAMBA = ["--hybrid-layer-pattern", "M*-EM", "--mamba-num-heads", "8", "--mamba-head-dim", "16"]
MAMBA += ["--mamba-num-groups", "4", "--mamba-state-dim", "16", "--num-experts", "4"]
MAMBA += ["--moe-ffn-hidden-size", "96", "--moe-router-topk", "2"]
# and gated delta net layers (G) among them
WITH_GDN = ["--hybrid-layer-pattern", "MG*-G-", *MAMBA[2:10]]
WITH_GDN += ["--linear-num-key-heads", "4", "--linear-num-value-heads", "8"]
WITH_GDN += ["--linear-key-head-dim", "16", "--linear-value-head-dim", "16"]
# DeepSeek sparse attention on that MLA: 8 of 32 keys, an indexer of 4 heads of 16 that learns
DSA = ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4"]
DSA += ["--dsa-indexer-head-dim", "16", "--dsa-indexer-topk", "8"]
LEARNS = ["--dsa-indexer-loss-coeff", "0.1"]
GEMMA = ["--post-sublayer-norm", "--geglu", "--openai-gelu", "--apply-layernorm-1p"]
GEMMA += ["--window-size", "7,0", "--window-attn-skip-freq", "2", "--window-rotary-base", "100"]
# Gemma 2's capped scores over a longer sequence: eager blocks that keep no S x S matrix either
CAPPED = ["--attn-logit-softcapping", "20"]
# Over the longer sequence: query and key norms of each kind, norms after the sublayers (OLMo
# 2's instead of before), the attention's output gate and capped logits
LONG_LAYERS = {
    "qk-norm-post-norms-long": ["--qk-layernorm", "--post-sublayer-norm"],
    "olmo2-bf16-long": ["--qk-layernorm", "--qk-layernorm-across-heads", "--post-sublayer-norm"]
    + ["--no-sublayer-input-norms", "--bf16"],
    "per-head-layernorm-bf16-long": ["--qk-layernorm", "--qk-layernorm-per-head", "--bf16"]
    + ["--normalization", "LayerNorm"],
    "qk-l2-norm-bf16-long": ["--qk-l2-norm", "--bf16"],
    "output-gate-capped-logits-bf16-long": ["--attention-output-gate", "--bf16"]
    + ["--final-logit-softcapping", "30"],
}

COHERE = ["--normalization", "LayerNorm", "--no-layernorm-bias", "--parallel-attention-mlp"]
COHERE += ["--parallel-attention-mlp-shared-norm"]
# GPT-NeoX's layer: a LayerNorm each for the attention and the MLP, side by side (in fp32 both
# keep the layer's input, one tensor), a GELU MLP
NEOX = [a for a in LLAMA_STYLE if a != "--swiglu"] + WIDE
NEOX += ["--normalization", "LayerNorm", "--parallel-attention-mlp"]


def _measure_and_estimate(argv: list[str]) -> dict:
    trainer = _setup(argv)
    stage = trainer.parallel.pp.rank
    named = trainer.layout_independent_parameters()
    count = sum(p.numel() for _, p in named)
    estimate = estimate_stage(trainer.config, stage)
    measured = measure_bytes_per_parameter(named, trainer.data_parallel)
    batch = next(trainer.train_iterator())
    fp8 = trainer.fp8
    options = trainer.pipeline_options
    measure = functools.partial(
        measure_activation_bytes, trainer.model_chunks, batch, options["tensor_shape"]
    )
    # As in a training step, the FP8 weights are cast by the first micro-batch and their
    # copies shared by the others: a later micro-batch's bytes are its own.
    with fp8.weights_cached() if fp8 is not None else contextlib.nullcontext():
        measure(options["dtype"])
        states = list(fp8.states.values()) if fp8 else []
        copies = [state.weight_cache for state in states]
        held = [cast for state in states for cast in _cached_casts(state)]
        activations = measure(options["dtype"], [t for cast in held for t in cast])
    results = {
        "static": (measured.total * count, estimate.static),
        "activations": (activations, micro_batch_activation_bytes(trainer.config, stage)),
    }
    if copies:
        fp8_bytes = sum(weight8.nbytes for weight8, _ in held)
        results["fp8 weight copies"] = (fp8_bytes, estimate.fp8_weights)
    return results


def _cached_casts(state) -> list[tuple]:
    """A step's cached FP8 weight as (FP8 copy, scales) pairs: its transposed copy (and under
    rowwise scaling its scales per input feature; blockwise both layouts, with their block
    scales), and its row-major copy unless that is the parameter (--fp8-param-gather)."""
    cache = state.weight_cache
    if len(cache) == 2:
        kept = cache[1]
        return list(kept) if isinstance(kept[0], tuple) else [kept]
    gathered = state.gathered is not None and state.gathered[1] is cache[3]
    return [(cache[1], cache[2])] + ([] if gathered else [(cache[3], cache[2])])


def _assert_within_10_percent(results: list[dict]) -> None:
    for result in results:
        for what, (measured, estimated) in result.items():
            assert abs(estimated - measured) <= 0.1 * measured, (what, measured, estimated)


@pytest.mark.parametrize(
    "flags",
    [
        LLAMA_STYLE + WIDE,
        LLAMA_STYLE + WIDE + ["--bf16", "--recompute-granularity", "selective"],
        GPT2_STYLE
        + WIDE
        + [
            "--max-position-embeddings",
            "32",
            "--hidden-dropout",
            "0.1",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
        ],
        LLAMA_STYLE + WIDE + MOE,
        MLA + WIDE,
        MLA + WIDE + ["--bf16", "--recompute-granularity", "selective"],
        MLA + WIDE + FP8,
        LLAMA_STYLE + WIDE + FP8,
        LLAMA_STYLE + WIDE + FP8 + ["--recompute-granularity", "selective"],
        LLAMA_STYLE
        + WIDE
        + FP8
        + ["--recompute-granularity", "full"]
        + ["--recompute-method", "block", "--recompute-num-layers", "1"],
        # the first layer kept out of FP8; the second's MoE experts stay bf16 too
        LLAMA_STYLE
        + WIDE
        + FP8
        + MOE
        + ["--moe-layer-freq", "[0,1]"]
        + ["--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "0"],
        # latent experts, their projections in FP8 (the experts' GEMMs stay bf16)
        LLAMA_STYLE + WIDE + FP8 + MOE + ["--moe-latent-size", "48"],
        # two multi-token prediction depths, each an MoE layer as the last one is
        LLAMA_STYLE + WIDE + MOE + ["--mtp-num-layers", "2"],
        # Muon: one momentum for the matrices, Adam's two moments for the rest
        LLAMA_STYLE + WIDE + MOE + ["--optimizer", "muon", "--bf16"],
        # MoE layers recomputed whole, as their input, and the norms
        LLAMA_STYLE
        + WIDE
        + MOE
        + ["--bf16", "--recompute-granularity", "selective", "--recompute-modules", "moe"]
        + ["layernorm", "core_attn"],
        LLAMA_STYLE + WIDE + GDN,
        LLAMA_STYLE + WIDE + GDN + ["--bf16"],
        LLAMA_STYLE + WIDE + MAMBA,
        LLAMA_STYLE + LONG + MAMBA + ["--bf16"],
        LLAMA_STYLE + WIDE + WITH_GDN,
        # two multi-token prediction depths of the pattern's (an attention and an MoE layer),
        # and in FP8 (their linears and projections)
        LLAMA_STYLE + WIDE + ["--hybrid-layer-pattern", "M*-EM/*E/*E", *MAMBA[2:]],
        LLAMA_STYLE + WIDE + FP8 + ["--hybrid-layer-pattern", "M*-EM/*E/*E", *MAMBA[2:]],
        # ... their stacks recomputed as the decoder's (a uniform group of two layers each)
        LLAMA_STYLE
        + WIDE
        + ["--hybrid-layer-pattern", "M*-EM/*E/*E", *MAMBA[2:]]
        + ["--recompute-granularity", "full", "--recompute-method", "uniform"]
        + ["--recompute-num-layers", "2"],
        # in_proj and out_proj in FP8, their weights cast once a step
        LLAMA_STYLE + LONG + MAMBA + ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "rowwise"],
        LLAMA_STYLE + LONG + SINKS,
        LLAMA_STYLE + LONG + SINKS + ["--bf16", "--window-size", "31,0", "--kv-channels", "16"],
        MLA + WIDE + DSA + LEARNS,
        MLA + WIDE + DSA + ["--bf16"],
        # Gemma 3's layers: norms after the sublayers, GeGLU, windows with their own RoPE
        [a for a in LLAMA_STYLE if a != "--swiglu"] + WIDE + GEMMA,
        [a for a in LLAMA_STYLE if a != "--swiglu"] + LONG + GEMMA + CAPPED,
        *[LLAMA_STYLE + LONG + flags for flags in LONG_LAYERS.values()],
        # Cohere's layers: one bias-free LayerNorm for the attention and the MLP side by side
        LLAMA_STYLE + WIDE + COHERE,
        NEOX,
    ],
    ids=[
        "llama",
        "llama-bf16-selective",
        "gpt2-dropout-full-block",
        "llama-moe",
        "mla",
        "mla-bf16-selective",
        "mla-fp8",
        "llama-fp8",
        "llama-fp8-selective",
        "llama-fp8-full-block",
        "llama-fp8-first-layer-bf16-moe",
        "llama-moe-latent-fp8",
        "llama-moe-mtp",
        "llama-moe-muon-bf16",
        "llama-moe-recompute-moe-layernorm",
        "gated-delta-net",
        "gated-delta-net-bf16",
        "hybrid",
        "hybrid-bf16-long",
        "hybrid-gated-delta-nets",
        "hybrid-mtp",
        "hybrid-mtp-fp8",
        "hybrid-mtp-full-uniform",
        "hybrid-fp8-rowwise-long",
        "sinks",
        "sinks-bf16-window-wide-heads",
        "dsa",
        "dsa-bf16-without-indexer-loss",
        "gemma",
        "gemma2-capped-long",
        *LONG_LAYERS,
        "cohere",
        "gpt-neox",
    ],
)
def test_single_process(flags):
    _assert_within_10_percent([_measure_and_estimate(flags + TRAINING)])


# Packed documents from a tiny vocabulary (its end-of-document token comes up often)
DOCUMENTS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "15", "--eod-mask-loss"]
WINDOWS = ["--window-size", "7,0", "--window-attn-skip-freq", "2"]


def _mask_bytes_job(argv: list[str], flags: list[str]) -> tuple[int, int]:
    """(measured, estimated) activation bytes the mask `flags` add to the run `argv`."""

    def kept(more: list[str]) -> tuple[int, int]:
        trainer = _setup(argv + more)
        options = trainer.pipeline_options
        batch = next(trainer.train_iterator())
        measured = measure_activation_bytes(
            trainer.model_chunks, batch, options["tensor_shape"], options["dtype"]
        )
        return measured, micro_batch_activation_bytes(trainer.config, 0)

    (causal, causal_estimate), (masked, estimate) = kept([]), kept(flags)
    return masked - causal, estimate - causal_estimate


ULYSSES = ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]


@pytest.mark.parametrize(
    "flags,masks,world",
    [
        (["--reset-attention-mask"], 1, 1),
        (WINDOWS, 1, 1),
        (["--reset-attention-mask", *WINDOWS], 2, 1),
        (ULYSSES + ["--reset-attention-mask", *WINDOWS], 2, 2),
        (ULYSSES + ["--attention-chunk-size", "64"], 1, 2),
    ],
    ids=[
        "documents",
        "windows",
        "windows-in-documents",
        "ulysses-windows-in-documents",
        "ulysses-chunks",
    ],
)
def test_the_layers_keep_one_copy_of_each_attention_mask(flags, masks, world):
    """Four layers over packed documents, or two of them windowed, keep SDPA's additive copy
    of each mask once a micro-batch (context_parallel/masks.py), not once a layer: e b s^2
    bytes a mask (a window's band alone: e s^2) more than causal attention without one, as
    the estimate says; under Ulysses (CP2 a2a) the whole sequence's masks, s its length."""
    argv = LLAMA_STYLE + LONG + DOCUMENTS + ["--num-layers", "4", "--bf16"] + TRAINING
    b = 1 if flags == WINDOWS else int(argv[argv.index("--micro-batch-size") + 1])
    if world == 1:
        results = [_mask_bytes_job(argv, flags)]
    else:  # (the layout in both runs: the masks are the difference)
        results = run_distributed(world, _mask_bytes_job, argv + flags[:4], flags[4:])
    for measured, estimated in results:
        assert measured == masks * 2 * b * 256 * 256 and estimated == measured


BF16 = LLAMA_STYLE + WIDE + ["--bf16"]
RECOMPUTED_MODULES = {
    "layernorm": (BF16, ["layernorm"]),
    "layernorm-fp32": (LLAMA_STYLE + WIDE, ["layernorm"]),
    "mlp": (BF16, ["mlp"]),
    "moe_act": (BF16 + MOE, ["moe_act"]),
    "shared_experts": (BF16 + MOE, ["shared_experts"]),
    "mla_up_proj": (MLA + WIDE + ["--bf16"], ["mla_up_proj"]),
    "mla-layernorm-core_attn": (MLA + WIDE + ["--bf16"], ["layernorm", "core_attn"]),
    "gdn_norm_out": (LLAMA_STYLE + WIDE + GDN + ["--bf16"], ["gdn_norm_out"]),
    "gdn_norm_out-fp32": (LLAMA_STYLE + WIDE + GDN, ["gdn_norm_out"]),
}


@pytest.mark.parametrize("case", RECOMPUTED_MODULES)
def test_what_each_recomputed_module_saves_is_what_the_estimate_says(case):
    """--recompute-modules: measured (the output-discarding modules' outputs freed once the
    forward is done), the activations fall, by what the estimate says within 2%."""
    flags, modules = RECOMPUTED_MODULES[case]
    argv = flags + TRAINING
    kept = _measure_and_estimate(argv)["activations"]
    selective = ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    recomputed = _measure_and_estimate(argv + selective)["activations"]
    measured, estimated = (recomputed[i] - kept[i] for i in (0, 1))
    assert measured < 0 and abs(estimated - measured) <= 0.02 * abs(measured), (measured, estimated)


OFFLOADED_MODULES = {
    "attn_norm": (BF16, ["attn_norm"]),
    "qkv_linear": (BF16, ["qkv_linear"]),
    "core_attn": (BF16, ["core_attn"]),
    "core_attn-attn_proj": (BF16, ["core_attn", "attn_proj"]),
    # (the layers' shared masks stay on the device, as the rotary tables do)
    "core_attn-windows-in-documents": (
        BF16 + DOCUMENTS + ["--reset-attention-mask", *WINDOWS],
        ["core_attn"],
    ),
    "mlp_norm-fp32": (LLAMA_STYLE + WIDE, ["mlp_norm"]),
    "all-layernorm-recomputed": (
        BF16 + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
        ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"],
    ),
    "experts": (BF16 + MOE, ["expert_fc1", "moe_act"]),
    "fused_group_mlp": (BF16 + MOE, ["fused_group_mlp"]),
    "mla": (MLA + WIDE + ["--bf16"], ["qkv_linear", "core_attn", "attn_proj"]),
    "fp8": (LLAMA_STYLE + WIDE + FP8, ["qkv_linear", "core_attn", "attn_proj"]),
    # (after the modules: the plan's tuning)
    "fraction": (
        BF16 + ["--num-layers", "4"],
        ["core_attn", "attn_proj", "mlp_norm", "--activation-offload-fraction", "0.5"],
    ),
}
OFFLOAD = ["--fine-grained-activation-offloading", "--min-offloaded-tensor-size", "0"]


@pytest.mark.parametrize("case", OFFLOADED_MODULES)
def test_what_each_offloaded_module_moves_is_what_the_estimate_says(case):
    """--fine-grained-activation-offloading: measured (what the forward pass leaves on the
    device once done, the pass's last group included), the activations fall by what the
    estimate says within 3%. (Not --moe-grouped-gemm: on the CPU it pads each expert's
    tokens to the most any expert has, which the estimate, made for the GPU's grouped GEMM,
    leaves out.)"""
    flags, modules = OFFLOADED_MODULES[case]
    argv = flags + TRAINING
    kept = _measure_and_estimate(argv)["activations"]
    offloaded = _measure_and_estimate(argv + OFFLOAD + ["--offload-modules", *modules])
    measured, estimated = (offloaded["activations"][i] - kept[i] for i in (0, 1))
    assert measured < 0 and abs(estimated - measured) <= 0.03 * abs(measured), (measured, estimated)


@pytest.mark.parametrize("flags", [BF16 + ["--num-layers", "3"], BF16 + MOE], ids=["llama", "moe"])
def test_layer_level_offloading_moves_what_the_estimate_says(flags):
    """--cpu-offloading-num-layers: the first layer's activations leave the device whole, as
    many as the estimate says of a layer within its own bound (10%)."""
    argv = flags + TRAINING
    kept = _measure_and_estimate(argv)["activations"]
    offloaded = _measure_and_estimate(argv + ["--cpu-offloading-num-layers", "1"])
    measured, estimated = (offloaded["activations"][i] - kept[i] for i in (0, 1))
    assert measured < 0 and abs(estimated - measured) <= 0.1 * abs(measured), (measured, estimated)


def test_a_later_pipeline_stage_keeps_the_delta_on_the_device():
    """--delta-offload-bytes-across-pp-ranks 30000: stage 1 keeps its latest groups worth
    30000 bytes (its second layer's core attention and projection; the norm after them is
    the pass's last, kept on both stages); each stage's activations fall by what the
    estimate says within 3%, stage 1's by less."""
    argv = BF16 + TRAINING + ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    offload = OFFLOAD + ["--offload-modules", "core_attn", "attn_proj", "mlp_norm"]
    offload += ["--delta-offload-bytes-across-pp-ranks", "30000"]
    kept = run_distributed(2, _measure_and_estimate, argv)
    offloaded = run_distributed(2, _measure_and_estimate, argv + offload)
    falls = []
    for before, after in zip(kept, offloaded):
        measured, estimated = (after["activations"][i] - before["activations"][i] for i in (0, 1))
        assert measured < 0 and abs(estimated - measured) <= 0.03 * abs(measured)
        falls.append(-measured)
    assert falls[1] < 0.75 * falls[0]


HYBRID = ["--fp8-format", "hybrid"]


@pytest.mark.parametrize(
    "flags,fp8",
    [
        ([], HYBRID),
        (["--recompute-granularity", "selective"], HYBRID),
        (["--use-distributed-optimizer"], HYBRID + ["--fp8-param-gather"]),
        ([], HYBRID + ["--fp8-recipe", "rowwise"]),
        ([], ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]),
        # the shared expert in FP8, the experts not (a shared expert wider than the model, whose
        # fc2 input's saving outweighs the FP8 copies it adds); under rowwise scaling both
        (MOE + ["--moe-shared-expert-intermediate-size", "256"], HYBRID),
        (MOE, HYBRID + ["--fp8-recipe", "rowwise"]),
    ],
    ids=[
        "plain",
        "selective",
        "distributed-optimizer",
        "rowwise",
        "blockwise",
        "moe",
        "moe-rowwise",
    ],
)
def test_what_fp8_changes_is_what_the_estimate_says(flags, fp8):
    """The bytes FP8 adds or saves, beside the same bf16 run, at a tighter bound than the
    totals' 10% (which a model ignoring FP8 would meet at this size): activations within 2%
    of the measured change, the FP8 weight copies (with --fp8-param-gather the byte per FP8
    weight it saves in the static bytes) exactly."""
    argv = LLAMA_STYLE + WIDE + TRAINING + ["--bf16"] + flags
    bf16, in_fp8 = _measure_and_estimate(argv), _measure_and_estimate(argv + fp8)
    measured, estimated = (in_fp8["activations"][i] - bf16["activations"][i] for i in (0, 1))
    assert measured < 0 and abs(estimated - measured) <= 0.02 * abs(measured)
    for what in ("static", "fp8 weight copies"):
        assert in_fp8[what][0] == in_fp8[what][1], what
    # --fp8-param-gather stores the FP8 weights in 1 byte instead of bf16's 2
    stored = in_fp8["static"][0] - bf16["static"][0]
    assert stored == (-in_fp8["fp8 weight copies"][0] if "--fp8-param-gather" in fp8 else 0)


@pytest.mark.parametrize(
    "flags",
    [
        ["--fp8-recipe", "tensorwise"],
        ["--fp8-recipe", "rowwise", "--recompute-granularity", "selective"],
    ],
)
def test_fp8_layers_with_unquantized_weight_gradients_keep_what_bf16_keeps(flags):
    """--no-fp8-wgrad: the FP8 layers keep their inputs as the bf16 run's layers do, and no
    FP8 copies of them; measured and estimated, the activations are the bf16 run's, byte for
    byte, beside the step's FP8 weight copies."""
    argv = LLAMA_STYLE + WIDE + TRAINING + ["--bf16"] + flags[2:]
    bf16 = _measure_and_estimate(argv)
    in_fp8 = _measure_and_estimate(argv + HYBRID + flags[:2] + ["--no-fp8-wgrad"])
    assert in_fp8["activations"] == bf16["activations"]
    assert in_fp8["fp8 weight copies"][0] == in_fp8["fp8 weight copies"][1] > 0


def test_fp8_linears_traced_into_compiled_layers_read_the_step_copies():
    """Traced into a compiled layer, an FP8 linear reads its weight as cast for the step, in
    both layouts as an eager one does (`Fp8Scaling.weights_cached`): the copies held are what
    the estimate says, the eager run's."""
    argv = LLAMA_STYLE + WIDE + TRAINING + ["--bf16"] + HYBRID
    eager = estimate_stage(parse_args(argv), 0)
    copies = _measure_and_estimate(argv + ["--compile-layers"])["fp8 weight copies"]
    assert copies[0] == copies[1] == eager.fp8_weights > 0


def test_fp32_fp8_param_gather_keeps_masters_for_every_parameter():
    """In fp32 the distributed optimizer's masters are the parameters' own shards, except
    beside --fp8-param-gather's FP8 weights: then every parameter has a separate fp32 master,
    and the estimate's static bytes are the measured ones (to float rounding)."""
    flags = ["--fp8-format", "hybrid", "--use-distributed-optimizer", "--fp8-param-gather"]
    measured, estimated = _measure_and_estimate(LLAMA_STYLE + WIDE + TRAINING + flags)["static"]
    assert estimated == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("fp8", [[], ["--bf16", "--fp8-format", "hybrid"]], ids=["", "fp8"])
def test_cli_prints_every_stage(fp8):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "estimate_memory.py"),
            "--world-size",
            "8",
            "--gpu-memory-gib",
            "80",
            *LLAMA_STYLE,
            "--vocab-size",
            "32000",
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
            # GiB-sized columns, so the sum below is not all zeros
            *["--hidden-size", "4096", "--ffn-hidden-size", "11008", "--seq-length", "4096"],
            *["--micro-batch-size", "1", "--global-batch-size", "8"],
            *fp8,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "TP=2 PP=2 DP=2" in result.stdout
    assert result.stdout.count(" fits") == 2  # one line per pipeline stage
    # With FP8, a column for the step's FP8 weights, each stage's total its columns' sum.
    header, *stages = result.stdout.splitlines()[1:]
    assert ("fp8 weights GiB" in header) == bool(fp8)
    for line in stages:
        numbers = [float(x) for x in line.replace("(", " ").replace(")", " ").split()[1:-1]]
        sizes, total = numbers[:4] + numbers[5:-1], numbers[-1]
        assert abs(sum(sizes) - total) <= 0.01 * len(sizes), line
