"""The fault table (docs/reliability.md), case by case with real processes: each fault ends in
a correct run or in one line with exit code 2 within 10 s (data and config faults) or exit 1
(a save that cannot complete) — never a traceback or a hang, never a good checkpoint lost, and
after a checkpoint fault the run resumes from the newest good checkpoint with the losses of a
run that never met the fault, bitwise.
"""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings
from typing import NamedTuple

import numpy as np
import pytest

from tests.concurrent_runs import Runs, run_together, selected
from tests.conftest import ROOT, TINY_MODEL, logged_losses
from tests.data.test_datasets import VOCAB, write_corpus

TRACKER = "latest_checkpointed_iteration.txt"
TINY = TINY_MODEL + "--global-batch-size 4 --eval-iters 0 --log-interval 1 --lr 1e-3".split()
TINY += "--lr-decay-iters 10 --lr-warmup-iters 0".split()
MOCK = ["--mock-data", "--vocab-size", "128"]


def _pretrain(
    *argv: str, timeout: float = 120, limit_file_bytes: int | None = None, **environment
) -> tuple[subprocess.CompletedProcess, float]:
    def limit() -> None:  # a full disk, for this process only: writes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **environment},
        preexec_fn=limit if limit_file_bytes else None,
    )
    return result, time.monotonic() - start


def _refused(result, seconds: float, expected: str, code: int = 2) -> None:
    output = result.stdout[-1500:] + result.stderr[-2500:]
    assert result.returncode == code, output
    assert "Traceback" not in result.stderr, output
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0], (expected, output)
    if code == 2:
        assert seconds < 10, f"{expected}: {seconds:.1f} s"


# -- data and configuration faults ------------------------------------------------------------
@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("corpora")
    write_corpus(str(root / "small"), 92, seed=1)  # a newcomer's corpus
    write_corpus(str(root / "large"), 400, seed=2)
    return str(root)


def _data_case(kind: str, corpora: str, tmp_path) -> tuple[list[str], str]:
    """(flags, what the one-line refusal must say) for a damaged corpus."""
    prefix = str(tmp_path / "data")
    data = ["--vocab-size", str(VOCAB), "--data-path", prefix, "--split", "90,5,5"]
    if kind == "empty-split":  # the default split gives the test split no document
        shutil.copyfile(f"{corpora}/small.bin", prefix + ".bin")
        shutil.copyfile(f"{corpora}/small.idx", prefix + ".idx")
        return data + ["--split", "969,30,1"], "the test split gets 0 of its 92 documents"
    if kind == "empty-documents":
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for _ in range(3):
            builder.add_document([], [0])
        builder.finalize(prefix + ".idx")
        return data, "its 3 documents hold no tokens"
    if kind == "idx-of-another-corpus":  # a small .idx beside a large .bin, and the reverse
        shutil.copyfile(f"{corpora}/large.bin", prefix + ".bin")
        shutil.copyfile(f"{corpora}/small.idx", prefix + ".idx")
        return data, ".bin is larger than its index says"
    if kind == "bin-of-another-corpus":
        shutil.copyfile(f"{corpora}/small.bin", prefix + ".bin")
        shutil.copyfile(f"{corpora}/large.idx", prefix + ".idx")
        return data, ".bin is truncated"
    if kind == "smaller-than-one-sample":
        write_corpus(prefix, 1, seed=1)
        return data + [
            "--seq-length",
            "512",
            "--max-position-embeddings",
            "512",
        ], "fewer than one sample"
    if kind == "cache-under-a-file":
        shutil.copyfile(f"{corpora}/small.bin", prefix + ".bin")
        shutil.copyfile(f"{corpora}/small.idx", prefix + ".idx")
        (tmp_path / "file").write_text("")
        return data + [
            "--data-cache-path",
            str(tmp_path / "file" / "cache"),
        ], "--data-cache-path: cannot create the dataset index cache"
    if kind == "save-is-a-file":
        (tmp_path / "file").write_text("")
        return MOCK + ["--save", str(tmp_path / "file")], "cannot write checkpoints there"
    if kind == "save-under-a-file":
        (tmp_path / "file").write_text("")
        return MOCK + ["--save", str(tmp_path / "file" / "run")], "cannot write checkpoints"
    if kind == "garbage-tracker":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / TRACKER).write_bytes("\xb2\n".encode() + b"\xff\xfe")
        return MOCK + ["--load", str(tmp_path / "run")], "not an iteration number"
    raise AssertionError(kind)


