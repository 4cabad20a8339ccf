"""Flags from Megatron-LM's own launch scripts: aliases become the flag they stand for, options
with one supported value refuse the others in one line, switches with no counterpart are
accepted and named at start-up; --lr-warmup-fraction, --manual-gc and
--empty-unused-memory-level do what they do in Megatron-LM."""

import dataclasses
import gc
import re

import pytest
import torch

from tests.conftest import CLI_MODEL
from tests.parity import GPT2_STYLE, TRAINING
from threefold import megatron_compat
from threefold.arguments import parse_args
from threefold.config import TrainingConfig
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.lr_scheduler import OptimizerParamScheduler
from threefold.training.memory_hygiene import MemoryHygiene
from threefold.training.trainer import Trainer

BASE = CLI_MODEL + "--train-iters 100".split()


def test_a_megatron_llama_script_line_parses():
    """The model, parallel and kernel flags of Megatron-LM's examples/llama bf16 script."""
    config = parse_args(
        BASE
        + [
            "--use-mcore-models",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "1000000",
            "--rotary-percent",
            "1.0",
            "--swiglu",
            "--attention-backend",
            "auto",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--bf16",
            "--cross-entropy-loss-fusion",
            "--context-parallel-size",
            "1",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--manual-gc",
            "--empty-unused-memory-level",
            "1",
            "--lr-warmup-fraction",
            ".01",
            "--log-throughput",
            "--no-masked-softmax-fusion",
            "--no-bias-dropout-fusion",
            "--no-gradient-accumulation-fusion",
            "--no-create-attention-mask-in-dataloader",
            "--attention-softmax-in-fp32",
        ]
    )
    assert config.training.manual_gc and config.training.empty_unused_memory_level == 1
    assert config.training.lr_warmup_iters == pytest.approx(1.0)


def test_megatron_llama3_recipe_flags_parse(tmp_path):
    """The non-FP8 flags of Megatron-LM's examples/llama Llama-3 8B H100 recipe, model shrunk."""
    config = parse_args(
        """
        --use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 128
        --num-attention-heads 8 --group-query-attention --num-query-groups 4 --kv-channels 8
        --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
        --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
        --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
        --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
        --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
        --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4
        --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1
        --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
        --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
        --empty-unused-memory-level 1 --exit-duration-in-mins 235
        --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --mock-data
        --vocab-size 1000 --split '99,1,0' --no-create-attention-mask-in-dataloader
        --num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100
        --save-interval 1000 --log-throughput --ckpt-format torch_dist
        --distributed-timeout-minutes 60""".split()
        + ["--save", str(tmp_path)]
    )
    assert not config.parallel.accumulate_allreduce_grads_in_fp32
    assert config.training.calculate_per_token_loss and config.training.decoupled_lr == 5e-4
    assert config.model.apply_layernorm_1p and config.checkpoint.save == str(tmp_path)


@pytest.mark.parametrize("flag", sorted(megatron_compat.ALIASES))
def test_aliases_are_the_flag_they_stand_for(flag):
    dest, value = megatron_compat.ALIASES[flag]
    concern, field = dest.split(".")
    config = parse_args(BASE + [flag])
    assert getattr(getattr(config, concern), field) == value


@pytest.mark.parametrize("flag", sorted(megatron_compat.ONLY_DEFAULT))
def test_options_refuse_all_but_their_supported_values(flag, capsys):
    kind, supported, why = megatron_compat.ONLY_DEFAULT[flag]
    accepted = supported if isinstance(supported, tuple) else (supported,)
    for value in accepted:
        parse_args(BASE + [flag, str(value)])
    capsys.readouterr()
    other = {int: "2", float: "0.5", str: "cyclic"}[kind]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + [flag, other])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"pretrain_gpt.py: error: {flag} {kind(other)}: {why} in threefold; use "
        f"{' or '.join(map(str, accepted))} or drop the flag"
    )


@pytest.mark.parametrize("flag", sorted(megatron_compat.NO_COUNTERPART))
def test_switches_without_a_counterpart_are_named_at_start_up(flag, capsys):
    plain = parse_args(BASE)
    capsys.readouterr()
    config = parse_args(BASE + [flag])
    assert f"> {flag} has no effect: " in capsys.readouterr().out
    assert dataclasses.asdict(config) == dataclasses.asdict(plain)


