"""Kernel selection: what is chosen where, the start-up line, refusals, and the wiring of the
Transformer Engine / apex adapters (checked against stand-in modules that compute the
reference function: neither library installs on a CPU machine)."""

import subprocess
import sys
import types

import pytest
import torch

from tests.conftest import ROOT
from tests.parity import LLAMA_STYLE, TRAINING, gradient_job
from threefold.config import KernelConfig
from threefold.config.errors import ConfigError
from threefold.kernels import dispatch, reference
from threefold.kernels.dispatch import KERNELS, AttentionShape, configure

SHAPE = AttentionShape(heads=4, groups=2, head_dim=16, dropout=0.0)
CPU = torch.device("cpu")


def test_cpu_defaults_are_eager_with_the_chunked_cross_entropy():
    line = configure(KernelConfig(), CPU, torch.float32, "RMSNorm", SHAPE)
    assert line.startswith("> kernels: transformer-impl local; attention SDPA (PyTorch's choice")
    assert "norm eager RMSNorm" in line and "cross-entropy chunked, 4096 tokens" in line
    assert KERNELS.rms_norm is reference.rms_norm and KERNELS.attention is reference.attention


def test_explicit_choices_are_honoured():
    line = configure(
        KernelConfig(
            fusion_impl="compile",
            apply_rope_fusion=False,
            cross_entropy_loss_fusion=False,
            attention_backend="unfused",
        ),
        CPU,
        torch.float32,
        "LayerNorm",
        SHAPE,
    )
    assert "attention SDPA MATH" in line and "norm torch.compile LayerNorm" in line
    assert "RoPE eager" in line and "SwiGLU torch.compile" in line
    assert "cross-entropy reference" in line
    assert KERNELS.rotary is reference.rotary and KERNELS.layer_norm is not reference.layer_norm
    assert "transformer layers" not in line
    assert line.endswith("weight gradients accumulated into the gradient buffer by their GEMM")
    compiled = KernelConfig(compile_layers=True)
    line = configure(compiled, CPU, torch.float32, "RMSNorm", SHAPE)
    assert "transformer layers each torch.compile'd as one graph" in line
    assert line.endswith("weight gradients accumulated into the gradient buffer by their GEMM")
    # a compiled forward flags its backward's gradient, which 1F1B's order would mismatch
    line = configure(compiled, CPU, torch.float32, "RMSNorm", SHAPE, pipeline_parallel_size=2)
    assert line.endswith(
        "weight gradients added to the gradient buffer separately (compiled layers under "
        "pipeline parallelism)"
    )
    assert not KERNELS.gradient_accumulation_fusion
    # bf16 into the fp32 buffer needs addmm's out_dtype, which the CPU lacks
    line = configure(KernelConfig(), CPU, torch.bfloat16, "RMSNorm", SHAPE)
    assert line.endswith("(this torch has no addmm with out_dtype)")
    assert not KERNELS.gradient_accumulation_fusion
    line = configure(
        KernelConfig(gradient_accumulation_fusion=False), CPU, torch.float32, "RMSNorm", SHAPE
    )
    assert "weight gradients" not in line and not KERNELS.gradient_accumulation_fusion


def test_bf16_gemms_reduce_in_fp32_with_megatrons_flag():
    """--disable-bf16-reduced-precision-matmul turns off torch's bf16 partial sums for cuBLAS
    (as Megatron-LM's does) and says so; a run without it has torch's default back."""
    matmul = torch.backends.cuda.matmul
    flagged = KernelConfig(disable_bf16_reduced_precision_matmul=True)
    try:
        line = configure(flagged, CPU, torch.bfloat16, "RMSNorm", SHAPE)
        assert not matmul.allow_bf16_reduced_precision_reduction
        assert "bf16 GEMMs partial sums in fp32 (--disable-bf16-reduced-precision-matmul)" in line
        line = configure(KernelConfig(), CPU, torch.bfloat16, "RMSNorm", SHAPE)
        assert matmul.allow_bf16_reduced_precision_reduction and "bf16 GEMMs" not in line
    finally:
        matmul.allow_bf16_reduced_precision_reduction = True


@pytest.mark.parametrize(
    "config,message",
    [
        (
            KernelConfig(transformer_impl="transformer_engine"),
            "--transformer-impl transformer_engine",
        ),
        (KernelConfig(attention_backend="fused"), "--attention-backend fused needs CUDA"),
    ],
)
def test_unavailable_kernels_are_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        configure(config, CPU, torch.float32, "RMSNorm", SHAPE)


def test_flash_with_dropout_on_cpu_is_refused_naming_the_flag():
    with pytest.raises(
        ConfigError, match="--attention-backend flash: SDPA cannot run .*attention dropout 0.1"
    ):
        configure(
            KernelConfig(attention_backend="flash"),
            CPU,
            torch.float32,
            "RMSNorm",
            AttentionShape(4, 2, 16, 0.1),
        )