DATA_CASES = [
    "empty-split",
    "empty-documents",
    "idx-of-another-corpus",
    "bin-of-another-corpus",
    "smaller-than-one-sample",
    "cache-under-a-file",
    "save-is-a-file",
    "save-under-a-file",
    "garbage-tracker",
]


@pytest.mark.parametrize("kind", DATA_CASES)
def test_data_and_config_faults_are_refused_in_seconds(kind, corpora, tmp_path):
    flags, expected = _data_case(kind, corpora, tmp_path)
    _refused(*_pretrain(*TINY, "--train-iters", "2", *flags), expected)


# -- checkpoint faults ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, dict[int, str]]:
    """A 6-iteration run stopped after saving iterations 2 and 4, and the losses of the same
    run uninterrupted."""
    directory = str(tmp_path_factory.mktemp("reference") / "run")
    saving = ("--save-interval", "2", "--exit-interval", "4", "--save", directory)
    runs = run_together(
        lambda *flags: _pretrain(*TINY, *MOCK, "--train-iters", "6", *flags)[0],
        {"saved": saving, "straight": ()},
    )
    assert runs["saved"].returncode == 0, runs["saved"].stderr[-3000:]
    return directory, logged_losses(runs["straight"].stdout)["train"]


def _damage(root: str, kind: str) -> tuple[int | None, str]:
    """Damage the copy at `root`; (the iteration the run must resume from, or None for a
    one-line refusal; what the output must say)."""
    newest = os.path.join(root, "iter_0000004")
    if kind == "truncated-shard":
        with open(os.path.join(newest, "__0_0.distcp"), "r+b") as f:
            f.truncate(1000)
        return 2, "falling back to iteration 2"
    if kind == "garbage-in-shard":  # same size: only the checksum sees it
        with open(os.path.join(newest, "__0_0.distcp"), "r+b") as f:
            f.seek(4096)
            f.write(os.urandom(4096))
        return 2, "does not match its checksum"
    if kind == "missing-shard":
        os.remove(os.path.join(newest, "__0_0.distcp"))
        return 2, "__0_0.distcp is missing"
    if kind == "missing-dcp-metadata":
        os.remove(os.path.join(newest, ".metadata"))
        return 2, ".metadata is missing"
    if kind == "truncated-metadata-json":
        with open(os.path.join(newest, "metadata.json"), "r+b") as f:
            f.truncate(100)
        return 2, "falling back to iteration 2"
    if kind == "garbage-in-metadata-json":  # same size; the look before start-up reads no contents
        with open(os.path.join(newest, "metadata.json"), "r+b") as f:
            f.write(b"\0" * 16)
        return 2, "metadata.json does not match its checksum"
    if kind == "truncated-rng":
        with open(os.path.join(newest, "rng", "rank_00000.pt"), "r+b") as f:
            f.truncate(10)
        return 2, "falling back to iteration 2"
    if kind == "tracker-names-a-missing-iteration":
        shutil.rmtree(newest)
        return 2, "iter_0000004 does not exist"
    if kind == "tracker-deleted":  # --load = --save: never 'start from scratch' over them
        os.remove(os.path.join(root, TRACKER))
        return 4, "no latest_checkpointed_iteration.txt; using the newest complete"
    if kind == "abandoned-partial-save":
        shutil.copytree(newest, newest.replace("0004", "0006") + ".partial")
        return 4, "removed the unfinished iter_0000006.partial"
    if kind == "no-tracker-and-nothing-complete":
        os.remove(os.path.join(root, TRACKER))
        for name in ("iter_0000002", "iter_0000004"):
            os.remove(os.path.join(root, name, "manifest.json"))
        return None, "none of them is complete; refusing to start from scratch"
    if kind == "missing-rng-without-manifest":  # a checkpoint from before manifests
        os.remove(os.path.join(newest, "manifest.json"))
        os.remove(os.path.join(newest, "rng", "rank_00000.pt"))
        return None, "rank_00000.pt is missing"
    if kind == "everything-damaged":
        for name in ("iter_0000002", "iter_0000004"):
            os.remove(os.path.join(root, name, "__0_0.distcp"))
        return None, "no earlier complete checkpoint verifies"
    raise AssertionError(kind)