@pytest.mark.parametrize("flag", sorted(megatron_compat.ANY_VALUE))
def test_settings_without_a_counterpart_are_named_at_start_up(flag, capsys):
    kind, _ = megatron_compat.ANY_VALUE[flag]
    plain = parse_args(BASE)
    capsys.readouterr()
    config = parse_args(BASE + [flag, {int: "3", str: "x"}[kind]])
    assert f"> {flag} {kind({int: '3', str: 'x'}[kind])} has no effect: " in capsys.readouterr().out
    assert dataclasses.asdict(config) == dataclasses.asdict(plain)


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--batch-size", "4"], "--batch-size: removed from Megatron-LM: use --micro-batch-size"),
        (["--checkpoint-activations"], "use --recompute-activations"),
        (["--bert-no-binary-head"], "BERT, T5, vision and retrieval models"),
        (["--inprocess-restart"], "in-process restarts (NVIDIA Resiliency Extension)"),
        (["--spec", "my.module", "spec"], "threefold imports no code its command line names"),
    ],
    ids=["removed", "removed-switch", "bert", "prefix", "spec"],
)
def test_megatron_lms_other_flags_are_named_in_one_line(argv, named, capsys):
    """Flags of Megatron-LM's parser for what threefold does not have (or Megatron-LM no
    longer takes) name it, rather than argparse's "unrecognized arguments"."""
    with pytest.raises(SystemExit):
        parse_args(BASE + argv)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_lr_warmup_fraction_is_a_fraction_of_the_decay_iterations(capsys):
    config = parse_args(
        BASE + ["--lr-warmup-fraction", "0.25", "--lr-decay-iters", "10", "--lr", "1.0"]
    )
    assert config.training.lr_warmup_iters == 2.5
    scheduler = OptimizerParamScheduler(torch.optim.SGD([torch.zeros(1)], lr=0), config.training)
    assert [scheduler.step() for _ in range(3)] == pytest.approx([0.4, 0.8, 1.0 - 0.5 / 7.5])
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"])
    assert (
        "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive"
        in capsys.readouterr().err
    )


def test_manual_gc_disables_the_collector_and_collects_on_schedule(monkeypatch):
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(gc.isenabled()))
    assert gc.isenabled()
    hygiene = MemoryHygiene(
        TrainingConfig(manual_gc=True, manual_gc_interval=3), torch.device("cpu")
    )
    with hygiene:
        assert not gc.isenabled() and len(collections) == 1
        for iteration in range(1, 8):
            hygiene.after_iteration(iteration)
        assert len(collections) == 3  # after iterations 3 and 6
        with hygiene.evaluation():
            assert len(collections) == 4
        assert len(collections) == 5
    assert gc.isenabled()
    off = MemoryHygiene(TrainingConfig(manual_gc=True, manual_gc_eval=False), torch.device("cpu"))
    with off:
        off.after_iteration(100)  # interval 0: no scheduled collections
        with off.evaluation():
            pass
    assert len(collections) == 6 and gc.isenabled()  # only the one on entry


def test_the_trainer_runs_under_manual_gc_and_restores_the_collector(monkeypatch):
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(gc.isenabled()))
    argv = (
        GPT2_STYLE
        + TRAINING
        + [
            "--train-iters",
            "4",
            "--manual-gc",
            "--manual-gc-interval",
            "2",
            "--empty-unused-memory-level",
            "2",
        ]
    )
    trainer = Trainer(parse_args(argv), torch.device("cpu"), ParallelContext())
    trainer.train()
    # entry, iterations 2 and 4, before and after each of the reports after training
    # (validation set, test set)
    assert collections == [False] * 7
    assert gc.isenabled()


def _without(argv: list[str], *flags: str) -> list[str]:
    """`argv` less the given flags and their values (up to the next flag)."""
    kept, dropping = [], False
    for arg in argv:
        if arg.startswith("--"):
            dropping = arg in flags
        if not dropping:
            kept.append(arg)
    return kept


SAMPLES = _without(BASE, "--train-iters") + ["--global-batch-size", "8", "--lr", "1.0"]


def _lrs(argv: list[str], iterations: int) -> list[float]:
    config = parse_args(argv)
    scheduler = OptimizerParamScheduler(torch.optim.SGD([torch.zeros(1)], lr=0), config.training)
    return [scheduler.iteration_done(config.training.global_batch_size) for _ in range(iterations)]


