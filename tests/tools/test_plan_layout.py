"""tools/plan_layout.py and the step-time model it ranks layouts with
(threefold/training/step_time.py): its memory is bench/memory_table.py's, its launch command
rebuilds the layout it names, its H100 constants are the calibrated ones and its 1B
prediction is within 15% of the measured benchmark."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import memory_table  # noqa: E402
from plan_calibration import calibrate  # noqa: E402
from plan_layout import RECOMPUTE, Planner, cluster_args, layout_flags  # noqa: E402

from threefold.arguments import parse_args  # noqa: E402
from threefold.training.memory_estimate import estimate_memory  # noqa: E402
from threefold.training.step_time import H100, predict_step_time  # noqa: E402

GIB = 2**30
ARGS = cluster_args()


def _planner(model: str, gpus: int) -> Planner:
    base = [*memory_table.LLAMA, *memory_table.MODELS[model]]
    return Planner(base, base, gpus, 8, ARGS)


def _published_memory() -> dict[tuple[str, str], float]:
    with open(os.path.join(ROOT, "bench", "results", "memory_table.md")) as file:
        first_table = file.read().split("\n\n")[0]  # the FP8 table follows
        rows = [line.split("|")[1:-1] for line in first_table.splitlines()]
        rows = [row for row in rows if row[0].startswith(" LLaMA")]
    return {(row[0].strip(), row[5].strip()): float(row[10]) for row in rows}


def test_the_planners_memory_is_the_memory_tables():
    published = _published_memory()
    assert len(published) == 8
    for (model, variant), total in published.items():
        gpus, tp, pp = memory_table.RECOMMENDED[model]
        flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
        config = _planner(model, gpus).config(flags + memory_table.VARIANTS[variant])
        assert round(estimate_memory(config).total / GIB, 1) == total, (model, variant)


@pytest.mark.parametrize(
    "model, gpus", [("LLaMA-2 7B", 8), ("LLaMA-2 13B", 16), ("LLaMA-2 70B", 64)]
)
def test_plans_fit_and_their_flags_rebuild_them(model, gpus):
    planner = _planner(model, gpus)
    plans = planner.plans()
    assert plans, "no layout fits"
    steps = [plan.step.total for plan in plans]
    assert steps == sorted(steps) or all(
        float(f"{a:.3g}") <= float(f"{b:.3g}") for a, b in zip(steps, steps[1:])
    )
    for plan in plans[:5]:
        assert plan.memory_gib <= 72.0
        with contextlib.redirect_stdout(io.StringIO()):
            rebuilt = parse_args(planner.base + plan.flags, world_size=gpus)
        assert estimate_memory(rebuilt).total / GIB == pytest.approx(plan.memory_gib, rel=1e-9)
        assert rebuilt.parallel.layout() == plan.config.parallel.layout()
    # A replicated-optimizer-sized 70B never fits a GPU: the plans shard its state.
    if model == "LLaMA-2 70B":
        assert all(
            plan.config.parallel.use_distributed_optimizer
            or plan.config.parallel.distributed_strategy == "fsdp"
            for plan in plans
        )


def test_h100_constants_are_the_calibrated_ones_and_the_1b_step_is_within_15_percent():
    constants, check = calibrate()
    for name, value in constants.items():
        assert getattr(H100, name) == pytest.approx(value, abs=0.002 if value < 1 else 10), name
    assert abs(check["predicted"] / check["measured"] - 1) < 0.15, check


def test_the_step_time_model_prices_each_kind_of_parallelism():
    planner = _planner("LLaMA-2 13B", 16)

    def step(*flags: str, **hardware):
        config = planner.config(list(flags))
        assert config is not None, flags
        machine = dataclasses.replace(planner.hardware, **hardware)
        return predict_step_time(config, machine, planner.gpus_per_node)

    tp1 = step(*layout_flags(1, 1, 2, None, 1, 40), "--use-distributed-optimizer")
    assert tp1.tensor_parallel == 0 and tp1.bubble > 0 and tp1.pipeline_sends > 0
    tp2 = step(*layout_flags(2, 1, 2, None, 1, 40), "--use-distributed-optimizer")
    assert tp2.tensor_parallel > 0
    # Virtual stages shrink the bubble and multiply the sends.
    vpp = step(*layout_flags(1, 1, 2, 4, 1, 40), "--use-distributed-optimizer")
    assert vpp.bubble == pytest.approx(tp1.bubble / 4) and vpp.pipeline_sends > tp1.pipeline_sends
    # Overlapping the distributed optimizer's collectives hides them; a slower network shows.
    flags = [*layout_flags(1, 1, 1, None, 1, 40), "--use-distributed-optimizer"]
    exposed = step(*flags, inter_node_gbps=5.0)
    hidden = step(*flags, "--overlap-grad-reduce", "--overlap-param-gather", inter_node_gbps=5.0)
    assert exposed.data_parallel > hidden.data_parallel
    assert step(*flags, inter_node_gbps=45.0).data_parallel < exposed.data_parallel
    # Full recomputation costs compute.
    full = step(*flags, *RECOMPUTE["full"])
    assert full.compute > step(*flags).compute


def test_the_tool_plans_a_hugging_face_config_and_an_moe_model(tmp_path):
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    tool = [sys.executable, os.path.join(ROOT, "tools", "plan_layout.py")]
    result = subprocess.run(
        [*tool, "--gpus", "8", "--hf-config", str(tmp_path / "config.json")]
        + ["--seq-length", "4096", "--global-batch-size", "64", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    (command,) = re.findall(r"^torchrun .*$", result.stdout, re.MULTILINE)
    assert "--num-layers 16 --hidden-size 2048" in command and "--num-query-groups 8" in command
    mixtral = subprocess.run(
        [*tool, "--gpus", "16", "--num-layers", "8", "--hidden-size", "1024"]
        + ["--num-attention-heads", "16", "--num-experts", "8", "--moe-router-topk", "2"]
        + ["--moe-grouped-gemm", "--swiglu", "--disable-bias-linear", "--vocab-size", "32000"]
        + ["--seq-length", "2048", "--global-batch-size", "64", "--top", "50"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert mixtral.returncode == 0, mixtral.stderr
    rows = [line for line in mixtral.stdout.splitlines() if re.match(r"^ +\d+  TP=", line)]
    assert len(rows) == 50 and any("EP=8" in row for row in rows)
    # an expert-parallel layout pays for its all-to-alls (the last breakdown column)
    expert_parallel = [float(row.split("/")[-1].split()[0]) for row in rows if "EP=" in row]
    assert expert_parallel and all(seconds > 0 for seconds in expert_parallel)


SMALL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
SMALL = (SMALL + "--global-batch-size 8").split()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--gpus", "0", *SMALL], "argument --gpus: give a positive number, not 0"),
        (["--gpus", "-8", *SMALL], "argument --gpus: give a positive number, not -8"),
        (
            ["--gpus", "8", "--gpu-memory-gib", "nan", *SMALL],
            "argument --gpu-memory-gib: give a positive number, not nan",
        ),
        (
            ["--gpus", "8", "--memory-fraction", "1.5", *SMALL],
            "--memory-fraction 1.5: give a share above 0, at most 1",
        ),
        (
            ["--gpus", "8", *SMALL],
            "the vocabulary size is unknown: pass --vocab-size or a tokenizer",
        ),
        (
            ["--gpus", "8", "--hf-config", "{config}"],
            "--hf-config {config}: not a JSON config (Expecting value: line 1 column 1 (char 0))",
        ),
    ],
)
def test_a_cluster_or_model_no_layout_can_be_planned_on_is_one_line(argv, line, tmp_path, capsys):
    """(before: a ZeroDivisionError, an AttributeError or a ConfigError's traceback)"""
    from plan_layout import main

    config = tmp_path / "config.json"
    config.write_text("not JSON")
    argv = [arg.format(config=config) for arg in argv]
    try:
        code = main(argv)
    except SystemExit as refused:  # (argparse's, for a flag's own value)
        code = refused.code
    assert code == 2
    assert capsys.readouterr().err == f"plan_layout.py: error: {line.format(config=config)}\n"


def test_a_cluster_whose_data_parallelism_alone_cannot_split_the_batch_is_planned(capsys):
    """8 GPUs, a batch of 4 in micro-batches of 2: DP=8 alone cannot take it, layouts of TP
    or PP with DP up to 4 (micro-batches of 1) can. (before: an AttributeError's traceback:
    the cluster's base config, at DP=8, was refused and read as None)"""
    from plan_layout import main

    flags = SMALL[:-1] + ["4", "--micro-batch-size", "2", "--vocab-size", "100"]
    assert main(["--gpus", "8", *flags]) == 0
    rows = [row for row in capsys.readouterr().out.splitlines() if ", DP=" in row]
    assert rows and all(int(row.split("DP=")[1].split()[0]) <= 4 for row in rows)


def test_a_pretraining_commands_own_layout_is_left_out_and_said_so(capsys):
    """A launch script's flags pasted whole: its layout (TP2 with sequence parallelism, the
    distributed optimizer, micro-batches of 2 as `--flag=value`) is what the plans choose.
    (before: refused, "world size 1 is not divisible by --tensor-model-parallel-size 2 ...
    launch a multiple of 2 processes"; without TP, the printed command held
    --micro-batch-size twice, the user's and the plan's)"""
    from plan_layout import main

    yours = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    yours += ["--micro-batch-size=2", "--use-distributed-optimizer"]
    assert main(["--gpus", "8", *SMALL, "--vocab-size", "100", *yours, "--bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"> the plans choose the layout; left out of yours: {' '.join(yours)}"
    command = out[-1].split()
    assert command[0] == "torchrun" and command.count("--bf16") == 1
    assert "--micro-batch-size=2" not in command
    for flag in (
        "--micro-batch-size",
        "--tensor-model-parallel-size",
        "--use-distributed-optimizer",
    ):
        assert command.count(flag) == 1, flag


@pytest.mark.parametrize(
    "text, line",
    [
        ("[1, 2]", "not a JSON config (a list)"),
        ('{"model_type": "llama"}', "no 'num_attention_heads' field, which LlamaForCausalLM needs"),
        (
            '{"model_type": "llama", "hidden_size": "64", "num_attention_heads": 4, '
            '"num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}',
            "a field LlamaForCausalLM reads has a value of the wrong type (unsupported operand "
            "type(s) for //: 'str' and 'int')",
        ),
    ],
    ids=["a list", "a field missing", "a text for a number"],
)
def test_a_hugging_face_config_that_is_no_models_is_one_line(text, line, tmp_path, capsys):
    """plan_layout.py --hf-config and convert_checkpoint.py --loader hf read config.json
    alike (threefold/checkpoint/hf.read_hf_config). (before: a KeyError's, TypeError's or
    AttributeError's traceback)"""
    from plan_layout import main

    config = tmp_path / "config.json"
    config.write_text(text)
    assert main(["--gpus", "8", "--hf-config", str(config), *SMALL]) == 2
    assert capsys.readouterr().err == f"plan_layout.py: error: --hf-config {config}: {line}\n"


def test_the_collective_fit_recovers_latency_and_bandwidth():
    import collectives

    from threefold.training.step_time import _ring

    points = [(size, 50e-6 + size / 20e9) for size in (1e6, 4e6, 16e6)]
    latency, bandwidth = collectives.fit(points)
    assert latency == pytest.approx(50e-6) and bandwidth == pytest.approx(20e9)
    # the benchmark's ring factor is the one the step-time model charges
    machine = dataclasses.replace(H100, latency_us=0.0)
    for ranks in (2, 4, 8):
        expected = collectives.ring_factor("all_gather", ranks) * 1e9 / 100e9
        assert _ring(1e9, ranks, 100.0, machine) == pytest.approx(expected)


def test_the_tool_plans_a_hybrid_from_its_hugging_face_config(tmp_path):
    """A Nemotron-H config.json (Mamba, attention and MLP layers): the plans fit their memory
    estimate, the command carries the pattern, and the tool says what its step times leave out."""
    hf = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M-M-M*-M-M-M*-",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "vocab_size": 131072,
        "max_position_embeddings": 8192,
        "layer_norm_epsilon": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "plan_layout.py"), "--gpus", "8"]
        + ["--hf-config", str(tmp_path / "config.json"), "--seq-length", "8192"]
        + ["--global-batch-size", "64", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "> a hybrid model: its memory is estimated layer by layer" in result.stdout
    (command,) = re.findall(r"^torchrun .*$", result.stdout, re.MULTILINE)
    assert "--hybrid-layer-pattern M-M-M*-M-M-M*-" in command, command
