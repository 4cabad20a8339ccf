"""--fine-grained-activation-offloading (Megatron-LM's) moves memory, not results: every
module, alone and together, in dense, MoE (looped and grouped experts), MLA and FP8 models,
with the recomputed modules beside it, trains bitwise as without offloading; TP+SP x PP and
PP x EP (micro-batches in flight, each with its own groups) train as one process; what is
offloaded leaves the device (its storage is freed once the forward pass is done) and comes
back in backward, the last module of each pass staying; --activation-offload-fraction and
--delta-offload-bytes-across-pp-ranks keep the latest groups; bad combinations stop in one
line."""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.distributed import run_distributed
from tests.model.test_mla import MLA
from tests.parallel.test_expert_parallel import MOE
from tests.parity import LLAMA_STYLE, TRAINING, _setup, assert_matches_reference, train_job
from threefold.arguments import parse_args
from threefold.kernels.fp8 import held_for_step
from threefold.model import activation_offload
from threefold.model.activation_offload import ActivationOffload

OFFLOAD = ["--fine-grained-activation-offloading", "--min-offloaded-tensor-size", "0"]
LAYER = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
EXPERTS = ["expert_fc1", "moe_act"]
MOE_MODEL = LLAMA_STYLE + TRAINING + MOE
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
# model -> (flags, the module sets tried: one at a time for the first, then all together)
MODELS = {
    "llama": (LLAMA_STYLE + TRAINING, LAYER),
    "moe": (MOE_MODEL, LAYER + EXPERTS),
    "moe-grouped": (MOE_MODEL + ["--moe-grouped-gemm"], EXPERTS),
    "moe-whole-mlp": (MOE_MODEL, ["fused_group_mlp", "core_attn"]),
    "mla": (MLA + TRAINING, LAYER),
    "fp8": (LLAMA_STYLE + TRAINING + MOE + ["--fp8-format", "hybrid"], LAYER + EXPERTS),
    "recomputed-beside": (
        MOE_MODEL + SELECTIVE + ["layernorm", "moe_act", "core_attn"],
        LAYER + EXPERTS,
    ),
    "mla-recomputed-up-proj": (MLA + TRAINING + SELECTIVE + ["mla_up_proj"], LAYER),
    # the first layer recomputed whole (it opens no groups), the others offloaded
    "full-recompute-block": (
        LLAMA_STYLE
        + TRAINING
        + ["--num-layers", "3", "--recompute-granularity", "full", "--recompute-method", "block"]
        + ["--recompute-num-layers", "1"],
        LAYER,
    ),
}


def _equal(result: dict, reference: dict, what: str) -> None:
    assert result["losses"] == reference["losses"], what
    for name, value in reference["params"].items():
        assert np.array_equal(result["params"][name], value), f"{what}: {name}"


@pytest.fixture
def copies(monkeypatch):
    """Every tensor offloaded to the host, as a weak reference to its device storage; none
    is a weight copy the step keeps for every micro-batch (FP8's)."""
    offloaded: list[tuple[str, StorageWeakRef]] = []
    to_host = activation_offload._Copies.to_host

    def recording(self, name, tensors):
        assert not any(held_for_step(t) for t in tensors)
        offloaded.extend((name, StorageWeakRef(t.untyped_storage())) for t in tensors)
        return to_host(self, name, tensors)

    monkeypatch.setattr(activation_offload._Copies, "to_host", recording)
    return offloaded


@pytest.mark.parametrize("model", MODELS)
def test_offloading_trains_bitwise_as_without(model, copies):
    """The copies are exact and the computation the same: losses and parameters equal."""
    argv, modules = MODELS[model]
    reference = train_job(argv, 3)
    first = [[modules[0]]] if len(modules) > 1 else []
    for chosen in first + [modules]:
        copies.clear()
        _equal(train_job(argv + OFFLOAD + ["--offload-modules", *chosen], 3), reference, chosen)
        # (a module recomputed as well keeps only what its recomputation holds)
        assert copies and {name for name, _ in copies} <= set(chosen), chosen


