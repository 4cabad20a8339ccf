"""bench/layout_matrix.py compares a feature under a layout with the same model in one process
(bench/results/layout_matrix.md): a cell is equal, refused in one line, or differs."""

import re

import torch

from bench.fp8_step_against_fp32 import main, nudge
from bench.layout_matrix import EVALUATION, FEATURES, LAYOUTS, cell, fp8_cells
from tests.parity import TRAINING, one_thread, train_job


def test_a_cell_is_equal_refused_or_differs():
    base = TRAINING + EVALUATION + FEATURES["moe-capacity"]
    with one_thread():
        reference = train_job(base, 2)
    world, flags = LAYOUTS["tp2-sp"]
    verdict, what = cell("moe-capacity", base + flags, world, reference, 2)
    assert verdict == "equal", what
    # another initialization at the same layout: what a wrong layout looks like
    verdict, what = cell("moe-capacity", base + flags + ["--seed", "7"], world, reference, 2)
    assert verdict == "DIFFERS", what
    world, flags = LAYOUTS["ep2"]
    dense = TRAINING + FEATURES["llama"]
    verdict, what = cell("llama", dense + flags, world, reference, 2)
    assert (verdict, what) == (
        "refused",
        "pretrain_gpt.py: error: --expert-model-parallel-size needs a mixture-of-experts model "
        "(--num-experts)",
    )


def test_an_fp8_cell_is_within_the_fp8_tests_bounds_or_differs(monkeypatch):
    """--fp8: each step from the layout's checkpoint of its start, in one process too."""
    world, flags = LAYOUTS["tp2-sp"]
    monkeypatch.setitem(LAYOUTS, "tp2-sp-seed-7", (world, flags + ["--seed", "7"]))
    cells = fp8_cells("delayed")("moe", TRAINING + FEATURES["moe"], ["tp2-sp", "tp2-sp-seed-7"], 2)
    verdicts = {layout: (verdict, what) for layout, _, verdict, what in cells}
    # (close: a CPU whose sums round otherwise may put an element across an FP8 boundary)
    assert verdicts["tp2-sp"][0] in ("equal", "close"), verdicts
    # another initialization: the first step, from one process's own, differs
    assert verdicts["tp2-sp-seed-7"][0] == "DIFFERS", verdicts


def _median_line(output: str) -> tuple[float, float]:
    """(the layout from one process, one process from fp32) of the median tensor's line."""
    line = next(line for line in output.splitlines() if "median tensor" in line)
    numbers = re.findall(r"\d\.\de[+-]\d\d", line)
    return float(numbers[0]), float(numbers[1])


def test_fp8_step_against_fp32_tells_rounding_from_another_quantization(capsys):
    """bench/fp8_step_against_fp32.py: a right layout sits far closer to one process than FP8
    sits to fp32 (here 1e-6 times; where a CPU's rounding puts an element across an FP8
    boundary, 0.02 to 0.15 times); one that skips its amax reduction sits as far."""
    main(["llama", "tp2-sp", "delayed", "--steps", "2", "--nudge", "1"])
    output = capsys.readouterr().out
    apart, fp8_error = _median_line(output)
    assert apart < 0.2 * fp8_error, (apart, fp8_error)
    assert "one process nudged 1 ulp, from one process: " in output
    main(["llama", "tp2", "delayed", "--steps", "2", "--sabotage", "delayed"])
    apart, fp8_error = _median_line(capsys.readouterr().out)
    assert apart > 0.5 * fp8_error, (apart, fp8_error)


def test_a_nudge_moves_every_weight_its_ulps_up_or_down():
    """--nudge's noise: each element exactly `ulps` fp32 steps away, about half of them up."""
    model = torch.nn.Linear(64, 64)
    before = model.weight.detach().clone()
    nudge(model, seed=3, ulps=2)
    after = model.weight.detach()
    up = before
    down = before
    for _ in range(2):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
    moved_up = after == up
    assert torch.all(moved_up | (after == down))
    assert 0.4 < moved_up.float().mean() < 0.6
    twice = torch.nn.Linear(64, 64)
    twice.load_state_dict({"weight": before, "bias": twice.bias})
    nudge(twice, seed=3, ulps=2)
    assert torch.equal(twice.weight, after)  # (the seed decides)
