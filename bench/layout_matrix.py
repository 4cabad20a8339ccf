"""Every model feature under every layout, against the same model in one process: the parity
tests check the pairs someone thought of; this checks them all.

    python bench/layout_matrix.py [--features mla,moe] [--layouts cp2-a2a,tp2-pp2] [--steps 3]

Each cell is a tiny model (4 layers, tests/parity.py's fp32 training flags) trained `--steps`
steps on the layout's gloo ranks (tests/distributed.py's spawned workers, reused from cell to
cell) and in this process alone; the losses, a validation batch's loss after them and the
final parameters, gathered over TP and merged over stages, are compared. A cell is `equal`
(all within 1e-5, relative: only the order of fp32 sums differs), `close` (within 1e-3: read
why), `DIFFERS`, `as defined` (a feature whose result data parallelism defines), `refused`
(the one line parse_args or a rank gave) or `ERROR` (a traceback: a bug even where the layout
is not supported). bench/results/layout_matrix.md holds its runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.distributed import close_pools, run_distributed  # noqa: E402
from tests.model.test_dsa import DSA  # noqa: E402
from tests.model.test_gated_delta_net import GDN  # noqa: E402
from tests.model.test_gpt_oss import GPT_OSS  # noqa: E402
from tests.model.test_mamba import MAMBA  # noqa: E402
from tests.model.test_mla import MLA  # noqa: E402
from tests.model.test_window_attention import WINDOW  # noqa: E402
from tests.parallel.test_expert_parallel import MOE  # noqa: E402
from tests.parallel.test_fp8 import (  # noqa: E402
    LOSS_TOLERANCE,
    MEDIAN_PARAMETER_TOLERANCE,
    PARAMETER_TOLERANCE,
    RECIPES,
    _weights_and_scaling,
    fp8_train_job,
    step_errors,
)
from tests.parallel.test_fp8_param_gather import (  # noqa: E402
    PARAM_GATHER,
    _masters_and_scaling,
    param_gather_job,
)
from tests.parity import (  # noqa: E402
    GPT2_STYLE,
    LLAMA_STYLE,
    TRAINING,
    _setup,
    inference_job,
    merge_pipeline_stages,
    one_device_steps,
    one_thread,
    relative_error,
    train_job,
)
from tests.training.test_muon import MUON  # noqa: E402
from threefold.arguments import parse_args  # noqa: E402
from threefold.checkpoint.save import save_checkpoint  # noqa: E402
from threefold.config import Config  # noqa: E402

FOUR = ["--num-layers", "4"]
LLAMA = LLAMA_STYLE + FOUR
MIXTURE = LLAMA + MOE + ["--moe-router-topk", "2"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
DEEPSEEK = (
    MLA
    + FOUR
    + MOE
    + ["--moe-router-topk", "2", "--mtp-num-layers", "1"]
    + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    + ["--moe-shared-expert-intermediate-size", "24", "--moe-layer-freq", "[0,1,1,1]"]
)
# --qk-clip at a threshold the tiny models' scores (about 0.07) pass every step
QK_CLIP = ["--qk-clip", "--qk-clip-threshold", "0.03"]
FEATURES = {
    "gpt2": GPT2_STYLE + FOUR,
    "llama": LLAMA,
    "qk-layernorm": LLAMA + ["--qk-layernorm"],
    "window": LLAMA + WINDOW,
    "llama4": LLAMA + ["--no-rope-freq", "2", "--attention-chunk-size", "4"],
    "mla": MLA + FOUR,
    "dsa": DSA + FOUR,
    "mtp": LLAMA + ["--mtp-num-layers", "1"],
    "moe": MIXTURE,
    "moe-alltoall": MIXTURE
    + ["--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
    + ["--moe-shared-expert-intermediate-size", "24"],
    "moe-deepseek": MIXTURE
    + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    + ["--moe-router-bias-update-rate", "0.01", "--moe-router-num-groups", "2"]
    + ["--moe-router-group-topk", "1", "--moe-router-load-balancing-type", "seq_aux_loss"],
    "moe-capacity": MIXTURE
    + ["--moe-expert-capacity-factor", "1.0"]
    + ["--moe-pad-expert-input-to-capacity"],
    "moe-capacity-position": MIXTURE
    + ["--moe-expert-capacity-factor", "0.75"]
    + ["--moe-token-drop-policy", "position"],
    "moe-latent": MIXTURE + ["--moe-latent-size", "16"],
    "moe-every-other": MIXTURE + ["--moe-layer-freq", "[0,1,0,1]"],
    "moe-sinkhorn": LLAMA
    + ["--num-experts", "4", "--moe-ffn-hidden-size", "32"]
    + ["--moe-router-topk", "2", "--moe-router-load-balancing-type", "sinkhorn"],
    "moe-global-aux": MIXTURE + ["--moe-router-load-balancing-type", "global_aux_loss"],
    "moe-shared-overlap": MIXTURE
    + ["--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-overlap"]
    + ["--moe-shared-expert-intermediate-size", "24"],
    "moe-probs-on-input": LLAMA + MOE + ["--moe-router-topk", "1", "--moe-apply-probs-on-input"],
    "moe-mtp": MIXTURE + ["--mtp-num-layers", "1"],
    "deepseek": DEEPSEEK,
    "qwen3-next": LLAMA
    + GDN
    + ["--linear-attention-freq", "2", "--attention-output-gate"]
    + MOE
    + ["--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "24"]
    + ["--moe-shared-expert-gate"],
    "mamba-moe": LLAMA_STYLE + ["--hybrid-layer-pattern", "M*EM", *MAMBA, *MOE],
    "gpt-oss": GPT_OSS + FOUR + MOE + ["--moe-router-topk", "2"],
    "gdn": LLAMA + GDN + ["--linear-attention-freq", "2"],
    "mamba": LLAMA_STYLE + ["--hybrid-layer-pattern", "M*-M", *MAMBA],
    "gate-softcap": LLAMA + ["--attention-output-gate", "--attn-logit-softcapping", "30"],
    "layernorm-1p": LLAMA
    + ["--normalization", "LayerNorm", "--apply-layernorm-1p", "--rotary-interleaved"],
    "documents": LLAMA
    + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "15", "--reset-attention-mask"]
    + ["--reset-position-ids", "--eod-mask-loss"],
    "recompute-selective": LLAMA + ["--recompute-granularity", "selective"],
    "cpu-offloading": LLAMA + ["--cpu-offloading-num-layers", "1"],
    "muon": LLAMA + MUON,
    "mup": LLAMA + ["--use-mup", "--mup-base-hidden-size", "8"],
    "clip-small": LLAMA + ["--clip-grad", "0.05"],
    "decoupled-lr": LLAMA + ["--decoupled-lr", "1e-2", "--decoupled-min-lr", "1e-3"],
    "lora": LLAMA + ["--lora-rank", "4"],
    "lora-mla": MLA + FOUR + ["--lora-rank", "4"],
    "lora-moe": MIXTURE + ["--lora-rank", "4"],
    "lora-moe-frozen-experts": MIXTURE
    + ["--lora-rank", "4", "--lora-freeze-experts", "--lora-target-modules", "linear_qkv"],
    "recompute-full": LLAMA + FULL_RECOMPUTE + ["--recompute-num-layers", "1"],
    "per-token-loss": LLAMA + ["--calculate-per-token-loss"],
    "qk-clip": LLAMA + QK_CLIP,
    "qk-clip-deepseek": DEEPSEEK + QK_CLIP,
}
TP2 = ["--tensor-model-parallel-size", "2"]
SP = ["--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
FSDP = ["--distributed-strategy", "fsdp"]
OVERLAP = ["--tp-comm-overlap"]
LAYOUTS = {
    "tp2": (2, TP2),
    "tp2-sp": (2, TP2 + SP),
    "pp2": (2, PP2),
    "vpp2": (2, PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "cp2-p2p": (2, CP2),
    "cp2-a2a": (2, CP2 + ["--cp-comm-type", "a2a"]),
    "cp2-allgather": (2, CP2 + ["--cp-comm-type", "allgather"]),
    "pp2-uneven": (2, PP2 + ["--decoder-first-pipeline-num-layers", "1"]),
    "pp2-embedding": (
        2,
        PP2
        + ["--account-for-embedding-in-pipeline-split"]
        + ["--account-for-loss-in-pipeline-split"],
    ),
    "dp2": (2, []),
    "dp2-distopt": (2, DISTOPT + ["--overlap-grad-reduce", "--overlap-param-gather"]),
    "fsdp2": (2, FSDP),
    "ep2": (2, EP2),
    "tp2-pp2": (4, TP2 + SP + PP2),
    "tp2-cp2": (4, TP2 + SP + CP2),
    "pp2-cp2": (4, PP2 + CP2),
    "tp2-ep2": (4, TP2 + SP + EP2),
    "cp2-ep2": (4, CP2 + EP2),
    "pp2-ep2": (4, PP2 + EP2),
    "tp2-ep2-etp1": (4, TP2 + SP + EP2 + ["--expert-tensor-parallel-size", "1"]),
    "vpp2-tp2": (4, TP2 + SP + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "cp4-hierarchical": (
        4,
        ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"]
        + ["--hierarchical-context-parallel-sizes", "2", "2"],
    ),
    "dp4-instances": (4, DISTOPT + ["--num-distributed-optimizer-instances", "2"]),
    "tp2-pp2-cp2": (8, TP2 + SP + PP2 + CP2),
    "tp2-pp2-ep2": (8, TP2 + SP + PP2 + EP2),
    # PyTorch's DDP and FSDP2 around threefold's TP, PP, CP and EP
    "ddp2": (2, ["--distributed-strategy", "ddp"]),
    "fsdp2-ep2": (2, FSDP + EP2),
    "fsdp2-tp2": (4, FSDP + TP2 + SP),
    "fsdp2-pp2": (4, FSDP + PP2),
    "fsdp2-cp2": (4, FSDP + CP2),
    "fsdp2-tp2-ep2-etp1": (4, FSDP + TP2 + SP + EP2 + ["--expert-tensor-parallel-size", "1"]),
    # --tp-comm-overlap: each sequence-parallel collective a ring of slices around its GEMM
    "tp2-overlap": (2, TP2 + SP + OVERLAP),
    "tp4-overlap": (4, ["--tensor-model-parallel-size", "4"] + SP + OVERLAP),
    "tp2-pp2-overlap": (4, TP2 + SP + PP2 + OVERLAP),
    "tp2-ep2-overlap": (4, TP2 + SP + EP2 + OVERLAP),
}
EQUAL, CLOSE = 1e-5, 1e-3
EVALUATION = ["--eval-iters", "1", "--eval-interval", "1000"]  # one batch, after the steps
# Features whose result depends on data parallelism by definition: at DP > 1 a cell that
# differs is `as defined`, with the reason, not DIFFERS.
BY_DATA_PARALLELISM = {
    "moe-global-aux": "global_aux_loss counts every data-parallel replica's micro-batches of "
    "the step so far (megatron-core's definition): at DP=N each count holds N of them"
}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _parse(argv: list[str], world: int) -> tuple[Config | None, str | None]:
    """The layout's config, or parse_args' one line refusing it."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parse_args(argv, world_size=world), None
    except SystemExit:
        return None, _last_line(stderr.getvalue())


