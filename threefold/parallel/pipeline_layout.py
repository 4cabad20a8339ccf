"""Which transformer layers each pipeline stage (and virtual stage) holds.

Without virtual stages, layers are split evenly over the P stages, except that
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` may fix the first
and last stage's share, the rest being split evenly over the middle stages.

With V virtual stages per rank (interleaved 1F1B), the model is cut into P*V equal chunks and
rank r holds chunks r, r + P, r + 2P, ...: model chunk v of rank r starts at layer
(v * P + r) * L / (P * V). Activations thus travel around the ring of ranks V times.
"""

from __future__ import annotations


def stage_layer_counts(num_layers: int, pipeline_size: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers per pipeline stage (no virtual stages)."""
    if pipeline_size == 1:
        return [num_layers]
    counts: list[int | None] = [None] * pipeline_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    remaining = num_layers - fixed
    if free:
        if remaining < 0 or remaining % len(free):
            raise ValueError(f"{remaining} layers do not split evenly over {len(free)} stages")
        for i in free:
            counts[i] = remaining // len(free)
    elif remaining:
        raise ValueError(f"the first and last stage counts do not add up to {num_layers}")
    return counts  # type: ignore[return-value]


def model_chunk_layers(num_layers: int, pipeline_size: int, pipeline_rank: int,
                       virtual_size: int | None = None, first: int | None = None,
                       last: int | None = None) -> list[tuple[int, int]]:
    """(layer offset, number of layers) of each model chunk this pipeline rank holds."""
    if virtual_size and virtual_size > 1:
        per_chunk = num_layers // (pipeline_size * virtual_size)
        return [((v * pipeline_size + pipeline_rank) * per_chunk, per_chunk)
                for v in range(virtual_size)]
    counts = stage_layer_counts(num_layers, pipeline_size, first, last)
    return [(sum(counts[:pipeline_rank]), counts[pipeline_rank])]