@pytest.mark.parametrize(
    "config,flag",
    [
        (KernelConfig(compile_layers=True), "--compile-layers"),
        (KernelConfig(fusion_impl="compile"), "--fusion-impl compile"),
    ],
)
def test_compiling_on_a_cpu_without_a_compiler_is_refused_up_front(config, flag):
    from torch._inductor import config as inductor

    with inductor.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        with pytest.raises(
            ConfigError,
            match=f"^{flag} on the CPU needs a C\\+\\+ compiler .*install g\\+\\+ or set CXX",
        ):
            configure(config, CPU, torch.float32, "RMSNorm", SHAPE)
        configure(KernelConfig(), CPU, torch.float32, "RMSNorm", SHAPE)  # eager needs none


def test_compile_backend_aot_eager_traces_without_a_compiler_and_is_said():
    """--compile-backend aot_eager: the layers' graphs run op by op, so no C++ compiler is
    needed; it is said in the kernels line, and refused where nothing is compiled."""
    from torch._inductor import config as inductor

    traced = KernelConfig(compile_layers=True, compile_backend="aot_eager")
    with inductor.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        line = configure(traced, CPU, torch.float32, "RMSNorm", SHAPE)
    assert "each torch.compile'd as one graph (aot_eager: traced, run op by op)" in line
    with pytest.raises(ConfigError, match="^--compile-backend aot_eager: nothing is compiled"):
        configure(KernelConfig(compile_backend="aot_eager"), CPU, torch.float32, "RMSNorm", SHAPE)
    with pytest.raises(ConfigError, match="^--compile-backend aot_eager chooses torch.compile"):
        KernelConfig(compile_backend="aot_eager", fusion_impl="eager").finalize()