def _errors(results: list[dict], reference: dict) -> tuple[float, float, str]:
    """The largest relative error of a loss (a step's or the validation's) on any rank, of a
    parameter, and the parameter's name."""
    loss = max(
        abs(a - e) / abs(e)
        for result in results
        for a, e in zip(
            [*result["losses"], result["valid"]],
            [*reference["losses"], reference["valid"]],
            strict=True,
        )
    )
    params = merge_pipeline_stages([r["params"] for r in results])
    if params.keys() != reference["params"].keys():
        return loss, float("inf"), "names differ"
    errors = {n: relative_error(params[n], reference["params"][n]) for n in params}
    worst = max(errors, key=errors.get)
    return loss, errors[worst], worst


def _ranks_refusal(failure: AssertionError) -> tuple[str, str]:
    """A rank's traceback: the refusal's line, or an error."""
    text = str(failure)
    line = _last_line(text)
    return ("refused" if "SystemExit" in text or "error: " in line else "ERROR"), line


def cell(feature: str, argv: list[str], world: int, reference: dict, steps: int) -> tuple[str, str]:
    config, refused = _parse(argv, world)
    if config is None:
        return "refused", refused
    try:
        results = run_distributed(world, train_job, argv, steps)
    except AssertionError as failure:
        return _ranks_refusal(failure)
    loss, params, worst = _errors(results, reference)
    verdict = "equal" if max(loss, params) <= EQUAL else "close"
    if max(loss, params) > CLOSE:
        verdict = "DIFFERS"
    return _as_defined(
        feature, config, verdict, f"loss {loss:.1e}, parameters {params:.1e} ({worst})"
    )