CHECKPOINT_CASES = [
    "truncated-shard",
    "garbage-in-shard",
    "missing-shard",
    "missing-dcp-metadata",
    "truncated-metadata-json",
    "garbage-in-metadata-json",
    "truncated-rng",
    "tracker-names-a-missing-iteration",
    "tracker-deleted",
    "abandoned-partial-save",
    "no-tracker-and-nothing-complete",
    "missing-rng-without-manifest",
    "everything-damaged",
]


class Resumed(NamedTuple):
    root: str
    resume_from: int | None  # None: a one-line refusal
    expected: str  # what the output must say
    untouched: dict[str, float]  # the older good checkpoint's metadata time
    result: subprocess.CompletedProcess
    seconds: float


def _resume_damaged(good: str, root: str, kind: str) -> Resumed:
    """Damage a copy of the good run at `root` and resume it."""
    shutil.copytree(good, root)
    resume_from, expected = _damage(root, kind)
    untouched = {
        name: os.path.getmtime(os.path.join(root, name, "metadata.json"))
        for name in ("iter_0000002",)
        if resume_from is not None
    }
    result, seconds = _pretrain(
        *TINY, *MOCK, "--train-iters", "6", "--save-interval", "2", "--save", root, "--load", root
    )
    return Resumed(root, resume_from, expected, untouched, result, seconds)


@pytest.fixture(scope="module")
def damaged_runs(request, reference, tmp_path_factory):
    """Every selected case's damaged copy, resumed: the runs start together, two at a time."""
    with Runs(jobs=2) as runs:
        test = "test_checkpoint_faults_resume_from_the_newest_good_one"
        for kind in selected(request, test, "kind"):
            root = str(tmp_path_factory.mktemp(kind) / "run")
            runs.start(kind, _resume_damaged, reference[0], root, kind)
        yield runs


@pytest.mark.parametrize("kind", CHECKPOINT_CASES)
def test_checkpoint_faults_resume_from_the_newest_good_one(kind, reference, damaged_runs):
    good, straight = reference
    root, resume_from, expected, untouched, result, seconds = damaged_runs.result(kind)
    losses = logged_losses(result.stdout)["train"]
    if resume_from is not None and losses != {i: straight.get(i) for i in losses}:
        # Once in CI one resumed loss was 6e-6 off and the next bitwise (a wrong RNG stream is
        # 6e-3 off): a damaged copy resumed again must match bitwise, and the first is named.
        message = f"{kind}: resumed losses {losses} differ from {straight}; run again"
        warnings.warn(message, stacklevel=1)
        root, resume_from, expected, untouched, result, seconds = _resume_damaged(
            good, root + "-again", kind
        )
        losses = logged_losses(result.stdout)["train"]
    if resume_from is None:
        _refused(result, seconds, expected)
        # Found before torch is imported: the launchers' check refuses it before any worker.
        _refused(*_pretrain(*TINY, *MOCK, "--load", root, THREEFOLD_VALIDATE_ONLY="1"), expected)
        return
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output and expected in output, output[-3000:]
    assert f"at iteration {resume_from}" in result.stdout
    assert losses and all(losses[i] == straight[i] for i in losses), (losses, straight)
    assert sorted(losses) == list(range(resume_from + 1, 7))
    assert open(os.path.join(root, TRACKER)).read().strip() == "6"
    for name, mtime in untouched.items():  # the good older checkpoint was not rewritten
        assert os.path.getmtime(os.path.join(root, name, "metadata.json")) == mtime
    assert not [n for n in os.listdir(root) if n.endswith((".partial", ".replaced"))]


