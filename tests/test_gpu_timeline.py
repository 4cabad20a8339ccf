"""bench/gpu_timeline.py reads a profiler trace as a GPU run writes it: each kernel's kind
from the operator that launched it, busy time as the union over streams, and each idle gap
put down to the host (the next kernel launched after the GPU ran dry) or the device."""

import gzip
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_timeline  # noqa: E402

HOST, DEVICE = 100, 0  # the trace's pids: the process, and GPU 0


def _op(name, ts, dur, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": HOST, "tid": 1, "ts": ts, "dur": dur}


def _launch(correlation, ts):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "pid": HOST,
        "tid": 1,
        "ts": ts,
        "dur": 2,
        "args": {"correlation": correlation},
    }


def _kernel(name, correlation, ts, dur, stream=7, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": DEVICE,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": correlation, "stream": stream},
    }


def _trace():
    """A step of five device events on two streams, µs on one clock:

    host: aten::linear [0, 30) holding aten::mm [2, 10) and aten::_scaled_mm [12, 20);
          Optimizer.step [200, 260) holding aten::_fused_adamw_ [205, 215)
    GPU:  mm's kernel [10, 40), the FP8 GEMM (cuBLAS names it nvjet too) [40, 90),
          an Inductor kernel on stream 8 [60, 100) (overlaps), a gap the host caused
          (adamw launched at 210, after the GPU ran dry at 100) until [210, 230), a gap the
          device caused (a copy queued at 25, waiting) until [250, 260)"""
    return [
        _op("aten::linear", 0, 30),
        _op("aten::mm", 2, 8),
        _launch(1, 5),
        _op("aten::_scaled_mm", 12, 8),
        _launch(2, 15),
        _launch(3, 22),  # in aten::linear only: its innermost operator
        _launch(4, 25),  # the copy's launch
        _op("Optimizer.step#AdamW.step", 200, 60, cat="user_annotation"),
        _op("aten::_fused_adamw_", 205, 10),
        _launch(5, 210),
        _kernel("nvjet_sm90_tst_256x128_h_bz_TNT", 1, 10, 30),
        _kernel("nvjet_sm90_qqtst_128x256_v_bz_TNN", 2, 40, 50),
        _kernel("triton_poi_fused_add_copy_19", 3, 60, 40, stream=8),
        _kernel("Memcpy HtoD (Pageable -> Device)", 4, 250, 10, cat="gpu_memcpy"),
        _kernel("void at::native::multi_tensor_apply_kernel<...>", 5, 210, 20),
    ]


def test_kernels_are_kinded_by_the_operator_that_launched_them():
    events = {e.name: e for e in gpu_timeline.device_events(_trace())}
    assert [(e.kind, e.operator) for e in events.values()] == [
        ("GEMMs (16/32-bit)", "aten::mm"),
        ("FP8 GEMMs", "aten::_scaled_mm"),  # named nvjet like the 16-bit ones
        ("Triton (Inductor: compiled graphs)", "aten::linear"),
        ("optimizer", "aten::_fused_adamw_"),
        ("copies and fills", "aten::linear"),
    ]
    # without a launch in the trace the name decides
    assert gpu_timeline.kind_of("nvjet_sm90_tst_256x128", "") == "GEMMs (16/32-bit)"
    assert gpu_timeline.kind_of("_cast_transpose", "") == "threefold's Triton FP8 casts"
    assert gpu_timeline.kind_of("ncclDevKernel_AllGather", "aten::mm") == "communication (NCCL)"
    assert gpu_timeline.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash", "") == "attention"


def test_busy_time_is_the_union_over_streams_and_each_gap_has_its_cause():
    busy, gaps = gpu_timeline.gaps(gpu_timeline.device_events(_trace()))
    assert busy == 90 + 20 + 10  # [10, 100), [210, 230), [250, 260)
    assert [(g.start, g.end, g.host) for g in gaps] == [(100, 210, True), (230, 250, False)]
    assert gaps[0].before.name.startswith("triton_")  # the piece's last end, on stream 8
    assert gaps[1].after.name.startswith("Memcpy")


