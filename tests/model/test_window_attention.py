"""Sliding-window attention (--window-size, --window-attn-skip-freq): the layers it picks,
its mask with packed documents, every layout as one process, and its mistakes in one line.
megatron-core's logits of such a model: tests/tools/test_megatron_checkpoints.py; Mistral's
and Qwen2's windows against transformers: tests/tools/test_convert_checkpoint.py."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.parallel.context_parallel.sequence import document_mask, window_mask

WINDOW = ["--window-size", "3,0", "--window-attn-skip-freq", "2", "--num-layers", "4"]


def test_the_window_is_the_query_and_the_keys_just_before_it():
    allowed = window_mask(6, 2, None, torch.device("cpu"))[0, 0]
    assert allowed.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]
    # within packed documents too: the second starts at token 4
    documents = document_mask(torch.tensor([[0, 0, 0, 0, 1, 1]]))
    both = window_mask(6, 2, documents, torch.device("cpu"))[0, 0]
    assert both[4].int().tolist() == [0, 0, 0, 0, 1, 0] and both[3].int().tolist()[1:4] == [1] * 3


@pytest.mark.parametrize(
    "freq,windowed",
    [(None, [3, 3, 3, 3]), ("2", [3, None, 3, None]), ("[1,1,1,0]", [3, 3, 3, None])],
    ids=["every-layer", "every-second-full", "pattern"],
)
def test_skip_freq_picks_megatron_cores_layers(freq, windowed):
    """N: layer numbers N, 2N, ... keep full attention (megatron-core's
    `is_layer_window_attention`); a pattern's 1s slide."""
    argv = LLAMA_STYLE + TRAINING + WINDOW[:2] + ["--num-layers", "4"]
    trainer = _setup(argv + (["--window-attn-skip-freq", freq] if freq else []))
    assert [layer.self_attention.window for layer in trainer.model.decoder.layers] == windowed


def test_a_windowed_model_trains_at_tp2_sp_pp2_as_one_process():
    argv = LLAMA_STYLE + TRAINING + WINDOW
    reference = train_job(argv, 4)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--pipeline-model-parallel-size", "2"]
    assert_matches_reference(run_distributed(4, train_job, argv + layout, 4), reference, 1e-5)
    full = train_job(LLAMA_STYLE + TRAINING + ["--num-layers", "4"], 1)
    assert abs(full["losses"][0] - reference["losses"][0]) > 1e-4  # (the window matters)


@pytest.mark.parametrize("comm_type", ["p2p", "allgather", "a2a"])
def test_a_windowed_model_trains_at_cp2_as_one_process(comm_type):
    """Over CP ranks each block is masked by its queries' and keys' positions (with packed
    documents: --reset-attention-mask), as one process masks the whole sequence."""
    documents = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "15"]
    argv = LLAMA_STYLE + TRAINING + WINDOW + documents + ["--reset-attention-mask"]
    reference = train_job(argv, 4)
    layout = ["--context-parallel-size", "2", "--cp-comm-type", comm_type]
    assert_matches_reference(run_distributed(2, train_job, argv + layout, 4), reference, 1e-5)


@pytest.mark.parametrize(
    "flags,world_size,said",
    [
        (["--window-size", "3,1"], 1, "a causal model's window is L,0"),
        (["--window-size", "3"], 1, "give L,R"),
        (["--window-attn-skip-freq", "2"], 1, "--window-attn-skip-freq picks the layers"),
        (WINDOW[:2] + ["--window-attn-skip-freq", "[1,0,1]"], 1, "gives 3 layers"),
    ],
    ids=["ahead", "one-number", "no-window", "pattern-length"],
)
def test_window_mistakes_are_one_line(capsys, flags, world_size, said):
    with pytest.raises(SystemExit) as stop:
        parse_args(LLAMA_STYLE + TRAINING + flags, world_size=world_size)
    assert stop.value.code == 2
    assert said in capsys.readouterr().err