def test_sample_based_training_counts_the_run_and_schedule_in_samples():
    config = parse_args(SAMPLES + ["--train-samples", "100"])
    assert config.training.train_iters == 12 and config.training.lr_decay_samples == 100
    # Whole global batches: the same schedule as in iterations.
    assert _lrs(
        SAMPLES
        + [
            "--train-samples",
            "80",
            "--lr-warmup-samples",
            "16",
            "--lr-decay-samples",
            "80",
            "--lr-decay-style",
            "cosine",
        ],
        12,
    ) == pytest.approx(
        _lrs(
            SAMPLES
            + [
                "--train-iters",
                "10",
                "--lr-warmup-iters",
                "2",
                "--lr-decay-iters",
                "10",
                "--lr-decay-style",
                "cosine",
            ],
            12,
        )
    )
    # A warm-up of 12 samples ends half-way through the second global batch.
    assert _lrs(
        SAMPLES + ["--train-samples", "80", "--lr-warmup-samples", "12"], 2
    ) == pytest.approx([8 / 12, 1.0 - 4 / 68])
    assert (
        parse_args(
            SAMPLES + ["--train-samples", "80", "--lr-warmup-fraction", "0.25"]
        ).training.lr_warmup_samples
        == 20
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--train-samples", "80", "--train-iters", "10"],
            "--train-iters and --train-samples are mutually exclusive",
        ),
        (
            ["--train-samples", "80", "--lr-decay-iters", "10"],
            "with --train-samples the LR schedule is in samples",
        ),
        (
            ["--train-iters", "10", "--lr-warmup-samples", "8"],
            "--lr-warmup-samples and --lr-decay-samples need --train-samples",
        ),
        (["--train-samples", "4"], "--train-samples 4 is less than one global batch of 8"),
    ],
)
def test_sample_based_mistakes_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(SAMPLES + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_sample_based_run_trains_its_iterations(capsys):
    config = parse_args(
        GPT2_STYLE
        + _without(TRAINING, "--train-iters", "--lr-warmup-iters")
        + ["--train-samples", "20", "--lr-warmup-samples", "4", "--log-interval", "1"]
    )
    Trainer(config, torch.device("cpu"), ParallelContext()).train()
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert [re.search(r"iteration +(\d+)/ +(\d+)", line).groups() for line in lines] == [
        ("1", "2"),
        ("2", "2"),
    ]
    assert " consumed samples:           16 |" in lines[-1]


def test_no_position_embedding_goes_with_rope_only(capsys):
    rope = parse_args(BASE + ["--position-embedding-type", "rope", "--no-position-embedding"])
    assert rope.model.position_embedding_type == "rope"
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + ["--no-position-embedding"])
    assert exit_info.value.code == 2
    assert (
        "--no-position-embedding: a model without position information is not "
        "implemented" in capsys.readouterr().err
    )


def test_functional_test_flags_parse_with_their_megatron_meaning(capsys):
    """Flags most of Megatron-LM's functional-test configs pass that change nothing about the
    model: accepted, each named at start-up with why."""
    config = parse_args(
        BASE
        + """--deterministic-mode --use-persistent-ckpt-worker --dist-ckpt-strictness log_all
        --dist-ckpt-optim-fully-reshardable --ckpt-fully-parallel-load
        --apply-query-key-layer-scaling --logging-level 40 --ckpt-format torch_dist
        --ckpt-assume-constant-structure --async-strategy nvrx --async-ckpt-use-cpu-shm""".split()
    )
    out = capsys.readouterr().out
    for flag in (
        "--use-persistent-ckpt-worker has no effect",
        "--dist-ckpt-optim-fully-reshardable has no effect",
        "--ckpt-fully-parallel-load has no effect",
        "--apply-query-key-layer-scaling has no effect",
        "--logging-level 40 has no effect",
        "--ckpt-assume-constant-structure has no effect",
        "--async-strategy nvrx has no effect",
        "--async-ckpt-use-cpu-shm has no effect",
    ):
        assert f"> {flag}: " in out, flag
    assert config.kernels.deterministic_mode
    assert config.checkpoint.dist_ckpt_strictness == "log_all"  # (a flag of threefold's)


def test_nan_checking_is_on_by_default_as_in_megatron():
    assert parse_args(BASE).training.check_for_nan_in_loss_and_grad
    assert parse_args(
        BASE + ["--check-for-nan-in-loss-and-grad"]
    ).training.check_for_nan_in_loss_and_grad
    off = parse_args(BASE + ["--no-check-for-nan-in-loss-and-grad"])
    assert not off.training.check_for_nan_in_loss_and_grad


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v2"],
            "--tokenizer-type TikTokenizer: tiktoken vocabularies are not read by threefold; "
            "save the tokenizer as a Hugging Face tokenizer.json and use --tokenizer-type "
            "HuggingFaceTokenizer",
        ),
        (
            ["--vocab-file", "vocab.json"],
            "--vocab-file and --merge-file (GPT2BPETokenizer's files) go together; give both, "
            "or --tokenizer-type for another tokenizer",
        ),
        (
            ["--tokenizer-type", "Llama2Tokenizer"],
            "--tokenizer-type Llama2Tokenizer needs --tokenizer-model FILE",
        ),
    ],
    ids=["tiktoken", "vocab-without-merges", "llama2-without-model"],
)
def test_megatron_tokenizer_mistakes_are_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"pretrain_gpt.py: error: {message}"


