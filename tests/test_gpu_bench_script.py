"""bench/gpu_mfu.py runs end to end (on the CPU, with its tiny check model): every contender
gets a row, or a reason; the ratio column is the faster threefold run's speed over each
contender's."""

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_gpu_mfu_script_runs_on_a_tiny_model(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "gpu_mfu.py"),
            "--tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--only",
            "threefold",
            "threefold+compile-layers",
            "transformers",
            "megatron-core",
            "torchtitan",
            "threefold+fp8-rowwise",
            "threefold+fp8-blockwise",
            "torchtitan+float8+compile",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "gpu_mfu.md").read_text()
    rows = {
        line.split("|")[1].strip(): line
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| contender")
    }
    for name in ("threefold", "threefold+compile-layers"):
        assert re.match(
            rf"\| {re.escape(name)} \| [\d,]+ \| [\d.]+ \| n/a .* \| [\d.]+ \|$", rows[name]
        )
    # Speed-ups are the faster threefold run's: its own row reads 1.00, the other's at least.
    speedups = sorted(
        float(rows[n].split("|")[-2]) for n in ("threefold", "threefold+compile-layers")
    )
    assert speedups[0] == 1.0 and speedups[1] >= 1.0
    assert re.search(r"\| [\d.]+ \|$", rows["transformers"])
    # threefold's rows carry the estimator's prediction beside the (CPU: unmeasured) peak.
    assert re.search(r"\| n/a \| [\d.]+ \| [\d.]+ -> ", rows["threefold"])
    assert "| n/a | - |" in rows["transformers"]
    assert "not run: RuntimeError: megatron-core's GPTModel needs CUDA" in rows["megatron-core"]
    assert "not run: RuntimeError: torchtitan is not installed" in rows["torchtitan"]
    assert "not run: RuntimeError: torchtitan is not installed" in rows["torchtitan+float8+compile"]
    for recipe in ("rowwise", "blockwise"):
        name = f"threefold+fp8-{recipe}"
        assert re.match(rf"\| {re.escape(name)} \| [\d,]+ \| ", rows[name])
    log = (tmp_path / "threefold.log").read_text()
    assert "> kernels: transformer-impl local;" in log and "RESULT {" in log


def test_gpu_mfu_script_runs_its_mixture_of_experts_leg(tmp_path):
    """--moe: threefold's MoE model and transformers' Mixtral on the same shape, each a row,
    and threefold's rowwise FP8, its experts in FP8."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_mfu.py"), "--tiny", "--moe"]
        + ["--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
        + ["--only", "threefold", "transformers", "threefold+fp8-rowwise"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "gpu_moe.md").read_text()
    assert "'num_experts': 4" in table and "mixture of experts" in table
    for name in ("threefold", "transformers", "threefold\\+fp8-rowwise"):
        assert re.search(rf"^\| {name} \| [\d,]+ \| ", table, re.MULTILINE), table
    log = (tmp_path / "threefold.log").read_text()
    assert " --moe " in log.splitlines()[0] and "RESULT {" in log
    fp8_log = (tmp_path / "threefold_fp8-rowwise.log").read_text()
    assert "expert linear layers via torch._scaled_mm" in fp8_log


def test_the_wide_shape_is_one_torchtitan_builds():
    """--shape 8b-8l's FFN width is what torchtitan's `multiple_of` makes of 8B's hidden size,
    so its rows train the same model as threefold's."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from gpu_contenders import _multiple_of
    from gpu_mfu import WIDE_8B

    assert _multiple_of(WIDE_8B) == 1024 and WIDE_8B.hidden_size == 4096


def test_a_failed_contender_is_reported_by_its_exception_line():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from gpu_mfu import _failure

    log = (
        "$ python gpu_mfu.py --contender torchtitan+compile\n"
        "[rank0]: torch._dynamo.exc.Unsupported: raised NotImplementedError('no backward')\n"
        "[rank0]:   Hint: Your code may result in an error when running in eager.\n"
        "[rank0]: Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace\n\n"
    )
    assert (
        _failure(log) == "torch._dynamo.exc.Unsupported: raised NotImplementedError('no backward')"
    )
    assert _failure("starting\nkilled by signal 9\n") == "killed by signal 9"


def test_compiled_fp8_layers_with_opaque_casts_keep_their_fp8_copies_for_backward():
    """bench/fp8_saved_tensors.py, the reading of what the opaque casts cost on an H100
    (docs/fp8_gpu.md): with the casts Inductor fuses, a compiled FP8 layer saves no FP8 copy
    of its inputs (the partitioner recomputes the casts in backward from what it keeps
    anyway); with the opaque casts, which it cannot recompute, it keeps them. Both hold the
    weights' copies cast for the step; nothing else differs (but a few scalars)."""
    script = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "fp8_saved_tensors.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert script.returncode == 0, script.stderr
    numbers = r"([\d,]+) bytes against ([\d,]+), of which FP8 ([\d,]+) and ([\d,]+)"
    totals = re.search(numbers, script.stdout)
    opaque, fused, opaque_fp8, fused_fp8 = (int(n.replace(",", "")) for n in totals.groups())
    assert opaque_fp8 > fused_fp8 > 0
    # (a few scalars differ: the scales' inverses the two graphs keep)
    assert abs((opaque - fused) - (opaque_fp8 - fused_fp8)) < 0.01 * (opaque_fp8 - fused_fp8)