def test_a_one_rank_checkpoint_resumes_at_data_parallel_2_from_rank_0s_streams(reference, tmp_path):
    """The launchers' check (one process, WORLD_SIZE of the job): a 1-rank checkpoint resumed
    on 2 ranks gives both data-parallel replicas rank 0's RNG streams (before: refused for
    want of rank 1's), so without rank 0's it is refused before any worker starts."""
    flags = [*TINY, *MOCK, "--train-iters", "6", "--load"]
    result, _ = _pretrain(*flags, reference[0], THREEFOLD_VALIDATE_ONLY="1", WORLD_SIZE="2")
    assert result.returncode == 0, result.stderr[-3000:]
    root = str(tmp_path / "run")
    shutil.copytree(reference[0], root)
    _damage(root, "missing-rng-without-manifest")
    early = _pretrain(*flags, root, THREEFOLD_VALIDATE_ONLY="1", WORLD_SIZE="2")
    _refused(*early, "rank_00000.pt is missing, so rank 0's random streams cannot resume")


def test_a_damaged_load_is_refused_before_torch_is_imported(reference, tmp_path):
    root = str(tmp_path / "run")
    shutil.copytree(reference[0], root)
    _, expected = _damage(root, "everything-damaged")
    check = (
        "import sys\n"
        "from threefold.arguments import parse_args\n"
        "from threefold.validation import check_inputs\n"
        "try:\n"
        "    check_inputs(parse_args(sys.argv[1:]))\n"
        "except ValueError as error:\n"
        "    print(error)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    flags = [*TINY, *MOCK, "--train-iters", "6", "--load", root]
    result = subprocess.run(
        [sys.executable, "-c", check, *flags], capture_output=True, text=True, cwd=ROOT
    )
    assert expected in result.stdout and "torch imported: False" in result.stdout, (
        result.stdout + result.stderr[-2000:]
    )


def test_rerunning_a_finished_run_rewrites_nothing(reference, tmp_path):
    good, _ = reference
    root = str(tmp_path / "run")
    shutil.copytree(good, root)
    before = {
        n: os.path.getmtime(os.path.join(root, "iter_0000004", n))
        for n in os.listdir(os.path.join(root, "iter_0000004"))
    }
    result, _ = _pretrain(
        *TINY, *MOCK, "--train-iters", "4", "--save-interval", "2", "--save", root, "--load", root
    )
    assert result.returncode == 0, result.stderr[-3000:]
    after = {
        n: os.path.getmtime(os.path.join(root, "iter_0000004", n))
        for n in os.listdir(os.path.join(root, "iter_0000004"))
    }
    assert before == after


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_during_a_save_ends_in_one_line_and_keeps_the_last_checkpoint(
    asynchronous, reference, tmp_path
):
    """Files above 100 kB cannot be written (as on a full disk): the save of iteration 6
    fails, the run stops with one line, and the tracker still names iteration 4, which
    loads."""
    good, straight = reference
    root = str(tmp_path / "run")
    shutil.copytree(good, root)
    flags = [*TINY, *MOCK, "--save-interval", "2", "--save", root, "--load", root]
    result, _ = _pretrain(
        *flags,
        "--train-iters",
        "8",
        *(["--async-save"] if asynchronous else []),
        limit_file_bytes=100_000,
    )
    _refused(result, 0, "saving iteration 6 failed", code=1)
    assert "GiB free there); the previous checkpoint is untouched" in result.stderr
    assert open(os.path.join(root, TRACKER)).read().strip() == "4"
    resumed, _ = _pretrain(*flags, "--train-iters", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at iteration 4" in resumed.stdout
    assert logged_losses(resumed.stdout)["train"] == {5: straight[5], 6: straight[6]}


def test_a_second_run_on_the_same_save_directory_is_refused(tmp_path):
    root = str(tmp_path / "run")
    first = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "pretrain_gpt.py"),
            *TINY,
            *MOCK,
            "--train-iters",
            "100000",
            "--save",
            root,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(root, ".threefold.lock")):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)
        _refused(*_pretrain(*TINY, *MOCK, "--train-iters", "2", "--save", root), "another run (pid")
    finally:
        first.kill()
        first.wait()
    # Once the first run is gone (even killed), the directory is free again.
    result, _ = _pretrain(*TINY, *MOCK, "--train-iters", "2", "--save", root)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_signal_during_start_up_is_kept_until_the_first_iteration(tmp_path):
    """SIGUSR1 while torch is still importing: with --exit-signal-handler the run trains one
    iteration, saves and exits 0 (it used to die without a save)."""
    root = str(tmp_path / "run")
    run = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "pretrain_gpt.py"),
            *TINY,
            *MOCK,
            "--train-iters",
            "1000",
            "--save",
            root,
            "--exit-signal-handler",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(root, ".threefold.lock")):  # flags parsed
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    run.send_signal(signal.SIGUSR1)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr[-3000:]
    assert "received SIGUSR1" in stdout
    assert open(os.path.join(root, TRACKER)).read().strip() == "1"


