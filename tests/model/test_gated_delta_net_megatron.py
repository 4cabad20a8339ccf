"""threefold's gated delta net against megatron-core's own `GatedDeltaNet` at TP2: each rank's
shards of in_proj, the convolution, A_log and dt_bias are megatron-core's local tensors as
they are (the same split by heads), the outputs and every gradient match, and megatron-core
checkpoints the projection and convolution under the section names threefold's Megatron-LM
interchange reads and writes.

megatron-core's module wants FLA (the Triton kernels of flash-linear-attention) at import: on
the CPU its deterministic mode runs torch code instead (its convolution and chunked rule), and
only FLA's L2 norm is supplied here, as FLA defines it (x / sqrt(|x|^2 + 1e-6)).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tests.distributed import run_distributed
from tests.megatron_core_models import cpu_patches
from tests.model.test_gated_delta_net import HYBRID
from tests.parity import LLAMA_STYLE, TRAINING, _setup

TP = 2


@contextlib.contextmanager
def _without_fla():
    from megatron.core.ssm import gated_delta_net

    saved = gated_delta_net.HAVE_FLA, getattr(gated_delta_net, "l2norm", None)
    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = lambda x: x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
    try:
        yield
    finally:
        gated_delta_net.HAVE_FLA, gated_delta_net.l2norm = saved


def _megatron_core_layer(config_values: dict):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(TP, 1)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        tensor_model_parallel_size=TP,
        use_cpu_initialization=True,
        deterministic_mode=True,
        **config_values,
    )
    pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    submodules = GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
    )
    spec = ModuleSpec(module=GatedDeltaNet, submodules=submodules)
    return spec.module(config, spec.submodules, layer_number=1, pg_collection=pg_collection)


def _flag_values(argv: list[str]) -> dict:
    names = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
    names += ("linear_value_head_dim",)
    values = {name: int(argv[argv.index("--" + name.replace("_", "-")) + 1]) for name in names}
    return {
        **values,
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": 2,
        "linear_conv_kernel_dim": 4,
    }


def megatron_core_parity_job(argv: list[str]) -> dict:
    trainer = _setup(argv + ["--tensor-model-parallel-size", str(TP)])
    ours = trainer.model.decoder.layers[0].self_attention
    with cpu_patches(), _without_fla():
        theirs = _megatron_core_layer(_flag_values(argv))
        names = ["in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "out_norm.weight"]
        names.append("out_proj.weight")
        with torch.no_grad():
            ours.out_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(3))
            for name in names:
                theirs.get_parameter(name).copy_(ours.get_parameter(name))
        x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(7))
        ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        output = ours(ours_x)
        expected, _ = theirs(theirs_x, attention_mask=None)
        weight = torch.randn(output.shape, generator=torch.Generator().manual_seed(11))
        trainer.data_parallel.grad_buffer.start_step(num_microbatches=1)
        (output * weight).sum().backward()
        (expected * weight).sum().backward()
        sharded = theirs.sharded_state_dict(prefix="decoder.layers.0.self_attention.")
        keys = sorted(
            t.key
            for name in ("in_proj.weight", "conv1d.weight")
            for t in sharded[f"decoder.layers.0.self_attention.{name}"].build()
        )
    # threefold's gradients go to its gradient buffer (`main_grad`), both unreduced over TP
    gradients = {
        name: (ours.get_parameter(name).main_grad, theirs.get_parameter(name).grad)
        for name in names
    }
    return {
        "output": (output.detach(), expected.detach()),
        "input_grad": (ours_x.grad, theirs_x.grad),
        "gradients": gradients,
        "keys": keys,
    }


def test_the_layer_is_megatron_cores_at_tp2():
    argv = LLAMA_STYLE + TRAINING + HYBRID
    for rank in run_distributed(TP, megatron_core_parity_job, argv):
        ours, theirs = rank["output"]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close(*rank["input_grad"], rtol=0, atol=1e-6)
        for name, (ours, theirs) in rank["gradients"].items():
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=name)
        prefix = "decoder.layers.0.self_attention."
        sections = ("alpha", "beta", "key", "query", "value", "z")
        assert rank["keys"] == sorted(
            [prefix + "conv1d.weight." + s for s in ("key", "query", "value")]
            + [prefix + "in_proj.weight." + s for s in sections]
        )