def _as_defined(feature: str, config: Config, verdict: str, what: str) -> tuple[str, str]:
    """A cell that differs where data parallelism defines the feature's result: `as
    defined`, with the reason."""
    if verdict == "DIFFERS" and feature in BY_DATA_PARALLELISM:
        if config.parallel.data_parallel_size > 1:
            return "as defined", f"{what}: {BY_DATA_PARALLELISM[feature]}"
    return verdict, what


def training_cells(feature: str, base: list[str], layouts: list[str], steps: int):
    """(layout, ranks, verdict, what) of each training cell of a feature (`base`: its
    flags)."""
    with one_thread():
        reference = train_job(base, steps)
    for layout in layouts:
        world, flags = LAYOUTS[layout]
        yield layout, world, *cell(feature, base + flags, world, reference, steps)


def _param_gather(flags: list[str], base: list[str]):
    """--fp8-param-gather at a layout: (the layout's flags, its job, one process's flags and
    what both record). Under FSDP2 the flag alone, the weights read as the run without it;
    otherwise with the distributed optimizer, its fp32 masters read, one process's on one rank
    of it (which trains bitwise as without the flag: tests/parallel/test_fp8_param_gather.py)."""
    if "fsdp" in flags:
        return flags + ["--fp8-param-gather"], fp8_train_job, base, _weights_and_scaling
    return flags + PARAM_GATHER, param_gather_job, base + PARAM_GATHER, _masters_and_scaling


