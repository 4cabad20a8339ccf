"""What the GPU did in a profiled window, and when it waited: a PyTorch profiler trace (Chrome
format, as `gpu_profile.py --trace` writes it) read without torch, so a trace brought back from
a lent GPU can be read again on any machine.

    python bench/gpu_timeline.py TRACE.json.gz [--steps 2] [--gaps 12]
    python bench/gpu_timeline.py TRACE.json.gz --against OTHER.json.gz   # what changed

Three tables:
- GPU time by kind of work (cuBLAS GEMMs in 16 bits or FP8, attention, Inductor's Triton
  kernels, threefold's own Triton casts, the optimizer, PyTorch's eager kernels, copies, ...),
  per step. A kernel's kind comes from the operator that launched it where the trace has it
  (a `_scaled_mm` is an FP8 GEMM whatever cuBLAS names its kernel), else from its name.
- Idle time, per step: the window from the first kernel's start to the last one's end, less
  the union of every stream's kernels. Each gap is put down to the host when the kernel after
  it was launched after the gap began (the GPU had nothing queued: the host was late), else to
  the device (it was queued but waited: on another stream, an event, a copy from pageable
  memory). Holistic Trace Analysis splits idle time the same way.
- The longest gaps, with the kernels either side and the operator that launched the second.

The profiler's own host overhead makes the host later than it is unprofiled, so the host's
share is an upper bound; the gaps' places are what to read.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# A kernel launched at most this long (µs) after its gap began counts as queued in time: the
# trace's host and device clocks are aligned to about a microsecond.
LAUNCH_SLACK_US = 1.0

# (kind, operator pattern, kernel-name pattern): the first rule either of whose patterns
# matches names a kernel's kind; the operator is the innermost one around the kernel's launch,
# where the trace has it. Names that say who wrote the kernel come first (a Triton kernel
# launched inside an `aten::linear` is Inductor's), then operators before the name patterns.
KINDS: tuple[tuple[str, str | None, str | None], ...] = (
    ("communication (NCCL)", None, r"nccl"),
    ("threefold's Triton FP8 casts", None, r"^_cast_(transpose|rows|blocks)"),
    ("Triton (Inductor: compiled graphs)", None, r"^triton_"),
    ("FP8 GEMMs", r"^aten::_scaled_mm$|^aten::_scaled_grouped_mm$", None),
    ("attention", r"attention|^aten::_flash|^aten::_efficient", r"sdpa|flash|fmha|attention"),
    (
        "GEMMs (16/32-bit)",
        r"^aten::(mm|addmm_?|bmm|baddbmm|matmul|linear|_grouped_mm)$",
        r"gemm|nvjet|cutlass|cublas|xmma",
    ),
    ("optimizer", r"^aten::_fused_adamw?_|Optimizer\.step", r"multi_tensor_apply"),
    ("PyTorch eager kernels", None, r"at::native|^void at::"),
)
COPIES = "copies and fills"
OTHER = "other"


@dataclass(frozen=True)
class DeviceEvent:
    """One kernel, copy or fill on the GPU (µs on the trace's clock)."""

    name: str
    start: float
    end: float
    kind: str
    launched: float | None  # when the host launched it, where the trace has the launch
    operator: str  # the innermost operator around the launch ("" where unknown)


@dataclass(frozen=True)
class Gap:
    """The GPU idle between two device events."""

    start: float
    end: float
    before: DeviceEvent
    after: DeviceEvent

    @property
    def length(self) -> float:
        return self.end - self.start

    @property
    def host(self) -> bool:
        """Whether the host launched the next kernel only after the GPU ran out of work."""
        launched = self.after.launched
        return launched is not None and launched > self.start + LAUNCH_SLACK_US


def load(path: str) -> list[dict]:
    """The trace's events (a `.json` or `.json.gz` file)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as file:
        trace = json.load(file)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def kind_of(name: str, operator: str, category: str = "kernel") -> str:
    """The kind of work a device event does (`KINDS`)."""
    if category != "kernel":
        return COPIES
    for kind, operator_pattern, name_pattern in KINDS:
        if operator_pattern and operator and re.search(operator_pattern, operator):
            return kind
        if name_pattern and re.search(name_pattern, name, re.IGNORECASE):
            return kind
    return OTHER


def _innermost_operators(events: list[dict], launches: list[dict]) -> dict[int, str]:
    """For each launch (by `id`), the innermost host operator running on its thread when it
    was made: one sweep per thread over operators (which nest) and launches in time order."""
    ops: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("cat") in ("cpu_op", "user_annotation") and "dur" in event:
            ops[(event.get("pid"), event.get("tid"))].append(event)
    queries: dict[tuple, list[dict]] = defaultdict(list)
    for launch in launches:
        queries[(launch.get("pid"), launch.get("tid"))].append(launch)
    found = {}
    for thread, made in queries.items():
        # outer before inner where two start together
        pending = sorted(ops.get(thread, []), key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        index = 0
        for launch in sorted(made, key=lambda e: e["ts"]):
            while index < len(pending) and pending[index]["ts"] <= launch["ts"]:
                op = pending[index]
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < op["ts"]:
                    stack.pop()
                stack.append(op)
                index += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < launch["ts"]:
                stack.pop()
            found[id(launch)] = stack[-1]["name"] if stack else ""
    return found


def device_events(events: list[dict]) -> list[DeviceEvent]:
    """Every kernel, copy and fill in the trace, in start order, with its launch."""
    launches = {
        event["args"]["correlation"]: event
        for event in events
        if event.get("cat") in ("cuda_runtime", "cuda_driver")
        and "correlation" in event.get("args", {})
    }
    operators = _innermost_operators(events, list(launches.values()))
    found = []
    for event in events:
        category = event.get("cat")
        if category not in DEVICE_CATEGORIES or "dur" not in event:
            continue
        launch = launches.get(event.get("args", {}).get("correlation"))
        operator = operators[id(launch)] if launch is not None else ""
        name = event.get("name", "")
        found.append(
            DeviceEvent(
                name=name,
                start=event["ts"],
                end=event["ts"] + event["dur"],
                kind=kind_of(name, operator, category),
                launched=launch["ts"] if launch is not None else None,
                operator=operator,
            )
        )
    return sorted(found, key=lambda e: e.start)


def gaps(device: list[DeviceEvent]) -> tuple[float, list[Gap]]:
    """The union of the events' intervals (any stream) and the gaps between its pieces."""
    busy, found = 0.0, []
    if not device:
        return busy, found
    last = device[0]  # the event that ends the current busy piece
    piece_start, piece_end = last.start, last.end
    for event in device[1:]:
        if event.start > piece_end:
            busy += piece_end - piece_start
            found.append(Gap(piece_end, event.start, last, event))
            piece_start, piece_end, last = event.start, event.end, event
        elif event.end > piece_end:
            piece_end, last = event.end, event
    busy += piece_end - piece_start
    return busy, found


def report(events: list[dict], steps: int, longest: int = 12) -> str:
    """The three tables (module doc), per step of the `steps` the window holds."""
    device = device_events(events)
    if not device:
        return "no GPU kernels in the trace (a CPU run): nothing to break down"
    busy, found = gaps(device)
    window = max(e.end for e in device) - device[0].start
    per_step = 1e3 * steps  # µs in the trace, ms per step in the tables

    by_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in device:
        by_kind[event.kind][0] += event.end - event.start
        by_kind[event.kind][1] += 1
    lines = [
        f"GPU timeline over {steps} step(s): window {window / per_step:.1f} ms a step, "
        f"busy {busy / per_step:.1f} ms ({100 * busy / window:.1f}%)",
        "",
        "| kind of work | ms a step | % of busy | events a step |",
        "|---|---|---|---|",
    ]
    for kind, (time, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        lines.append(
            f"| {kind} | {time / per_step:.2f} | {100 * time / busy:.1f}% | {count / steps:.0f} |"
        )
    lines.append(
        "(streams overlap, so the kinds can add up to more than busy; idle is what no stream ran)"
    )

    host = sum(g.length for g in found if g.host)
    device_wait = sum(g.length for g in found if not g.host)
    idle = window - busy
    lines += [
        "",
        "| idle | ms a step | % of window | gaps a step |",
        "|---|---|---|---|",
        f"| all | {idle / per_step:.2f} | {100 * idle / window:.1f}% | {len(found) / steps:.0f} |",
        f"| host late (next kernel launched after the GPU ran dry) | {host / per_step:.2f} | "
        f"{100 * host / window:.1f}% | {sum(g.host for g in found) / steps:.0f} |",
        f"| queued but waiting (streams, events, host copies) | {device_wait / per_step:.2f} | "
        f"{100 * device_wait / window:.1f}% | {sum(not g.host for g in found) / steps:.0f} |",
        "",
        f"The {min(longest, len(found))} longest gaps:",
        "",
        "| µs | at ms | why | before | after | launched by |",
        "|---|---|---|---|---|---|",
    ]
    for gap in sorted(found, key=lambda g: -g.length)[:longest]:
        lines.append(
            f"| {gap.length:.0f} | {(gap.start - device[0].start) / 1e3:.2f} | "
            f"{'host' if gap.host else 'device'} | {_short(gap.before.name)} | "
            f"{_short(gap.after.name)} | {gap.after.operator or '-'} |"
        )
    return "\n".join(lines)


def compare(events: list[dict], against: list[dict], steps: int, rows: int = 15) -> str:
    """Two traces of the same step (two commits, two flags) side by side: GPU time a step by
    kind of work and the kernels whose time changed most, with their launches a step."""
    sides = [device_events(events), device_events(against)]
    if not all(sides):
        return "a trace without GPU kernels (a CPU run): nothing to compare"
    per_step = 1e3 * steps
    totals: list[dict[str, list[float]]] = [defaultdict(lambda: [0.0, 0]) for _ in sides]
    kinds: list[dict[str, float]] = [defaultdict(float) for _ in sides]
    for side, device in enumerate(sides):
        for event in device:
            totals[side][event.name][0] += event.end - event.start
            totals[side][event.name][1] += 1
            kinds[side][event.kind] += event.end - event.start
    lines = ["| kind of work | ms a step | against | change |", "|---|---|---|---|"]
    for kind in sorted(set(kinds[0]) | set(kinds[1]), key=lambda k: -kinds[0].get(k, 0)):
        a, b = (kinds[side].get(kind, 0.0) / per_step for side in (0, 1))
        lines.append(f"| {kind} | {a:.2f} | {b:.2f} | {a - b:+.2f} |")
    busy = [gaps(device)[0] / per_step for device in sides]
    lines.append(
        f"| (busy, streams merged) | {busy[0]:.2f} | {busy[1]:.2f} | {busy[0] - busy[1]:+.2f} |"
    )
    lines += [
        "",
        "| kernel | ms a step | against | change | launches a step |",
        "|---|---|---|---|---|",
    ]
    names = set(totals[0]) | set(totals[1])
    change = {n: totals[0].get(n, [0.0, 0])[0] - totals[1].get(n, [0.0, 0])[0] for n in names}
    for name in sorted(names, key=lambda n: -abs(change[n]))[:rows]:
        (a, na), (b, nb) = (totals[side].get(name, [0.0, 0]) for side in (0, 1))
        lines.append(
            f"| {_short(name)} | {a / per_step:.2f} | {b / per_step:.2f} | "
            f"{change[name] / per_step:+.2f} | {na / steps:.0f} vs {nb / steps:.0f} |"
        )
    return "\n".join(lines)


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace (.json or .json.gz)")
    parser.add_argument("--steps", type=int, default=2, help="training steps the trace holds")
    parser.add_argument("--gaps", type=int, default=12, help="how many of the longest gaps")
    parser.add_argument(
        "--against", metavar="TRACE", help="a second trace of the same step: what changed"
    )
    args = parser.parse_args()
    if args.against:
        print(compare(load(args.trace), load(args.against), args.steps))
    else:
        print(report(load(args.trace), args.steps, args.gaps))


if __name__ == "__main__":
    main()