def test_a_tokenizer_file_its_type_does_not_read_is_said(capsys):
    """Megatron-LM ignores them (and launch scripts pass GPT-2's files to any type): a
    warning, not a refusal, and not silence."""
    parse_args(BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-file", "vocab.json"])
    assert "WARNING: --vocab-file vocab.json is not read by --tokenizer-type NullTokenizer" in (
        capsys.readouterr().out
    )
    parse_args(BASE + ["--tokenizer-model", "tokenizer.model"])  # (mock data, no tokenizer)
    assert "WARNING: --tokenizer-model tokenizer.model is not read without --tokenizer-type" in (
        capsys.readouterr().out
    )


def test_gpt2_files_without_a_type_are_gpt2s_tokenizer():
    """Megatron-LM's GPT-3 example passes --vocab-file/--merge-file and no --tokenizer-type."""
    config = parse_args(BASE + ["--vocab-file", "vocab.json", "--merge-file", "merges.txt"])
    assert config.data.tokenizer_type == "GPT2BPETokenizer"


def test_megatrons_sentencepiece_tokenizers(tmp_path):
    """GPTSentencePieceTokenizer is the plain sentencepiece model; Llama2Tokenizer puts a BOS
    before every text, as Megatron-LM's."""
    import sentencepiece

    from threefold.config import DataConfig
    from threefold.data.tokenizer import build_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("\n".join(["to be or not to be that is the question"] * 50))
    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=prefix, vocab_size=19, minloglevel=2
    )
    tokenizers = {
        kind: build_tokenizer(
            DataConfig(tokenizer_type=kind, tokenizer_model=prefix + ".model"), None
        )
        for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer")
    }
    plain = tokenizers["GPTSentencePieceTokenizer"].tokenize("to be")
    llama2 = tokenizers["Llama2Tokenizer"]
    assert llama2.tokenize("to be") == [llama2.bos, *plain]
    assert llama2.eod == tokenizers["GPTSentencePieceTokenizer"].eod == llama2.processor.eos_id()