def fp8_cells(recipe: str, param_gather: bool = False):
    """The training cells of an FP8 recipe (tests/parallel/test_fp8.py's): each step of the
    layout against one process's step from the layout's checkpoint of its start, the first
    from one process's initialization (FP8 rounding makes longer runs chaotic). `equal`: every
    step within that test's bounds (the loss, the median and the worst parameter tensor after
    it, the scaling state: scales and amax histories). `close`: the loss and the worst tensor
    within them, the median tensor and the scaling state within 1e-3, where a reordered fp32
    sum put one element across an FP8 rounding boundary and the step carried it on (a missing
    amax reduction is off by 1e-2 in the median tensor, 0.3 in the scaling state, 2e-5 in
    the loss). The steps' marks follow the numbers, which are the worst step's.
    `param_gather`: every layout with --fp8-param-gather (`_param_gather`); a cell whose
    weights are not stored in FP8 after the steps is an ERROR."""
    state_tolerance = 1e-5 if recipe == "delayed" else 0.0

    def mark(loss: float, step: dict) -> str:
        if loss > LOSS_TOLERANCE or step["worst"] > PARAMETER_TOLERANCE:
            return "X"
        if step["median"] <= MEDIAN_PARAMETER_TOLERANCE and step["state"] <= state_tolerance:
            return "="
        return "~" if max(step["median"], step["state"]) <= CLOSE else "X"

    def cells(feature: str, base: list[str], layouts: list[str], steps: int):
        base = base + RECIPES[recipe]
        for layout in layouts:
            world, flags = LAYOUTS[layout]
            job, one, record = fp8_train_job, base, _weights_and_scaling
            if param_gather:
                flags, job, one, record = _param_gather(flags, base)
            argv = base + flags
            config, refused = _parse(argv, world)
            if config is None:
                yield layout, world, "refused", refused
                continue
            with tempfile.TemporaryDirectory() as directory:
                try:
                    results = run_distributed(world, job, argv, steps, None, directory)
                except AssertionError as failure:
                    yield layout, world, *_ranks_refusal(failure)
                    continue
                if not all(r.get("stored_in_fp8", True) for r in results):
                    yield layout, world, "ERROR", "--fp8-param-gather: weights not kept in FP8"
                    continue
                try:
                    reference = one_device_steps(one, steps, directory, record)
                except Exception as error:  # (one process could not take the layout's state)
                    yield layout, world, "ERROR", f"one process: {_last_line(repr(error))}"
                    continue
            steps_seen = []
            for step, expected in enumerate(reference["after"]):
                loss = max(abs(r["losses"][step] / reference["losses"][step] - 1) for r in results)
                found = step_errors([r["after"][step] for r in results], expected)
                steps_seen.append((mark(loss, found), loss, found))
            marks = [m for m, _, _ in steps_seen]
            verdict = "DIFFERS" if "X" in marks else "close" if "~" in marks else "equal"
            order = {"X": 2, "~": 1, "=": 0}
            _, loss, worst = max(steps_seen, key=lambda s: (order[s[0]], s[2]["median"]))
            what = (
                f"steps {''.join(marks)}; loss {loss:.1e}, parameters: median "
                f"{worst['median']:.1e}, worst {worst['worst']:.1e} ({worst['name']}); "
                f"scaling state {worst['state']:.1e}"
            )
            yield layout, world, *_as_defined(feature, config, verdict, what)

    return cells