def test_the_report_gives_the_time_a_step_and_the_longest_gaps(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": _trace()}, file)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_timeline.py"), str(path), "--steps", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = result.stdout
    assert "window 0.2 ms a step, busy 0.1 ms (48.0%)" in text  # 120 of 250 µs
    assert "| FP8 GEMMs | 0.05 | 41.7% | 1 |" in text
    assert "| host late (next kernel launched after the GPU ran dry) | 0.11 | 44.0% | 1 |" in text
    assert "| queued but waiting (streams, events, host copies) | 0.02 | 8.0% | 1 |" in text
    longest = text.split("longest gaps:")[1].strip().splitlines()[2]
    assert longest.startswith("| 110 | 0.09 | host | triton_poi_fused_add_copy_19 |")
    assert longest.endswith("| aten::_fused_adamw_ |")
    assert gpu_timeline.report([_op("aten::mm", 0, 5)], 1).startswith("no GPU kernels")


def test_two_traces_compared_by_kind_and_by_kernel():
    """--against: the FP8 GEMM 10 µs slower in the second trace shows as its kind's change
    and as the kernel that changed most, with its launches."""
    slower = _trace()
    slower[11] = _kernel("nvjet_sm90_qqtst_128x256_v_bz_TNN", 2, 40, 40)  # 50 µs -> 40 here
    text = gpu_timeline.compare(_trace(), slower, steps=1)
    assert "| FP8 GEMMs | 0.05 | 0.04 | +0.01 |" in text
    kernels = text.split("| kernel |")[1].splitlines()
    assert kernels[2] == "| nvjet_sm90_qqtst_128x256_v_bz_TNN | 0.05 | 0.04 | +0.01 | 1 vs 1 |"


def test_gpu_profile_writes_the_trace_it_reads(tmp_path):
    """The profile phase of a lent GPU's call (bench/gpu_session.sh), on the tiny model: the
    trace is written, holds the step's operators and is read back (no kernels on a CPU)."""
    path = tmp_path / "trace.json.gz"
    script = os.path.join(ROOT, "bench", "gpu_profile.py")
    command = [sys.executable, script, "--tiny", "--steps", "1", "--warmup", "1", "--rows", "3"]
    result = subprocess.run(
        [*command, "--trace", str(path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no GPU kernels in the trace (a CPU run)" in result.stdout
    names = {event.get("name") for event in gpu_timeline.load(str(path))}
    assert "aten::mm" in names
    # --tree: the step as another tree's bench/gpu_mfu.py builds it (a commit's, in .old/REV)
    other = tmp_path / "other"
    (other / "bench").mkdir(parents=True)
    (other / "bench" / "gpu_mfu.py").write_text(OTHER_TREE)
    result = subprocess.run(
        [*command, "--tree", str(other), "--", "--bf16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the other tree's step ('--bf16',)" in result.stdout
    assert f"(threefold of {other})" in result.stdout


# A tree whose bench/gpu_mfu.py builds a step of one matrix product
OTHER_TREE = """
import dataclasses

import torch


@dataclasses.dataclass
class Shape:
    pass


TINY = Shape()


def _threefold(shape, device, bf16, extra=()):
    print("the other tree's step", extra)
    a = torch.ones(8, 8)
    return lambda: float((a @ a).sum())
"""


def test_step_ops_counts_a_step_in_each_tree():
    """bench/step_ops.py, this tree against itself: every count equal, so no operator row."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "step_ops.py"), "--only", "threefold"]
        + ["--trees", ROOT, "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| operator | this tree | this tree |"
    assert rows[1].startswith("| (all) | ") and rows[2].startswith("| loss | ")
    total, again = rows[1].split("|")[2:4]
    assert int(total) == int(again) > 1000
