import os
import re
import subprocess
import sys

import pytest

from tests.distributed import close_pools, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The smallest model the command-line tests train (each adds its own run flags).
TINY_MODEL = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
TINY_MODEL = (TINY_MODEL + "--micro-batch-size 2").split()
# The model and mock data the command-line parsing tests parse (no training needed).
CLI_MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
CLI_MODEL = (CLI_MODEL + "--micro-batch-size 2 --mock-data --vocab-size 100").split()

# Kernel tests that run on every device present: the CPU always, CUDA where a GPU is
# (bench/gpu_session.sh runs the `cuda` legs there).
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(
            not __import__("torch").cuda.is_available(), reason="no CUDA device"
        ),
    ),
]


@pytest.fixture(scope="session", autouse=True)
def _distributed_worker_pools():
    yield
    close_pools()


# torch.distributed's environment: a test that sets it in the pytest process changes what every
# later test and tool subprocess sees (a stale MASTER_PORT, a world size that is not theirs).
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """Parity tests run their ranks in worker processes; the pytest process itself stays a
    plain single process, or the single-process references of later tests silently change."""
    before = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    leaks = [name for name in _LAUNCH_VARIABLES if os.environ.get(name) != before[name]]
    for name in leaks:
        if before[name] is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before[name]
    dist = sys.modules.get("torch.distributed")
    initialized = dist is not None and dist.is_available() and dist.is_initialized()
    if initialized:
        dist.destroy_process_group()
    if initialized or leaks:
        pytest.fail(
            "the test left torch.distributed "
            + ("initialized " if initialized else "")
            + (f"(environment {', '.join(leaks)}) " if leaks else "")
            + "in the pytest process; run ranks with tests.distributed.run_distributed"
        )


@pytest.fixture(autouse=True)
def _reference_kernels():
    """A Trainer selects kernels for its process; the next test starts from the references."""
    yield
    from threefold.kernels.dispatch import KERNELS

    KERNELS.use_reference()


@pytest.fixture(scope="session")
def shakespeare_data(tmp_path_factory) -> dict[str, str]:
    """The default corpus, tokenized with a small sentencepiece model (about 6 s): the launcher
    tests train on it. Returns the variables launch/gpt_args.sh reads."""
    out = tmp_path_factory.mktemp("shakespeare")

    def tool(name: str, *argv: str) -> None:
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", name), *argv],
            check=True,
            capture_output=True,
            timeout=300,
        )

    tool("prepare_default_corpus.py", "--output", str(out / "corpus.jsonl"))
    tool(
        "train_tokenizer.py",
        "--input",
        str(out / "corpus.jsonl"),
        "--vocab-size",
        "1024",
        "--model-prefix",
        str(out / "sp"),
    )
    tool(
        "preprocess_data.py",
        "--input",
        str(out / "corpus.jsonl"),
        "--json-keys",
        "text",
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        str(out / "sp.model"),
        "--output-prefix",
        str(out / "corpus"),
        "--append-eod",
        "--workers",
        "2",
    )
    return {
        "DATA_PATH": str(out / "corpus_text_document"),
        "TOKENIZER_MODEL": str(out / "sp.model"),
    }


def logged_losses(output: str) -> dict[str, dict[int, str]]:
    """{"train": {iteration: lm loss}, "validation": {...}} as printed (strings: equal strings
    are bitwise-equal floats); a resumed run prints some iterations twice, the last one wins."""
    train = re.findall(r" iteration +(\d+)/ +\d+ .*?lm loss: (\S+) \|", output)
    valid = re.findall(
        r"validation loss at iteration (\d+)(?: on validation set)? \| lm loss value: (\S+) \|",
        output,
    )
    return {"train": {int(i): v for i, v in train}, "validation": {int(i): v for i, v in valid}}


def tiny_gpt_environment(data: dict[str, str], **overrides) -> dict[str, str]:
    """Environment for the launch/ scripts: a 2-layer model on CPU, fp32, gloo."""
    environment = dict(
        os.environ,
        PYTHON=sys.executable,
        NUM_LAYERS="2",
        HIDDEN_SIZE="64",
        NUM_ATTENTION_HEADS="4",
        SEQ_LENGTH="64",
        MICRO_BATCH_SIZE="4",
        GLOBAL_BATCH_SIZE="8",
        LR="3e-3",
        LR_WARMUP_ITERS="2",
        LOG_INTERVAL="5",
        EVAL_ITERS="1",
        PRECISION="fp32",
        NPROC_PER_NODE="2",
        # launch/torchrun_gpt.sh's default port is 29500: two launches at once (the suite's
        # files run side by side) would meet there.
        MASTER_PORT=str(free_port()),
        **data,
    )
    environment.update({key: str(value) for key, value in overrides.items()})
    return environment