# The tools' layouts (tools/generate.py, tools/score.py): (pipeline stages, TP)
INFERENCE_LAYOUTS = {"tp2": (1, 2), "pp2": (2, 1), "tp2-pp2": (2, 2), "tp4": (1, 4)}
PROMPT = [1, 2, 3, 4]
TEXT = [(7 * i + 3) % 15 for i in range(40)]  # (15: the smallest vocabulary of FEATURES)


def inference_cells(feature: str, base: list[str], layouts: list[str], steps: int):
    """(layout, ranks, verdict, what) of each inference cell of a feature: the model trained
    `steps` steps in this process and saved, then its greedy continuation of PROMPT and its
    loss on TEXT by the tools' path at each layout, against one device's."""
    with tempfile.TemporaryDirectory() as directory, one_thread():
        trainer = _setup(base)
        for _ in range(steps):
            trainer.train_step()
        save_checkpoint(directory, trainer.checkpoint_components())
        expected_ids, expected_loss = inference_job(directory, 1, 1, PROMPT, TEXT)
        for layout in layouts:
            pipeline, tensor = INFERENCE_LAYOUTS[layout]
            try:
                results = run_distributed(
                    pipeline * tensor, inference_job, directory, pipeline, tensor, PROMPT, TEXT
                )
            except AssertionError as failure:
                line = _last_line(str(failure))
                verdict = "refused" if line.startswith(REFUSALS) else "ERROR"
                yield layout, pipeline * tensor, verdict, line
                continue
            error = max(abs(loss - expected_loss) / expected_loss for _, loss in results)
            same = all(ids == expected_ids for ids, _ in results)
            verdict = "equal" if same and error <= EQUAL else "close" if same else "DIFFERS"
            if error > CLOSE:
                verdict = "DIFFERS"
            what = f"loss {error:.1e}, {'the same' if same else 'other'} greedy tokens"
            yield layout, pipeline * tensor, verdict, what


# Resharding: a checkpoint saved at the layout resumed in one process, and one saved in one
# process resumed at the layout (tests/training/test_resharding.py's jobs: 3 steps, a save,
# one step more)
RESHARDING_LAYOUTS = [
    *("tp2-sp", "pp2", "vpp2", "cp2-p2p", "dp2-distopt", "fsdp2", "ep2", "tp2-pp2"),
    *("tp2-ep2-etp1", "dp4-instances", "tp2-pp2-ep2", "tp4-overlap"),
]


def _resumed_error(continued: list[dict], resumed: list[dict]) -> tuple[float, float]:
    """The largest relative error of the resumed step's loss and of a parameter after it."""
    expected = continued[0]["loss"]
    loss = max(abs(r["loss"] - expected) / abs(expected) for r in resumed)
    params = merge_pipeline_stages([r["params"] for r in resumed])
    reference = merge_pipeline_stages([c["params"] for c in continued])
    if params.keys() != reference.keys():
        return loss, float("inf")
    return loss, max(relative_error(params[n], reference[n]) for n in params)


def resharding_cells(feature: str, base: list[str], layouts: list[str], steps: int):
    """(layout, ranks, verdict, what) of each resharding cell of a feature (`steps`: the
    jobs' own 3)."""
    from tests.training.test_resharding import _load_then_step, _save_then_continue

    with tempfile.TemporaryDirectory() as root, one_thread():
        alone = os.path.join(root, "one")
        continued_alone = [_save_then_continue(base, alone)]
        for layout in layouts:
            world, flags = LAYOUTS[layout]
            config, refused = _parse(base + flags, world)
            if config is None:
                yield layout, world, "refused", refused
                continue
            there = os.path.join(root, layout)
            try:
                continued = run_distributed(world, _save_then_continue, base + flags, there)
                to_one = _resumed_error(continued, [_load_then_step(base, there)])
                resumed = run_distributed(world, _load_then_step, base + flags, alone)
                from_one = _resumed_error(continued_alone, resumed)
            except AssertionError as failure:
                yield layout, world, "ERROR", _last_line(str(failure))
                continue
            worst = max(*to_one, *from_one)
            verdict = "equal" if worst <= EQUAL else "close" if worst <= CLOSE else "DIFFERS"
            what = (
                f"to one process: loss {to_one[0]:.1e}, parameters {to_one[1]:.1e}; "
                f"from it: loss {from_one[0]:.1e}, parameters {from_one[1]:.1e}"
            )
            yield layout, world, *_as_defined(feature, config, verdict, what)