def test_nccl_on_a_machine_without_gpus_is_one_line(capsys):
    import pretrain_gpt

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA GPUs")
    code = pretrain_gpt.main(BASE + ["--mock-data", "--distributed-backend", "nccl"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "pretrain_gpt.py: error: --distributed-backend nccl needs CUDA GPUs and this machine "
        "has none; pass --distributed-backend gloo (or leave it out: gloo on CPU, nccl on GPUs)"
    ]


def test_deterministic_mode_sets_megatrons_environment_and_torch(monkeypatch):
    from threefold.config import ConfigError, KernelConfig
    from threefold.kernels import dispatch
    from threefold.kernels.determinism import DEFAULTS, deterministic_environment

    for name in DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's deterministic choice
    try:
        shape = dispatch.AttentionShape(heads=4, groups=4, head_dim=16, dropout=0.0)
        line = dispatch.configure(
            KernelConfig(deterministic_mode=True),
            torch.device("cpu"),
            torch.float32,
            "RMSNorm",
            shape,
        )
        assert torch.are_deterministic_algorithms_enabled()
        assert "deterministic" in line and "NCCL_ALGO=Ring" in line
        assert "CUBLAS_WORKSPACE_CONFIG=:16:8" in line
    finally:
        torch.use_deterministic_algorithms(False)
        dispatch.KERNELS.use_reference()
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(ConfigError, match="NCCL_ALGO=Tree may reorder sums"):
        deterministic_environment()


def _parallel_fields(config) -> dict:
    """The run's parallel settings, less Megatron-FSDP's own flags (what they set is compared)."""
    from threefold.config.megatron_fsdp import MegatronFsdpConfig

    values = dataclasses.asdict(config)
    for name in MegatronFsdpConfig.__dataclass_fields__:
        del values["parallel"][name]
    return values


def test_megatron_fsdp_runs_as_fsdp2(capsys):
    """A Megatron-FSDP script's flags (v1 wants the distributed optimizer, its overlaps are
    FSDP's prefetch and reduction) are the FSDP2 run, whose parity tests stand for it; under
    --bf16 its default gradient communication is bf16 (FSDP2's bf16 reduce-scatter)."""
    fsdp = "--use-megatron-fsdp --use-distributed-optimizer --overlap-grad-reduce "
    fsdp += "--overlap-param-gather --ckpt-format fsdp_dtensor --bf16"
    config = parse_args(BASE + fsdp.split(), world_size=2)
    out = capsys.readouterr().out
    torch_fsdp2 = "--use-torch-fsdp2 --grad-reduce-in-bf16 --bf16 --ckpt-format fsdp_dtensor"
    torch_fsdp2 = parse_args(BASE + torch_fsdp2.split(), 2)
    assert _parallel_fields(config) == _parallel_fields(torch_fsdp2)
    assert config.parallel.distributed_strategy == "fsdp"
    assert "WARNING: --use-megatron-fsdp runs as FSDP2 (--distributed-strategy fsdp)" in out
    assert "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather with " in out
    assert "--megatron-fsdp-main-grads-dtype bf16: FSDP2 accumulates gradients in fp32" in out
    assert "WARNING: --ckpt-format fsdp_dtensor: checkpoints are saved in threefold's format" in out
    # Megatron-LM's functional test gives every dtype as fp32: FSDP2's defaults
    fp32 = " --megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32"
    fp32 += " --megatron-fsdp-grad-comm-dtype fp32"
    config = parse_args(BASE + (fsdp + fp32).split(), world_size=2)
    assert "main-grads-dtype" not in capsys.readouterr().out
    torch_fsdp2 = "--use-torch-fsdp2 --bf16 --ckpt-format fsdp_dtensor"
    torch_fsdp2 = parse_args(BASE + torch_fsdp2.split(), world_size=2)
    assert _parallel_fields(config) == _parallel_fields(torch_fsdp2)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads",
            "--data-parallel-sharding-strategy optim_grads keeps whole parameters on every "
            "rank; threefold has it as its distributed optimizer",
        ),
        (
            "--use-megatron-fsdp --data-parallel-sharding-strategy no_shard",
            "threefold has it as plain data parallelism",
        ),
        (
            "--use-megatron-fsdp --megatron-fsdp-main-params-dtype bf16",
            "--megatron-fsdp-main-params-dtype bf16: FSDP2 keeps fp32 master parameters",
        ),
        (
            "--use-megatron-fsdp --megatron-fsdp-main-params-dtype auto --bf16",
            "--megatron-fsdp-main-params-dtype auto: FSDP2 keeps fp32",
        ),
        ("--use-megatron-fsdp --fp16", "--megatron-fsdp-grad-comm-dtype fp16: FSDP2"),
        (
            "--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype bf16",
            "--megatron-fsdp-grad-comm-dtype bf16: FSDP2 reduce-scatters in fp32, or in bf16 "
            "under --bf16",
        ),
        ("--use-megatron-fsdp --outer-dp-sharding-strategy optim", "hybrid FSDP"),
        ("--use-megatron-fsdp --use-torch-fsdp2", "drop --distributed-strategy fsdp"),
        (
            "--data-parallel-sharding-strategy optim --outer-dp-sharding-strategy optim",
            "--data-parallel-sharding-strategy --outer-dp-sharding-strategy belong to "
            "Megatron-FSDP: add --use-megatron-fsdp or drop them",
        ),
    ],
)
def test_what_megatron_fsdp_does_not_carry_over_is_refused_in_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + extra.split(), world_size=2)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_tp_comm_overlap_needs_sequence_parallelism_and_takes_every_fp8_recipe(capsys):
    """Megatron-LM asserts the same: the overlap is of the sequence-parallel collectives. Its
    userbuffers' tuning file is taken and named; FP8 layers overlap with every recipe,
    --no-fp8-wgrad too, with nothing to warn about."""
    tp2 = ["--tensor-model-parallel-size", "2", "--tp-comm-overlap"]
    with pytest.raises(SystemExit):
        parse_args(BASE + tp2, world_size=2)
    assert "--tp-comm-overlap overlaps the sequence-parallel collectives" in capsys.readouterr().err
    config = parse_args(BASE + tp2 + ["--sequence-parallel", "--tp-comm-overlap-cfg", "ub.yaml"], 2)
    assert config.parallel.tp_comm_overlap
    assert "> --tp-comm-overlap-cfg ub.yaml has no effect" in capsys.readouterr().out
    fp8 = tp2 + ["--sequence-parallel", "--fp8-format", "hybrid", "--fp8-recipe"]
    for recipe in ("tensorwise", "blockwise --no-fp8-wgrad", "tensorwise --no-fp8-wgrad"):
        parse_args(BASE + fp8 + recipe.split(), world_size=2)
        assert "--tp-comm-overlap" not in capsys.readouterr().out