def test_rowwise_fp8_on_a_cpu_torch_without_rowwise_gemms_is_refused_up_front(monkeypatch):
    """torch before 2.13 runs the CPU's _scaled_mm with one scale per tensor only: rowwise
    scaling is refused at start-up in one line (it failed on an internal assert in the first
    step; as torch 2.11's CPU does, here)."""
    scaled_mm = torch._scaled_mm

    def per_tensor_only(a, b, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("_scaled_mm only supports per-tensor scaling for CPU backend.")
        return scaled_mm(a, b, scale_a, scale_b, **kwargs)

    assert "CPU: exact emulation" in dispatch._fp8_gemms(CPU, "rowwise", "e4m3")
    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    with pytest.raises(ConfigError, match="^--fp8-recipe rowwise: this torch .* on the CPU"):
        dispatch._fp8_gemms(CPU, "rowwise", "e4m3")
    for recipe in ("tensorwise", "delayed", "blockwise"):
        dispatch._fp8_gemms(CPU, recipe, "e4m3")


def test_transformer_engine_request_fails_before_torch_loads(tmp_path):
    argv = LLAMA_STYLE + TRAINING + ["--transformer-impl", "transformer_engine"]
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--transformer-impl transformer_engine" in result.stderr.strip().splitlines()[-1]


class _StandInDotProductAttention(torch.nn.Module):
    """TE's constructor and sbhd calling convention, computing the reference."""

    built: list[dict] = []

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.kwargs = kwargs
        self.built.append(kwargs)

    def forward(self, query, key, value, attention_mask=None):
        keep = None if attention_mask is None else ~attention_mask  # TE masks what to drop
        return reference.attention(query, key, value, keep, self.kwargs["attention_dropout"])


def _stand_ins(monkeypatch) -> dict:
    calls = {"layer_norm": 0, "rms_norm": 0}

    def fused_layer_norm_affine(x, weight, bias, shape, eps):
        calls["layer_norm"] += 1
        return reference.layer_norm(x, weight, bias, eps)

    def fused_rms_norm_affine(x, weight, shape, eps):
        calls["rms_norm"] += 1
        return reference.rms_norm(x, weight, eps)

    modules = {
        "transformer_engine.pytorch": types.SimpleNamespace(
            DotProductAttention=_StandInDotProductAttention
        ),
        "apex.normalization.fused_layer_norm": types.SimpleNamespace(
            fused_layer_norm_affine=fused_layer_norm_affine,
            fused_rms_norm_affine=fused_rms_norm_affine,
        ),
    }
    monkeypatch.setattr(dispatch, "try_import", modules.get)
    monkeypatch.setattr(dispatch, "_on_gpu", lambda device: True)
    return calls


def test_transformer_engine_and_apex_adapters_compute_the_model(monkeypatch):
    argv = LLAMA_STYLE + TRAINING
    expected = gradient_job(argv)
    calls = _stand_ins(monkeypatch)
    _StandInDotProductAttention.built.clear()
    actual = gradient_job(argv + ["--fusion-impl", "eager"])
    assert KERNELS.description.startswith(
        "transformer-impl transformer_engine; attention "
        "Transformer Engine DotProductAttention (auto)"
    )
    assert "norm apex fused RMSNorm" in KERNELS.description
    # LLAMA_STYLE: 8 heads in 4 query groups of head size 4; causal, sbhd.
    assert {tuple(sorted(k.items())) for k in _StandInDotProductAttention.built} == {
        tuple(
            sorted(
                dict(
                    num_attention_heads=8,
                    kv_channels=4,
                    num_gqa_groups=4,
                    attention_dropout=0.0,
                    qkv_format="sbhd",
                    attn_mask_type="causal",
                ).items()
            )
        )
    }
    assert calls["rms_norm"] > 0
    torch.testing.assert_close(actual["logits"], expected["logits"], rtol=0, atol=0)
    assert actual["loss"] == expected["loss"]
    for name in expected["grads"]:
        assert (actual["grads"][name] == expected["grads"][name]).all(), name


def test_auto_keeps_the_fastest_fused_backend_and_logs_every_timing(monkeypatch):
    """The selection among runnable backends (the timing itself needs CUDA events: its leg is
    in test_device_kernels.py): the fastest wins whatever its place in the preference order
    if it is 10% faster than an earlier one, every timing is in the line, and without a
    sequence nothing is timed."""
    times = {"FLASH_ATTENTION": 2.5, "CUDNN_ATTENTION": 1.5, "EFFICIENT_ATTENTION": 4.0}
    candidates = [(name, f"SDPA {name}") for name in times]
    monkeypatch.setattr(
        dispatch, "_milliseconds", lambda kernel, shape, device, dtype: times[kernel]
    )
    timed = AttentionShape(heads=4, groups=2, head_dim=16, dropout=0.0, sequence=4096, batch=2)
    kernel, label = dispatch._fastest(candidates, timed, CPU, torch.bfloat16)
    assert kernel == "CUDNN_ATTENTION"
    assert label == (
        "SDPA CUDNN_ATTENTION, the fastest forward+backward at sequence 4096 x "
        "micro-batch 2 (by 10% to pass an earlier choice): CUDNN_ATTENTION "
        "1.50 ms, FLASH_ATTENTION 2.50 ms, EFFICIENT_ATTENTION 4.00 ms"
    )
    # Within the margin the earlier backend stays: restarts do not swap on timing noise.
    times["CUDNN_ATTENTION"] = 2.3
    assert dispatch._fastest(candidates, timed, CPU, torch.bfloat16)[0] == "FLASH_ATTENTION"
    times["CUDNN_ATTENTION"] = 2.2
    assert dispatch._fastest(candidates, timed, CPU, torch.bfloat16)[0] == "CUDNN_ATTENTION"
    assert dispatch._fastest(candidates, SHAPE, CPU, torch.bfloat16) == candidates[0]
    assert dispatch._fastest(candidates[1:2], timed, CPU, torch.bfloat16) == candidates[1]


def test_a_backend_slow_while_it_warms_up_is_timed_again_after_the_others(monkeypatch):
    """On a fresh H100 the first process timed cuDNN's attention at twice the time the later
    ones took, and ran FlashAttention: each backend is timed in rounds, in turn, and keeps its
    best, so a first slow timing does not decide."""
    warm = {"FLASH_ATTENTION": [3.9, 3.9, 3.9], "CUDNN_ATTENTION": [4.85, 2.16, 2.16]}
    order = []

    def milliseconds(kernel, shape, device, dtype):
        order.append(kernel)
        return warm[kernel][order.count(kernel) - 1]

    monkeypatch.setattr(dispatch, "_milliseconds", milliseconds)
    candidates = [(name, f"SDPA {name}") for name in warm]
    timed = AttentionShape(heads=4, groups=2, head_dim=16, dropout=0.0, sequence=4096, batch=2)
    kernel, label = dispatch._fastest(candidates, timed, CPU, torch.bfloat16)
    assert kernel == "CUDNN_ATTENTION"
    assert label.endswith("CUDNN_ATTENTION 2.16 ms, FLASH_ATTENTION 3.90 ms")
    assert order == ["FLASH_ATTENTION", "CUDNN_ATTENTION"] * dispatch._TIMING_ROUNDS


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--hidden-size", "40", "--num-attention-heads", "4"], "--hidden-size / TP is 20"),
        (
            ["--multi-latent-attention", "--kv-lora-rank", "24", "--qk-pos-emb-head-dim", "8"],
            "--kv-lora-rank is 24",
        ),
    ],
    ids=["hidden", "mla-latent"],
)
def test_fp8_model_sizes_cublas_refuses_are_named_before_the_model_is_built(flags, named):
    """cuBLASLt's FP8 GEMMs take multiples of 16 (checked only on CUDA, where they run)."""
    from tests.parity import LLAMA_MHA_STYLE, TRAINING
    from threefold.arguments import parse_args
    from threefold.kernels.fp8_shapes import check_fp8_shapes

    config = parse_args(LLAMA_MHA_STYLE + TRAINING + ["--ffn-hidden-size", "64"] + flags).model
    with pytest.raises(ConfigError, match=named):
        check_fp8_shapes(config, tensor_parallel_size=2)
    check_fp8_shapes(parse_args(LLAMA_MHA_STYLE + TRAINING).model, tensor_parallel_size=1)
