"""Megatron-LM's `--pipeline-model-parallel-layout`: the layers of every pipeline stage, spelled
out.

The string lists the P x V model chunks in the order the layers run, separated by `|`. Chunk g
is virtual stage g // P of pipeline rank g % P, as in the even interleaved split. Within a chunk:

    E   the embedding          t   a transformer layer
    m   a multi-token-prediction depth (--mtp-num-layers)
    L   the output layer and the loss

`x*n` repeats a letter and `(...)*n` a group; commas are for the eye. DeepSeek-V3's 61 layers
and one MTP depth over PP16 x VP2 read "Et*3|(tt|)*29,m|L". A chunk may be empty.

As in megatron-core, `E` and `L` say where the layout counts the embedding and the loss: the
first chunk embeds and the last one computes the loss whatever the string says, so the string
must begin with `E` and end with `L`.
"""

from __future__ import annotations

import re

from threefold.config.errors import ConfigError

FLAG = "--pipeline-model-parallel-layout"
LETTERS = "EtmL|"


def parse_layout(layout: str) -> list[str]:
    """The chunks of a layout string, each as its letters ("Et*2|(t|)*2L" -> Ett, t, tL)."""
    text = layout.replace(",", "")
    # Megatron's grammar: groups first (they do not nest), then single letters.
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    unknown = sorted(set(text) - set(LETTERS))
    if unknown:
        raise ConfigError(
            f"{FLAG} {layout!r}: unknown letters {''.join(unknown)!r}; a chunk is made of E "
            "(embedding), t (transformer layer), m (MTP depth) and L (loss), chunks separated by |"
        )
    return text.split("|")


def layout_layer_counts(
    layout: str, pipeline_size: int, num_layers: int, mtp_num_layers: int | None
) -> list[int]:
    """Transformer layers of each model chunk, in the order they run (chunk g is virtual stage
    g // P of rank g % P), after checking the layout against the model and megatron-core's
    rules."""
    chunks = parse_layout(layout)

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(f"{FLAG} {layout!r}: {message}")

    require(
        len(chunks) % pipeline_size == 0,
        f"its {len(chunks)} chunks are not a multiple of --pipeline-model-parallel-size "
        f"{pipeline_size} (each pipeline rank holds the same number of model chunks)",
    )
    letters = "".join(chunks)
    require(
        letters.startswith("E") and letters.count("E") == 1,
        "it must begin with the embedding, E, and name it once",
    )
    require(
        letters.endswith("L") and letters.count("L") == 1,
        "it must end with the loss, L, and name it once",
    )
    require(
        letters.count("t") == num_layers,
        f"it places {letters.count('t')} transformer layers (t) and --num-layers is {num_layers}",
    )
    depths = mtp_num_layers or 0
    require(
        letters.count("m") == depths,
        f"it places {letters.count('m')} MTP depths (m) and --mtp-num-layers is {depths}",
    )
    require(
        "t" not in letters[letters.find("m") :] if depths else True,
        "the MTP depths (m) must come after every transformer layer",
    )
    require(
        chunks[-1].count("m") == depths,
        "the MTP depths (m) must be in the last chunk, beside the loss; megatron-core's MTP on "
        "a stage of its own is not built",
    )
    counts = [chunk.count("t") for chunk in chunks]
    idle = [rank for rank in range(1, pipeline_size - 1) if not any(counts[rank::pipeline_size])]
    require(
        not idle,
        f"pipeline rank {idle[0] if idle else 0} holds no layer in any of its chunks and would "
        "only pass activations on; give it a transformer layer (t)",
    )
    return counts
