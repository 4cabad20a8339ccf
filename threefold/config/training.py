"""The training-loop config: batch sizes, schedule, optimizer, precision, exit conditions and
memory hygiene (torch-free: flags are parsed before torch loads); the checks on what a step
computes are config/result_checks.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.evaluation import EvaluationConfig
from threefold.config.fields import arg
from threefold.config.muon import MuonConfig
from threefold.config.precision_aware import PrecisionAwareConfig
from threefold.config.result_checks import ResultChecksConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str) -> int | None:
    """'250B' -> 250 * 10**9 (Megatron-LM's suffixes K, M, B, T); None when not a number."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except (ValueError, OverflowError):  # (not a number, NaN; infinity)
        return None


@dataclass
class TrainingConfig(EvaluationConfig, MuonConfig, PrecisionAwareConfig, ResultChecksConfig):
    micro_batch_size: int = arg(
        1, minimum=1, help="samples per forward/backward on each data-parallel rank"
    )
    global_batch_size: int | None = arg(
        None, minimum=1, help="samples per optimizer step; default --micro-batch-size x DP"
    )
    train_iters: int | None = arg(
        None, help="optimizer steps to train (default 100 unless --train-samples)"
    )  # 100 unless --train-samples says otherwise
    # Sample-based training (Megatron): the run and the LR schedule counted in samples;
    # train_iters becomes train_samples // global_batch_size.
    train_samples: int | None = arg(
        None,
        help=(
            "train on this many samples (instead of --train-iters); the LR "
            "schedule is then in samples too"
        ),
    )
    lr_warmup_samples: int = arg(0, minimum=0, help="with --train-samples")
    lr_decay_samples: int | None = arg(None, help="with --train-samples (default: --train-samples)")
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START
    # by INCREMENT in equal steps over the first SAMPLES samples, then stays at
    # global_batch_size.
    rampup_batch_size: list[int] | None = arg(
        None,
        help=(
            "grow the global batch from START by INCREMENT over SAMPLES "
            "samples (needs --train-samples)"
        ),
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    # Megatron-LM's --step-batch-size-schedule "0:384 200B:768 400B:1152": from each threshold
    # of tokens consumed (suffixes K, M, B, T), that global batch size; the last one is
    # --global-batch-size's stand-in, which it replaces.
    step_batch_size_schedule: str | None = arg(
        None,
        help="global batch size by tokens consumed, 'THRESHOLD:SIZE ...' (the first threshold "
        "0; K, M, B, T suffixes), instead of --global-batch-size",
        metavar="SCHEDULE",
    )
    # (threshold in samples, global batch size), from the schedule at finalize
    step_batch_sizes: list[tuple[int, int]] = arg(default_factory=list, cli=False)
    lr: float = arg(3e-4, help="peak learning rate")
    min_lr: float = arg(0.0, help="final learning rate of the decay")
    lr_decay_style: str = arg(
        "linear", choices=LR_DECAY_STYLES, help="shape of the learning-rate decay after warmup"
    )
    lr_warmup_iters: float = arg(
        0, type=int, minimum=0, help="iterations of linear warmup from --lr-warmup-init to --lr"
    )  # iterations; fractional when set from lr_warmup_fraction
    lr_warmup_init: float = arg(
        0.0, minimum=0, help="the learning rate warmup starts from (default 0)"
    )
    lr_warmup_fraction: float | None = arg(
        None, help="warm up over this fraction of --lr-decay-iters (instead of --lr-warmup-iters)"
    )  # of lr_decay_iters, as Megatron-LM
    lr_decay_iters: int | None = arg(
        None, help="iterations over which the learning rate decays (default: --train-iters)"
    )
    # WSD: the final anneal from --lr to --min-lr, its length and shape.
    lr_wsd_decay_iters: int | None = arg(
        None, minimum=0, help="length of WSD's final anneal, ending at --lr-decay-iters"
    )
    lr_wsd_decay_samples: int | None = arg(None, minimum=0, help="with --train-samples")
    lr_wsd_decay_style: str = arg(
        "exponential",
        help="shape of WSD's final anneal (default exponential)",
        choices=WSD_DECAY_STYLES,
    )
    # On resume, the flags' schedule replaces the checkpoint's / the checkpoint's is used.
    override_opt_param_scheduler: bool = arg(
        False,
        help="on resume, use these flags' LR/WD schedule, not the checkpoint's",
        flag="--override-opt_param-scheduler",
        aliases=("--override-opt-param-scheduler",),
    )
    use_checkpoint_opt_param_scheduler: bool = arg(
        False,
        help="on resume, use the checkpoint's LR/WD schedule",
        flag="--use-checkpoint-opt_param-scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler",),
    )
    # The word embeddings' and output layer's own peak and final learning rate (Megatron's
    # --decoupled-lr/--decoupled-min-lr); None: --lr and --min-lr like everything else.
    decoupled_lr: float | None = arg(
        None, help="peak learning rate of the word embeddings and output layer (default: --lr)"
    )
    decoupled_min_lr: float | None = arg(None, help="their final learning rate (default: --min-lr)")
    weight_decay: float = arg(
        0.01, minimum=0, help="AdamW weight decay (matrices only; not biases or norms)"
    )
    apply_wd_to_qk_layernorm: bool = arg(
        False,
        help="weight decay on the query and key norms too (Qwen3-Next; other norms and biases "
        "never decay)",
    )
    # A weight decay that moves from start to end over the run (Megatron's increment styles).
    start_weight_decay: float | None = arg(
        None, minimum=0, help="weight decay at the start, with --weight-decay-incr-style"
    )
    end_weight_decay: float | None = arg(
        None, minimum=0, help="weight decay at the end, with --weight-decay-incr-style"
    )
    weight_decay_incr_style: str = arg(
        "constant",
        help="linear or cosine: from --start- to --end-weight-decay over the run",
        choices=WD_INCR_STYLES,
    )
    adam_beta1: float = arg(0.9, help="AdamW beta1")
    adam_beta2: float = arg(0.999, help="AdamW beta2")
    adam_eps: float = arg(1e-8, minimum=0, help="AdamW epsilon")
    clip_grad: float = arg(1.0, help="clip the global gradient norm to this (0: no clipping)")
    # Every token of the global batch weighs the same in the loss and gradient, rather than
    # every micro-batch (whose mean is over its own loss-mask tokens).
    calculate_per_token_loss: bool = arg(
        False,
        help=(
            "average the loss over the global batch's loss tokens, not over "
            "micro-batches (each the mean over its own tokens): matters when "
            "loss masks differ"
        ),
    )
    bf16: bool = arg(
        False, help="bf16 parameters and activations, fp32 master weights and gradient reduction"
    )
    fp16: bool = arg(False, help="fp16 parameters and activations with a dynamic loss scale")
    optimizer_cpu_offload: bool = arg(
        False, help="keep fp32 masters and Adam moments on the CPU and step there (GPU runs)"
    )
    # A static loss scale (fp16/bf16) instead of the dynamic one: Megatron's --loss-scale.
    loss_scale: float | None = arg(
        None,
        help=(
            "a static loss scale instead of fp16's dynamic one (skipped on overflow, never changed)"
        ),
    )
    initial_loss_scale: float = arg(2.0**32, help="fp16's first dynamic loss scale")
    min_loss_scale: float = arg(1.0, minimum=0, help="the dynamic loss scale never goes below this")
    loss_scale_window: int = arg(
        1000, minimum=1, help="steps without overflow before the loss scale doubles"
    )
    hysteresis: int = arg(2, minimum=1, help="overflows tolerated before the loss scale halves")
    seed: int = arg(1234, minimum=0, help="seed of initialization, dropout and data order")
    # Leaving early with a checkpoint (Megatron's exit conditions): after an iteration that is a
    # multiple of exit_interval, after exit_duration_in_mins of training, or on SIGTERM/SIGUSR1.
    exit_interval: int | None = arg(
        None, help="save (with --save) and exit after an iteration that is a multiple of this"
    )
    exit_duration_in_mins: float | None = arg(
        None, help="save (with --save) and exit once training has run this long"
    )
    exit_signal_handler: bool = arg(
        False, help="on SIGTERM or SIGUSR1: finish the iteration, save (with --save) and exit 0"
    )
    # Megatron's memory hygiene (training/memory_hygiene.py): Python's collector driven by hand,
    # and the CUDA caching allocator emptied at level 1 after each step and evaluation, at 2
    # also between backward and the optimizer step.
    manual_gc: bool = arg(
        False,
        help=(
            "disable Python's automatic garbage collection during training "
            "(collections stall ranks at different times); collect every "
            "--manual-gc-interval iterations"
        ),
    )
    manual_gc_interval: int = arg(
        0, help="with --manual-gc: collect every this many iterations (0: only around evaluation)"
    )
    manual_gc_eval: bool = arg(
        True,
        help="with --manual-gc: no collection before and after evaluation",
        flag="--no-manual-gc-eval",
    )
    empty_unused_memory_level: int = arg(
        0,
        help=(
            "CUDA: release cached allocator blocks; 1: after each iteration "
            "and evaluation, 2: also between backward and the optimizer step"
        ),
        choices=(0, 1, 2),
    )

    @property
    def params_dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    def num_micro_batches(
        self, data_parallel_size: int, global_batch_size: int | None = None
    ) -> int:
        return (global_batch_size or self.global_batch_size) // (
            self.micro_batch_size * data_parallel_size
        )

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the iteration that starts after `consumed_samples`
        (Megatron's RampupBatchsizeNumMicroBatchesCalculator, and its
        StepBatchsizeNumMicroBatchesCalculator)."""
        if self.step_batch_sizes:
            return [
                size for threshold, size in self.step_batch_sizes if consumed_samples >= threshold
            ][-1]
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, samples = self.rampup_batch_size
        if consumed_samples > samples:
            return self.global_batch_size
        increments = (self.global_batch_size - start) // increment
        per_increment = samples / increments if increments else float("inf")
        return start + int(consumed_samples / per_increment) * increment

    def rampup_batch_sizes(self) -> list[int]:
        """Every global batch size the run uses."""
        if self.step_batch_sizes:
            return [size for _, size in self.step_batch_sizes]
        if self.rampup_batch_size is None:
            return [self.global_batch_size]
        start, increment, _ = self.rampup_batch_size
        return list(range(start, self.global_batch_size + 1, increment))

    def finalize(self, data_parallel_size: int, seq_length: int) -> None:
        self.finalize_muon()
        if self.fp16 and self.loss_scale is None:
            # As Megatron-LM: under dynamic loss scaling a non-finite gradient is the loss
            # scaler's signal to skip the step and back off, not an error.
            self.check_for_nan_in_loss_and_grad = False
        if self.step_batch_size_schedule is not None:
            self._finalize_step_schedule(seq_length, data_parallel_size)
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * data_parallel_size
        per_step = self.micro_batch_size * data_parallel_size
        _require(
            self.global_batch_size % per_step == 0,
            f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
            f"{self.micro_batch_size} x data-parallel size {data_parallel_size}; use a multiple "
            f"of {per_step}",
        )
        self.finalize_evaluation(self.global_batch_size, self.micro_batch_size, data_parallel_size)
        _require(
            not (self.bf16 and self.fp16), "--fp16 and --bf16 are mutually exclusive; pick one"
        )
        _require(
            0 <= self.lr < math.inf and 0 <= self.min_lr < math.inf,
            "--lr and --min-lr must be finite and >= 0",
        )
        _require(  # (Megatron-LM takes 0, and trains to NaN at the second step)
            self.adam_eps > 0,
            "--adam-eps 0: Adam divides each step by sqrt(v) + eps, so a parameter whose "
            "gradient is 0 (a padded vocabulary row, an embedding no token used) steps by "
            "0/0 = NaN at once; give a positive epsilon (the default 1e-8)",
        )
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            _require(0 <= beta < 1, f"{flag} must be in [0, 1), not {beta}")
        _require(self.min_lr <= self.lr, f"--min-lr {self.min_lr} is above --lr {self.lr}")
        _require(  # (megatron-core asserts it)
            self.lr_warmup_init <= self.lr,
            f"--lr-warmup-init {self.lr_warmup_init} is above --lr {self.lr}",
        )
        _require(
            self.decoupled_min_lr is None or self.decoupled_lr is not None,
            "--decoupled-min-lr needs --decoupled-lr",
        )
        if self.decoupled_lr is not None:
            decoupled_min = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            _require(
                0 <= decoupled_min <= self.decoupled_lr,
                f"--decoupled-min-lr {decoupled_min} must be in [0, --decoupled-lr "
                f"{self.decoupled_lr}]",
            )
        if self.rampup_batch_size is not None:
            self._finalize_rampup(data_parallel_size)
        if self.train_samples is None:
            self._finalize_iteration_schedule()
        else:
            self._finalize_sample_schedule()
        self._finalize_schedule_styles()
        self._check_limits()

    def _finalize_schedule_styles(self) -> None:
        _require(
            self.lr_decay_style in LR_DECAY_STYLES,
            f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}",
        )
        _require(
            self.lr_wsd_decay_style in WSD_DECAY_STYLES,
            f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}",
        )
        samples = self.train_samples is not None
        wsd, unit = (
            (self.lr_wsd_decay_samples, "samples")
            if samples
            else (self.lr_wsd_decay_iters, "iters")
        )
        other = self.lr_wsd_decay_iters if samples else self.lr_wsd_decay_samples
        _require(
            other is None,
            "--lr-wsd-decay-iters goes with --train-iters, "
            "--lr-wsd-decay-samples with --train-samples",
        )
        if self.lr_decay_style == "WSD":
            decay = self.lr_decay_samples if samples else self.lr_decay_iters
            _require(
                wsd is not None,
                f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} "
                "(the length of the final anneal)",
            )
            _require(
                0 < wsd <= decay,
                f"--lr-wsd-decay-{unit} {wsd} must be in [1, --lr-decay-{unit} {decay}]",
            )
        _require(
            not (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler),
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
            "contradict each other; give one",
        )
        style = self.weight_decay_incr_style
        _require(
            style in WD_INCR_STYLES,
            f"--weight-decay-incr-style must be one of {', '.join(WD_INCR_STYLES)}",
        )
        given = (self.start_weight_decay, self.end_weight_decay)
        if style == "constant":
            _require(
                given == (None, None),
                "--start/end-weight-decay need "
                "--weight-decay-incr-style linear or cosine; with a constant weight "
                "decay use --weight-decay",
            )
            self.start_weight_decay = self.end_weight_decay = self.weight_decay
        else:
            _require(
                None not in given and min(given) >= 0,
                f"--weight-decay-incr-style {style} needs --start-weight-decay and "
                "--end-weight-decay (>= 0)",
            )

    def _warmup_from_fraction(self, warmup: float, decay: int, unit: str) -> float:
        if self.lr_warmup_fraction is None:
            return warmup
        _require(
            warmup == 0,
            f"--lr-warmup-fraction and --lr-warmup-{unit} are mutually exclusive; pick one",
        )
        _require(0 <= self.lr_warmup_fraction <= 1, "--lr-warmup-fraction must be in [0, 1]")
        return self.lr_warmup_fraction * decay

    def _finalize_iteration_schedule(self) -> None:
        _require(
            self.lr_warmup_samples == 0 and self.lr_decay_samples is None,
            "--lr-warmup-samples and --lr-decay-samples need --train-samples; with "
            "--train-iters use --lr-warmup-iters and --lr-decay-iters",
        )
        if self.train_iters is None:
            self.train_iters = 100
        _require(self.train_iters >= 1, "--train-iters must be >= 1")
        self._finalize_warmup_and_decay("iters", self.train_iters)

    def _finalize_sample_schedule(self) -> None:
        _require(
            self.train_iters is None,
            "--train-iters and --train-samples are mutually exclusive; pick one",
        )
        _require(
            self.lr_warmup_iters == 0 and self.lr_decay_iters is None,
            "with --train-samples the LR schedule is in samples: use --lr-warmup-samples "
            "(or --lr-warmup-fraction) and --lr-decay-samples",
        )
        self.train_iters = self._iterations_for(self.train_samples)
        _require(
            self.train_iters >= 1,
            f"--train-samples {self.train_samples} is less than "
            f"one global batch of {self.global_batch_size}",
        )
        self._finalize_warmup_and_decay("samples", self.train_samples)

    def _finalize_warmup_and_decay(self, unit: str, run_length: int) -> None:
        """--lr-decay-{unit} defaults to the run's length and the warmup must fit in it."""
        if getattr(self, f"lr_decay_{unit}") is None:
            setattr(self, f"lr_decay_{unit}", run_length)
        decay = getattr(self, f"lr_decay_{unit}")
        warmup = self._warmup_from_fraction(getattr(self, f"lr_warmup_{unit}"), decay, unit)
        setattr(self, f"lr_warmup_{unit}", warmup)
        _require(warmup <= decay, f"--lr-warmup-{unit} {warmup} exceeds --lr-decay-{unit} {decay}")

    def _finalize_rampup(self, data_parallel_size: int) -> None:
        ramp = self.rampup_batch_size
        _require(len(ramp) == 3, "--rampup-batch-size takes START INCREMENT SAMPLES")
        _require(
            self.train_samples is not None,
            "--rampup-batch-size needs --train-samples (as in Megatron-LM)",
        )
        start, increment, samples = ramp
        _require(
            start >= 1 and increment >= 1 and samples >= 0,
            "--rampup-batch-size: START and INCREMENT must be >= 1, SAMPLES >= 0",
        )
        _require(
            start <= self.global_batch_size and (self.global_batch_size - start) % increment == 0,
            f"--rampup-batch-size: --global-batch-size {self.global_batch_size} must be "
            f"START {start} plus a multiple of INCREMENT {increment}",
        )
        per_step = self.micro_batch_size * data_parallel_size
        for size in self.rampup_batch_sizes():
            _require(
                size % per_step == 0,
                f"--rampup-batch-size: the global batch size {size} "
                f"is not divisible by --micro-batch-size {self.micro_batch_size} x "
                f"data-parallel size {data_parallel_size}",
            )

    def _finalize_step_schedule(self, seq_length: int, data_parallel_size: int) -> None:
        flag = "--step-batch-size-schedule"
        _require(
            self.rampup_batch_size is None,
            f"{flag} sets the global batch size: drop --rampup-batch-size",
        )
        steps = []
        for entry in self.step_batch_size_schedule.replace(",", " ").split():
            threshold, _, size = entry.partition(":")
            tokens, size = _count(threshold), _count(size)
            _require(
                None not in (tokens, size) and size > 0,
                f"{flag}: {entry!r} is not THRESHOLD:SIZE (tokens consumed, with K, M, B or T, "
                "then a global batch size), e.g. '0:384 200B:768'",
            )
            steps.append((tokens // seq_length, size))  # thresholds in samples of seq_length
        steps.sort()
        thresholds = [threshold for threshold, _ in steps]
        _require(
            bool(steps) and thresholds[0] == 0 and len(set(thresholds)) == len(thresholds),
            f"{flag}: the first threshold must be 0 and the thresholds distinct (in samples of "
            f"--seq-length {seq_length}: {thresholds})",
        )
        per_step = self.micro_batch_size * data_parallel_size
        for _, size in steps:
            _require(
                size % per_step == 0,
                f"{flag}: the global batch size {size} is not divisible by --micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {data_parallel_size}",
            )
        # Megatron-LM refuses --global-batch-size beside the schedule, though its own
        # examples/gpt3 script gives both; the schedule's last size is the same number.
        _require(
            self.global_batch_size in (None, steps[-1][1]),
            f"{flag} ends at global batch size {steps[-1][1]}, and --global-batch-size "
            f"{self.global_batch_size} says otherwise; drop --global-batch-size",
        )
        self.step_batch_sizes = steps
        self.global_batch_size = steps[-1][1]  # as Megatron-LM's global_batch_size

    def _iterations_for(self, train_samples: int) -> int:
        """Megatron's count of iterations for --train-samples: those of the ramp, then whole
        global batches; under a step schedule, each step's batches until the next threshold
        is passed (Megatron-LM's update_train_iters)."""
        iterations = consumed = 0
        if self.step_batch_sizes:
            while consumed < train_samples:
                size = self.global_batch_size_at(consumed)
                ahead = [t for t, _ in self.step_batch_sizes if t > consumed] + [train_samples]
                batches = -(-(min(ahead[0], train_samples) - consumed) // size)
                consumed, iterations = consumed + batches * size, iterations + batches
            return iterations
        if self.rampup_batch_size is not None:
            while consumed <= self.rampup_batch_size[2] and consumed <= train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
        return iterations + max(train_samples - consumed, 0) // self.global_batch_size

    def _check_limits(self) -> None:
        _require(self.clip_grad >= 0, "--clip-grad must be >= 0 (0 disables clipping)")
        _require(self.initial_loss_scale > 0, "--initial-loss-scale must be positive")
        _require(self.loss_scale is None or self.loss_scale > 0, "--loss-scale must be positive")
        _require(
            self.loss_scale is None or self.fp16 or self.bf16,
            "--loss-scale scales fp16/bf16 gradients; add --fp16 or --bf16, or drop it",
        )
        _require(
            self.exit_interval is None or self.exit_interval >= 1, "--exit-interval must be >= 1"
        )
        _require(
            self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
            "--exit-duration-in-mins must be positive",
        )
        self.finalize_result_checks()
        _require(self.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
