"""Which transformer layers each pipeline stage (and virtual stage) holds.

Without virtual stages, layers are split evenly over the P stages, except that
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` may fix the first
and last stage's share, the rest being split evenly over the middle stages.

With V virtual stages per rank (interleaved 1F1B), the model is cut into P*V equal chunks and
rank r holds chunks r, r + P, r + 2P, ...: model chunk v of rank r starts at layer
(v * P + r) * L / (P * V). Activations thus travel around the ring of ranks V times.

`--account-for-embedding-in-pipeline-split` / `--account-for-loss-in-pipeline-split`
(Megatron-LM's) count the embedding and the loss as one layer each in that even split: the
first chunk (of rank 0) holds one transformer layer fewer, the last chunk (of the last rank)
too, down to none (a chunk of the embedding alone, or of the final norm and loss alone).

`--pipeline-model-parallel-layout` (config/pipeline_layout.py) spells out every chunk's layers;
chunks are numbered and assigned to ranks as above.
"""

from __future__ import annotations

from threefold.config.model import ModelConfig
from threefold.config.parallel import ParallelConfig, stage_layer_counts


def model_chunk_layers(
    num_layers: int,
    pipeline_size: int,
    pipeline_rank: int,
    virtual_size: int | None = None,
    first: int | None = None,
    last: int | None = None,
    embedding: bool = False,
    loss: bool = False,
) -> list[tuple[int, int]]:
    """(layer offset, number of layers) of each model chunk this pipeline rank holds;
    `embedding`, `loss`: those count as a layer of the first and the last chunk."""
    if first is not None or last is not None:  # uneven stages (no virtual stages)
        counts = stage_layer_counts(num_layers, pipeline_size, first, last)
        return [(sum(counts[:pipeline_rank]), counts[pipeline_rank])]
    chunks = pipeline_size * (virtual_size or 1)
    per_chunk = (num_layers + embedding + loss) // chunks
    counts = [per_chunk] * chunks
    counts[0] -= embedding
    counts[-1] -= loss
    return chunks_of_rank(counts, pipeline_size, pipeline_rank)


def chunks_of_rank(
    counts: list[int], pipeline_size: int, pipeline_rank: int
) -> list[tuple[int, int]]:
    """(layer offset, number of layers) of a rank's chunks, given every chunk's layers in the
    order they run."""
    offsets = [sum(counts[:g]) for g in range(len(counts))]
    mine = range(pipeline_rank, len(counts), pipeline_size)  # chunk v of rank r: v P + r
    return [(offsets[g], counts[g]) for g in mine]


def chunk_layers_of(
    parallel: ParallelConfig, model: ModelConfig, rank: int
) -> list[tuple[int, int]]:
    """`model_chunk_layers` of pipeline rank `rank` in the layout a ParallelConfig gives."""
    if parallel.pipeline_model_parallel_layout is not None:
        counts = parallel.chunk_layer_counts(model)
        return chunks_of_rank(counts, parallel.pipeline_model_parallel_size, rank)
    return model_chunk_layers(
        model.num_layers,
        parallel.pipeline_model_parallel_size,
        rank,
        parallel.virtual_pipeline_model_parallel_size,
        parallel.decoder_first_pipeline_num_layers,
        parallel.decoder_last_pipeline_num_layers,
        parallel.account_for_embedding_in_pipeline_split,
        parallel.account_for_loss_in_pipeline_split,
    )