@pytest.mark.parametrize(
    "argv", [LLAMA_STYLE + TRAINING + ["--num-layers", "3"], MOE_MODEL], ids=["llama", "moe"]
)
def test_layer_level_offloading_trains_bitwise_as_without(argv, copies):
    """--cpu-offloading-num-layers 1: the first layer's whole activations, once per
    micro-batch (4 a step)."""
    reference = train_job(argv, 3)
    _equal(train_job(argv + ["--cpu-offloading-num-layers", "1"], 3), reference, "layer 1")
    assert [name for name, _ in copies] == ["layer"] * len(copies) and copies
    assert len({id(ref) for _, ref in copies}) == len(copies)


def test_offloaded_storages_leave_the_device_until_backward(copies):
    """After the forward pass nothing holds an offloaded tensor's storage (on a GPU: its
    memory is free); the last module of the pass stays; the backward's gradients are those
    of a run without offloading."""
    argv = LLAMA_STYLE + TRAINING + ["--num-layers", "3"]
    modules = ["--offload-modules", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
    grads = []
    for flags in ([], OFFLOAD + modules):
        copies.clear()
        trainer = _setup(argv + flags)
        model = trainer.model
        batch = next(trainer.train_iterator())
        trainer.data_parallel.grad_buffer.start_step(num_microbatches=1)
        loss = model(batch["tokens"], labels=batch["labels"]).mean()
        gc.collect()
        if flags:
            # 3 layers x 4 modules, the last (layer 3's mlp_norm) kept on the device
            groups = model.activation_offload.offloaded_bytes
            assert set(groups) == {"qkv_linear", "core_attn", "attn_proj", "mlp_norm"}
            assert len(copies) >= 11
            assert all(ref.expired() for _, ref in copies)
        loss.backward()
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


def test_a_group_and_its_reloaded_tensors_go_when_its_backward_is_done(monkeypatch):
    """Nothing but autograd holds a group once the forward pass is done: with the garbage
    collector off, every group is gone after backward (a reference cycle would keep its
    reloaded tensors until a collection, which --manual-gc runs rarely)."""
    groups = []
    open_group = activation_offload._Pass.open

    def recording(self, name):
        group = open_group(self, name)
        groups.append(weakref.ref(group))
        return group

    monkeypatch.setattr(activation_offload._Pass, "open", recording)
    trainer = _setup(LLAMA_STYLE + TRAINING + OFFLOAD + ["--offload-modules", *LAYER])
    batch = next(trainer.train_iterator())
    trainer.data_parallel.grad_buffer.start_step(num_microbatches=1)
    gc.collect()
    gc.disable()
    try:
        loss = trainer.model(batch["tokens"], labels=batch["labels"]).mean()
        assert len(groups) == 2 * len(LAYER) and all(ref() is not None for ref in groups)
        loss.backward()
        del loss
        assert all(ref() is None for ref in groups)
    finally:
        gc.enable()


def test_the_plan_keeps_the_latest_groups_on_the_device():
    """The first pass surveys; later passes offload the earliest groups: the fraction drops
    int(n x (1 - f)) of the n eligible (as megatron-core), the delta keeps the latest worth
    pp_rank x delta bytes; empty groups and the pass's last never count."""

    class Group:
        def __init__(self, index, name, size):
            self.index, self.name, self.bytes = index, name, size

    groups = [Group(i, f"m{i % 2}", 0 if i == 3 else 100) for i in range(8)]
    offload = ActivationOffload(["m0", "m1"], 0)
    offload.plan(groups)
    assert offload.planned == {0, 1, 2, 4, 5, 6}
    assert offload.offloaded_bytes == {"m0": 400, "m1": 200}  # 0 2 4 6, 1 5
    offload = ActivationOffload(["m0", "m1"], 0, activation_offload_fraction=0.5)
    offload.plan(groups)
    assert offload.planned == {0, 1, 2}
    offload = ActivationOffload(["m0", "m1"], 0, keep_on_device_bytes=150)
    offload.plan(groups)
    assert offload.planned == {0, 1, 2, 4}
    offload = ActivationOffload(["m0", "m1"], 0, 0.8, keep_on_device_bytes=150)
    offload.plan(groups)
    assert offload.planned == {0, 1, 2, 4}  # 4 left after the delta: int(4 x 0.2) = 0 dropped
    offload = ActivationOffload(["m0", "m1"], 0, 0.0)
    assert offload.offloads(5)  # before the survey: every group
    offload.plan(groups)
    assert offload.planned == set() and not offload.offloads(0)


def test_fraction_and_minimum_size_apply_in_training(copies):
    """Half the groups after the first pass; tensors under the minimum stay."""
    argv = LLAMA_STYLE + TRAINING + OFFLOAD + ["--offload-modules", *LAYER]
    trainer = _setup(argv + ["--activation-offload-fraction", "0.5"])
    trainer.train_step()  # 4 micro-batches: the first surveys, the others follow the plan
    offload = trainer.model.activation_offload
    assert offload.planned == {0, 1, 2, 3, 4}  # the earliest 9 - int(9 x 0.5): layer 1's
    assert offload.offloaded_bytes.keys() == set(LAYER)
    copies.clear()
    trainer.train_step()
    assert len(copies) >= 4 * len(offload.planned)
    copies.clear()
    trainer = _setup(LLAMA_STYLE + TRAINING + OFFLOAD[:1] + ["--offload-modules", *LAYER])
    trainer.train_step()
    assert not copies  # the default minimum (1M elements) is above every tensor here


LAYOUTS = {
    "tp2-sp-pp2": (
        LLAMA_STYLE + TRAINING,
        LAYER,
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
        + ["--pipeline-model-parallel-size", "2"],
    ),
    "pp2-ep2": (
        MOE_MODEL + ["--moe-token-dispatcher-type", "alltoall"],
        LAYER + EXPERTS,
        ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
        + ["--delta-offload-bytes-across-pp-ranks", "4096"],
    ),
    # two model chunks per stage, each with its own groups and plan
    "pp2-vpp2": (
        LLAMA_STYLE + TRAINING + ["--num-layers", "4"],
        LAYER,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
    # FSDP2's gathered parameters left alone; ring attention's per-step tensors offloaded
    "fsdp-cp2": (
        LLAMA_STYLE + TRAINING,
        LAYER,
        ["--use-torch-fsdp2", "--context-parallel-size", "2"],
    ),
}


def offloading_train_job(argv: list[str], steps: int) -> dict:
    """`train_job`, counting the bytes each forward pass offloaded after the first."""
    offloaded = []
    to_host = activation_offload._Copies.to_host

    def counting(self, name, tensors):
        offloaded.append(sum(t.numel() * t.element_size() for t in tensors))
        return to_host(self, name, tensors)

    activation_offload._Copies.to_host = counting
    try:
        result = train_job(argv, steps)
    finally:
        activation_offload._Copies.to_host = to_host
    return {**result, "offloaded": sum(offloaded)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_with_offloading_train_as_one_process(layout):
    argv, modules, flags = LAYOUTS[layout]
    reference = train_job(argv, 4)
    offloading = argv + OFFLOAD + ["--offload-modules", *modules] + flags
    results = run_distributed(4, offloading_train_job, offloading, 4)
    assert_matches_reference(results, reference, 1e-5)
    assert all(result["offloaded"] > 0 for result in results)


@pytest.mark.parametrize(
    "flags,named",
    [
        (OFFLOAD, "needs --offload-modules"),
        (OFFLOAD + ["--offload-modules", "gdp_qkv"], "--offload-modules gdp_qkv unknown"),
        (OFFLOAD + ["--offload-modules", "attn_proj"], "attn_proj needs core_attn"),
        (
            OFFLOAD + ["--offload-modules", "fused_group_mlp", "moe_act"],
            "fused_group_mlp offloads the experts' whole MLP",
        ),
        (["--offload-modules", "core_attn"], "add --fine-grained-activation-offloading"),
        (["--min-offloaded-tensor-size", "10"], "--min-offloaded-tensor-size tune"),
        (
            OFFLOAD + ["--offload-modules", "core_attn", "--activation-offload-fraction", "2"],
            "--activation-offload-fraction must be in [0, 1]",
        ),
        (OFFLOAD + ["--offload-modules", "core_attn", "--compile-layers"], "--compile-layers"),
        (
            MOE + OFFLOAD + ["--offload-modules", "moe_act"] + SELECTIVE + ["moe"],
            "--recompute-modules moe",
        ),
        (OFFLOAD + ["--offload-modules", "core_attn", "--delay-offload-until-cuda-graph"], "CUDA"),
        (["--cpu-offloading-num-layers", "2"], "fewer than --num-layers 2"),
        (["--cpu-offloading-num-layers", "1", "--pipeline-model-parallel-size", "2"], "pipeline"),
        (["--cpu-offloading-num-layers", "1", "--recompute-granularity", "selective"], "recompu"),
        (
            OFFLOAD + ["--offload-modules", "core_attn", "--cpu-offloading-num-layers", "1"],
            "give one",
        ),
        (["--cpu-offloading-retain-pinned-cpu-buffers"], "belongs to --cpu-offloading-num-layers"),
    ],
    ids=[
        "no-modules",
        "unknown",
        "proj-alone",
        "whole-and-parts",
        "no-switch",
        "tuning-alone",
        "fraction",
        "compile",
        "moe-recomputed",
        "cuda-graphs",
        "all-layers",
        "layers-under-pp",
        "layers-recomputed",
        "layers-and-modules",
        "retain-alone",
    ],
)
def test_refusals_are_one_line(capsys, flags, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + flags)
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


def test_notes(capsys):
    parse_args(LLAMA_STYLE + TRAINING + OFFLOAD + ["--offload-modules", "core_attn", "moe_act"])
    assert "moe_act: the model has no experts" in capsys.readouterr().out
    parse_args(
        LLAMA_STYLE + TRAINING + OFFLOAD + ["--offload-modules", "core_attn"] + SELECTIVE[:2]
    )  # core_attn: the default recomputed module
    assert "the core attention keeps only its inputs" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies' streams need a GPU")
@pytest.mark.parametrize("inflight", [None, 0])
def test_cuda_offloading_frees_device_memory_and_gives_the_same_gradients(inflight):
    """On a GPU (bench/gpu_session.sh tests): the copies run on side streams into pinned
    memory; after the forward pass the device holds about the last group's activations only,
    and the gradients are bitwise those kept on the device."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024, device=device) for _ in range(4)]
    x = torch.randn(4096, 1024, device=device, requires_grad=True)

    def forward(offload: ActivationOffload | None) -> tuple[torch.Tensor, int]:
        out = x
        with offload.forward_pass() if offload else contextlib.nullcontext():
            for layer in layers:
                with activation_offload.offload_group("core_attn", offload is not None):
                    out = torch.nn.functional.gelu(layer(out))
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # (the allocator frees what the copy streams read)
        return out, torch.cuda.memory_allocated()

    results = []
    for offload in (None, ActivationOffload(["core_attn"], 0, max_inflight_offloads=inflight)):
        for tensor in (x, *[p for layer in layers for p in layer.parameters()]):
            tensor.grad = None
        out, held = forward(offload)
        out.square().mean().backward()
        grads = [x.grad.clone()] + [layer.weight.grad.clone() for layer in layers]
        results.append((held, grads))
        del out
    (kept, reference), (offloaded, grads) = results
    # three of four groups offloaded: each the linear's input and the GELU's (16 MiB apiece),
    # the first group's input (x, which the test holds) staying
    assert kept - offloaded >= 0.9 * 5 * 4096 * 1024 * 4
    for got, want in zip(grads, reference):
        assert torch.equal(got, want)