def test_an_injected_loss_spike_is_reported_with_its_batch(tmp_path):
    result, _ = _pretrain(
        *TINY, *MOCK, "--train-iters", "8", "--check-for-spiky-loss", THREEFOLD_SPIKE_AT="0@7x50"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "spiky loss at iteration 7" in result.stdout
    assert "global batch 6, samples 24 to 27" in result.stdout
    assert result.stdout.count("spiky loss") == 1


# -- tools/preprocess_data.py -----------------------------------------------------------------
BAD_RECORDS = {
    "malformed-json": b'{"text": "a b c"\n',
    "not-utf8": b'{"text": "\xff\xfe"}\n',
    "missing-key": b'{"body": "a b"}\n',
    "null-text": b'{"text": null}\n',
    # met by the tokenizer, in a worker process: NullTokenizer reads ids, 0 to --vocab-size
    "not-token-ids": b'{"text": "1 two 3"}\n',
    "id-outside-the-vocabulary": b'{"text": "1 2 101"}\n',
}


GOOD_LINES = [json.dumps({"text": f"{i} {i + 1} {i + 2}"}).encode() + b"\n" for i in range(20)]


def _preprocess(corpus, output_prefix, *extra: str) -> subprocess.CompletedProcess:
    tool = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py")]
    tool += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    tool += ["--output-prefix", str(output_prefix), "--input", str(corpus), *extra]
    return subprocess.run(tool, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def preprocessed_good_corpus(tmp_path_factory) -> dict[str, bytes]:
    """The .bin/.idx of the corpus without its bad records: what a refused run must keep."""
    directory = tmp_path_factory.mktemp("good")
    (directory / "corpus.jsonl").write_bytes(b"".join(GOOD_LINES))
    assert _preprocess(directory / "corpus.jsonl", directory / "out").returncode == 0
    return {
        suffix: (directory / f"out_text_document{suffix}").read_bytes()
        for suffix in (".bin", ".idx")
    }


def _preprocess_a_bad_record(directory, kind: str, good: dict[str, bytes]) -> tuple:
    """Over a previous good run's output in `directory`, preprocess the corpus with one bad
    record: (the run, its seconds)."""
    for suffix, content in good.items():
        (directory / f"out_text_document{suffix}").write_bytes(content)
    bad = GOOD_LINES[0] + GOOD_LINES[1] + BAD_RECORDS[kind] + b"".join(GOOD_LINES)
    (directory / "corpus.jsonl").write_bytes(bad)
    start = time.monotonic()
    result = _preprocess(directory / "corpus.jsonl", directory / "out")
    return result, time.monotonic() - start


@pytest.fixture(scope="module")
def bad_record_runs(request, preprocessed_good_corpus, tmp_path_factory):
    """The selected bad records' runs, started together, two at a time: {kind: folder}."""
    folders = {}
    with Runs(jobs=2) as runs:
        test = "test_preprocess_refuses_a_bad_record_and_keeps_the_good_files"
        for kind in selected(request, test, "kind"):
            folders[kind] = tmp_path_factory.mktemp(kind)
            runs.start(
                kind, _preprocess_a_bad_record, folders[kind], kind, preprocessed_good_corpus
            )
        yield runs, folders


@pytest.mark.parametrize("kind", sorted(BAD_RECORDS))
def test_preprocess_refuses_a_bad_record_and_keeps_the_good_files(
    kind, bad_record_runs, preprocessed_good_corpus
):
    runs, folders = bad_record_runs
    _refused(*runs.result(kind), "corpus.jsonl:3:")
    pair = {suffix: folders[kind] / f"out_text_document{suffix}" for suffix in (".bin", ".idx")}
    assert {suffix: path.read_bytes() for suffix, path in pair.items()} == preprocessed_good_corpus
    assert sorted(os.listdir(folders[kind])) == [
        "corpus.jsonl",
        *sorted(p.name for p in pair.values()),
    ]


def test_preprocess_skips_every_kind_of_bad_record_when_asked(tmp_path, preprocessed_good_corpus):
    """--skip-bad-records: each bad record named on stderr, the rest preprocessed as if the
    bad ones were not there."""
    corpus = b"".join(GOOD_LINES[:2])
    corpus += b"".join(BAD_RECORDS[kind] for kind in sorted(BAD_RECORDS)) + b"".join(GOOD_LINES)
    (tmp_path / "corpus.jsonl").write_bytes(corpus)
    skipped = _preprocess(tmp_path / "corpus.jsonl", tmp_path / "out", "--skip-bad-records")
    assert skipped.returncode == 0 and f"skipped {len(BAD_RECORDS)} bad records" in skipped.stdout
    for line in range(3, 3 + len(BAD_RECORDS)):
        assert f"corpus.jsonl:{line}:" in skipped.stderr
    assert (tmp_path / "out_text_document.bin").stat().st_size > len(
        preprocessed_good_corpus[".bin"]
    )


@pytest.mark.parametrize(
    "retention,kept",
    [
        (["--ckpt-keep-latest", "2"], [4, 5]),
        # Megatron-LM's: multiples of 2 stay, and the last one
        (["--save-retain-interval", "2"], [2, 4, 5]),
    ],
    ids=["keep-latest", "retain-interval"],
)
def test_retention_deletes_only_older_complete_checkpoints(tmp_path, retention, kept):
    root = tmp_path / "run"
    root.mkdir()
    (root / "iter_0000009.partial").mkdir()  # an abandoned save is tidied, not "kept"
    result, _ = _pretrain(
        *TINY, *MOCK, "--train-iters", "5", "--save-interval", "1", "--save", str(root),
        *retention,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [f"iter_{i:07d}" for i in kept] + [TRACKER]
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == expected


def test_retention_keeps_the_newest_and_every_retained_interval():
    from threefold.checkpoint.writer import superseded

    older = [9, 8, 6, 4, 3, 2]  # newest first, older than the save just committed
    assert superseded(older, None, None) == []
    assert superseded(older, 3, None) == [6, 4, 3, 2]
    assert superseded(older, None, 4) == [9, 6, 3, 2]
    assert superseded(older, 2, 3) == [8, 4, 2]


def test_shape_changing_flags_that_differ_from_the_checkpoint(reference, tmp_path):
    """A learned position table of another size is refused in one line; another vocabulary
    padding loads through resharding."""
    good, _ = reference
    flags = [*TINY, *MOCK, "--train-iters", "6", "--load", good]
    runs = run_together(
        _pretrain,
        {
            "positions": (*flags, "--max-position-embeddings", "32"),
            "padding": (*flags, "--make-vocab-size-divisible-by", "256"),
        },
    )
    _refused(*runs["positions"], "--max-position-embeddings 16 but this run has 32")
    result, _ = runs["padding"]
    assert result.returncode == 0 and "at iteration 4" in result.stdout, result.stderr[-3000:]