MARKS = {"equal": "=", "close": "~", "refused": "-", "as defined": "dp", "DIFFERS": "**X**"}


def grid(verdicts: dict[tuple[str, str], str], features: list[str], layouts: list[str]) -> str:
    """The cells as a table of marks, a feature a row: = equal, ~ close, - refused, dp as
    data parallelism defines it, X differs, E error (a feature refused alone: its row blank)."""
    rows = ["| | " + " | ".join(layouts) + " |", "| --- |" + " :-: |" * len(layouts)]
    for feature in features:
        marks = [MARKS.get(verdicts.get((feature, x), ""), "**E**") for x in layouts]
        if "one process" in {x for f, x in verdicts if f == feature}:
            marks = ["" for _ in layouts]
        rows.append(f"| {feature} | " + " | ".join(marks) + " |")
    return "\n".join(rows)


REFUSALS = ("threefold.config.errors.ConfigError: ", "SystemExit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--layouts", help="default: every layout of the mode")
    parser.add_argument("--steps", type=int, default=3)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--inference", action="store_true", help="generation and scoring at the tools' layouts"
    )
    mode.add_argument(
        "--resharding", action="store_true", help="checkpoints saved at a layout resumed alone"
    )
    mode.add_argument(
        "--fp8",
        choices=RECIPES,
        help="training in FP8 with this recipe, a step at a time from the layout's checkpoints",
    )
    parser.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="with --fp8: every layout with --fp8-param-gather (the distributed optimizer's)",
    )
    args = parser.parse_args(argv)
    if args.fp8_param_gather and not args.fp8:
        parser.error("--fp8-param-gather needs --fp8 RECIPE")
    known = INFERENCE_LAYOUTS if args.inference else LAYOUTS
    features = args.features.split(",")
    default = RESHARDING_LAYOUTS if args.resharding else list(known)
    layouts = args.layouts.split(",") if args.layouts else default
    unknown = [f for f in features if f not in FEATURES] + [x for x in layouts if x not in known]
    if unknown:
        parser.error(
            f"unknown: {', '.join(unknown)}; features {list(FEATURES)}, layouts {list(known)}"
        )
    # The table alone on standard output: the trainers' lines (this process's and the ranks',
    # whose fork server starts later and inherits the descriptor) go to /dev/null
    table = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    mode = "inference after" if args.inference else "resharding after" if args.resharding else ""
    if args.fp8:
        mode = f"FP8 ({args.fp8}{', --fp8-param-gather' if args.fp8_param_gather else ''}),"
    print(
        f"{len(features)} features x {len(layouts)} layouts, {mode} {args.steps} steps a cell\n",
        file=table,
    )
    print(
        "| feature | layout | ranks | outcome | | s |\n| --- | --- | ---: | --- | --- | ---: |",
        file=table,
    )
    cells = training_cells
    if args.inference or args.resharding:
        cells = inference_cells if args.inference else resharding_cells
    if args.fp8:
        cells = fp8_cells(args.fp8, args.fp8_param_gather)
    counts: dict[str, int] = {}
    verdicts: dict[tuple[str, str], str] = {}
    try:
        for feature in features:
            start = time.monotonic()
            base = TRAINING + EVALUATION + FEATURES[feature]  # (a feature's --vocab-size wins)
            _, refused = _parse(base, 1)
            found = cells(feature, base, layouts, args.steps) if refused is None else []
            if refused is not None:  # (a feature this bench's flags got wrong)
                found = [("one process", 1, "refused", refused)]
            for layout, world, verdict, what in found:
                counts[verdict] = counts.get(verdict, 0) + 1
                verdicts[feature, layout] = verdict
                seconds, start = time.monotonic() - start, time.monotonic()
                print(
                    f"| {feature} | {layout} | {world} | {verdict} | {what} | {seconds:.0f} |",
                    file=table,
                )
    finally:
        close_pools()
    print("\n" + ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items())), file=table)
    print("\n" + grid(verdicts, features, layouts), file=table)
    return 1 if counts.get("DIFFERS") or counts.get("ERROR") else 0


if __name__ == "__main__":
    raise SystemExit(main())
