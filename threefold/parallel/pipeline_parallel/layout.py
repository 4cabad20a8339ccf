"""Which transformer layers each pipeline stage (and virtual stage) holds.

Without virtual stages, layers are split evenly over the P stages, except that
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` may fix the first
and last stage's share, the rest being split evenly over the middle stages.

With V virtual stages per rank (interleaved 1F1B), the model is cut into P*V equal chunks and
rank r holds chunks r, r + P, r + 2P, ...: model chunk v of rank r starts at layer
(v * P + r) * L / (P * V). Activations thus travel around the ring of ranks V times.
"""

from __future__ import annotations

from threefold.config.parallel import stage_layer_counts


def model_chunk_layers(
    num_layers: int,
    pipeline_size: int,
    pipeline_rank: int,
    virtual_size: int | None = None,
    first: int | None = None,
    last: int | None = None,
) -> list[tuple[int, int]]:
    """(layer offset, number of layers) of each model chunk this pipeline rank holds."""
    if virtual_size and virtual_size > 1:
        per_chunk = num_layers // (pipeline_size * virtual_size)
        return [
            ((v * pipeline_size + pipeline_rank) * per_chunk, per_chunk)
            for v in range(virtual_size)
        ]
    counts = stage_layer_counts(num_layers, pipeline_size, first, last)
    return [(sum(counts[:pipeline_rank]), counts[pipeline_rank])]
