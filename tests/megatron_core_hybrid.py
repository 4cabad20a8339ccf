"""megatron-core's own hybrid model (its MambaModel: Mamba, attention, MLP and expert layers by
--hybrid-override-pattern) on CPU, saving and reading Megatron-LM torch_dist checkpoints as
tests/megatron_core_models.py does for its GPTModel.

megatron-core builds a Mamba mixer from mamba_ssm's Triton kernels and Transformer Engine's
layers, neither of which runs here; `hybrid_patches()` puts in what runs on a CPU, each
computing the function megatron-core asks of it:
- `mamba_split_conv1d_scan_combined` (the causal convolution, SiLU, the state space scan with
  its skip D, and the gate silu(z)): `_split_conv1d_scan`, a step-by-step recurrence in fp64,
  written from mamba_ssm's definition and sharing no code with threefold's chunked scan;
- the mixer's grouped RMSNorm (mamba_ssm's, behind `ExtendedRMSNorm`): `_GroupedRMSNorm`, with
  `ExtendedRMSNorm`'s sharded state dict (its weight split over TP);
- the stack's final norm (`TENorm`): megatron-core's torch norm;
- the inference engine's Triton helpers, which the mixer imports but training never calls;
  the mixer then builds as with mamba_ssm installed (`HAVE_MAMBA_SSM`).
The layers' specs are megatron-core's local ones, with the norms of Transformer Engine's fused
layers mapped to its names as its local GPT spec maps them (`sharded_state_dict_keys_map`):
what Megatron-LM's Transformer Engine spec stores (`mixer.in_proj.layer_norm_weight`,
`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`, an
expert layer's `pre_mlp_layernorm.weight`).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F

from tests import megatron_core_models as mc
from tests.megatron_core_shapes import SHAPES

_TRITON_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _split_conv1d_scan(
    zxbcdt,
    conv_weight,
    conv_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    activation,
    headdim,
    ngroups,
    norm_before_gate=False,
    seq_idx=None,
    **unused,
):
    """mamba_ssm's `mamba_split_conv1d_scan_combined` without an RMSNorm weight: zxbcdt
    [b, l, z | x B C | dt] -> y * silu(z), [b, l, heads x headdim], by the recurrence
    s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T, y_t = s_t C_t + D x_t."""
    assert seq_idx is None and activation == "silu" and not norm_before_gate and not unused
    dtype, (batch, length, _) = zxbcdt.dtype, zxbcdt.shape
    heads = A.shape[0]
    inner, state = heads * headdim, conv_weight.shape[0] - heads * headdim
    z, xbc, dt = zxbcdt.double().split([inner, conv_weight.shape[0], heads], dim=-1)
    width = conv_weight.shape[1]
    padded = F.pad(xbc.transpose(1, 2), (width - 1, 0))  # causal: only earlier tokens
    xbc = F.conv1d(padded, conv_weight.double()[:, None], conv_bias.double(), groups=xbc.shape[-1])
    x, b, c = F.silu(xbc.transpose(1, 2)).split([inner, state // 2, state // 2], dim=-1)
    x = x.view(batch, length, heads, headdim)
    per_group = heads // ngroups
    b = b.view(batch, length, ngroups, -1).repeat_interleave(per_group, dim=2)
    c = c.view(batch, length, ngroups, -1).repeat_interleave(per_group, dim=2)
    dt = F.softplus(dt + dt_bias.double())  # [b, l, heads]
    s = x.new_zeros(batch, heads, headdim, b.shape[-1])
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A.double())[..., None, None]
        s = decay * s + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append((s @ c[:, t, :, :, None])[..., 0] + D.double()[:, None] * x[:, t])
    y = torch.stack(ys, dim=1).reshape(batch, length, inner)
    return (y * F.silu(z)).to(dtype)


class _GroupedRMSNorm(torch.nn.Module):
    """mamba_ssm's RMSNorm over groups of `group_size` channels (called without a gate here:
    megatron-core's training path gates inside the scan)."""

    def __init__(self, hidden_size, eps, group_size, norm_before_gate, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x, z=None):
        assert z is None
        groups = x.double().unflatten(-1, (-1, self.group_size))
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * self.weight.double()).to(x.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


@contextlib.contextmanager
def hybrid_patches():
    if _TRITON_OPS not in sys.modules:
        try:  # (Triton is not installed on a CPU machine)
            __import__(_TRITON_OPS)
        except ImportError:
            stub = types.ModuleType(_TRITON_OPS)
            stub.tensor_get_slice_after = stub.tensor_masked_update = stub.tensor_merge = None
            sys.modules[_TRITON_OPS] = stub
    from megatron.core.ssm import mamba_block, mamba_mixer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    patches = {
        (mamba_mixer, "ExtendedRMSNorm"): _GroupedRMSNorm,
        (mamba_mixer, "mamba_split_conv1d_scan_combined"): _split_conv1d_scan,
        (mamba_block, "TENorm"): WrappedTorchNorm,
        (mamba_mixer, "HAVE_MAMBA_SSM"): True,  # (asked before the mixer is built)
    }
    # (the scan is bound only when mamba_ssm imports)
    saved = {place: getattr(*place, None) for place in patches}
    for (module, name), patch in patches.items():
        setattr(module, name, patch)
    try:
        with mc.cpu_patches():
            yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def _stack_spec(shape: dict):
    """megatron-core's MambaStack of local layers under Transformer Engine's names."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    gpt = get_gpt_layer_local_spec(normalization=shape["normalization"]).submodules
    names = gpt.sharded_state_dict_keys_map
    attention = TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm,
        self_attention=gpt.self_attention,
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": names["input_layernorm."]},
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm,
        mlp=gpt.mlp,
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": names["pre_mlp_layernorm."]},
    )
    experts = IdentityOp  # (MambaStack's, without expert layers)
    if shape["num_experts"]:
        experts = ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=gpt.pre_mlp_layernorm,
                mlp=get_moe_module_spec(use_te=False, num_experts=shape["num_experts"]),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    mamba = MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(
            module=MambaMixer,
            submodules=MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
            ),
        ),
        mamba_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
    )
    assert gpt.self_attention.submodules.q_layernorm is IdentityOp
    return ModuleSpec(
        module=MambaStack,
        submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(module=MambaLayer, submodules=mamba),
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
            moe_layer=experts,
        ),
    )


_OWN_CONV = ("mixer.conv1d_weight", "mixer.conv1d_bias")
_CONV_MODULE = ("mixer.conv1d.weight", "mixer.conv1d.bias")


def hold_conv_params(model) -> None:
    """Megatron-LM's Mamba mixers since its change #4899 (June 2026, after megatron-core 0.16)
    hold the convolution's weight and bias as their own parameters, `conv1d_weight` and
    `conv1d_bias`, which come before dt_bias, A_log and D in the parameters' order (so in the
    gradient buffers and the optimizer's groups); its torch_dist keys stayed `conv1d.weight`
    and `conv1d.bias`, its legacy state dict has the new names. Emulated on megatron-core
    0.16's mixer, whose conv1d module computes as before: its two tensors registered again,
    first, under the new names (`parameters()` yields a tensor once, at its first name), and
    the state dicts keep one name each, as the newer Megatron-LM's do."""
    for mixer in (m for m in model.modules() if type(m).__name__ == "MambaMixer"):
        own = dict(mixer._parameters)
        mixer._parameters.clear()
        mixer._parameters.update(
            conv1d_weight=mixer.conv1d.weight, conv1d_bias=mixer.conv1d.bias, **own
        )
    sharded, legacy = model.sharded_state_dict, model.state_dict_for_save_checkpoint

    def sharded_state_dict(*args, **kwargs):
        return {k: v for k, v in sharded(*args, **kwargs).items() if not k.endswith(_OWN_CONV)}

    def state_dict_for_save_checkpoint(*args, **kwargs):
        state = legacy(*args, **kwargs)
        return type(state)((k, v) for k, v in state.items() if not k.endswith(_CONV_MODULE))

    model.sharded_state_dict = sharded_state_dict
    model.state_dict_for_save_checkpoint = state_dict_for_save_checkpoint


def build(
    kind: str,
    tensor_parallel: int,
    seed: int = 0,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
):
    """megatron-core's MambaModel for this rank of a TP x PP (x EP) layout (its stages split
    the layers evenly, as megatron-core 0.16's MambaStack does)."""
    from megatron.core import parallel_state
    from megatron.core.models.mamba import MambaModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = SHAPES[kind]
    parallel_state.initialize_model_parallel(
        tensor_parallel, pipeline_parallel, expert_model_parallel_size=expert_parallel
    )
    torch.manual_seed(seed + parallel_state.get_pipeline_model_parallel_rank())
    config = TransformerConfig(
        **mc.config_fields(shape, tensor_parallel, pipeline_parallel),
        expert_model_parallel_size=expert_parallel,
        mamba_state_dim=shape["mamba_state_dim"],
        mamba_head_dim=shape["mamba_head_dim"],
        mamba_num_groups=shape["mamba_num_groups"],
        num_moe_experts=shape["num_experts"],
        moe_router_topk=shape["moe_router_topk"],
        moe_ffn_hidden_size=shape["moe_ffn_hidden_size"],
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
    )
    model = MambaModel(
        config=config,
        mamba_stack_spec=_stack_spec(shape),
        vocab_size=mc.PADDED_VOCAB,
        max_sequence_length=mc.SEQ,
        hybrid_override_pattern=shape["hybrid_layer_pattern"],
        position_embedding_type=shape["position_embedding_type"],
        rotary_base=int(shape["rotary_base"]),
        share_embeddings_and_output_weights=not shape["untie_embeddings_and_output_weights"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    with torch.no_grad():  # norms start at 1, A and D at set values: random, so mix-ups show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("bias", ".D")):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("A_log"):
                param.add_(torch.randn_like(param) * 0.3)
    if shape.get("mixer_conv_own"):
        hold_conv_params(model)
    return model


def save(kind: str, root: str, iteration: int, tensor_parallel: int, *unused) -> None:
    """One rank's part of Megatron-LM's torch_dist save of the hybrid at TP x DP."""
    import torch.distributed as dist

    with hybrid_patches():
        model = build(kind, tensor_parallel)
        args = mc.megatron_args(kind, tensor_parallel, 1)
        args.world_size = dist.get_world_size()
        mc.write(
            {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": model.sharded_state_dict(),
                "opt_param_scheduler": {"num_steps": 640, "max_lr": 3e-4},
            },
            root,
            iteration,
        )


def logits(kind: str, path: str) -> torch.Tensor:
    """megatron-core's logits of TOKENS from the checkpoint `path` (an iter_N), read into a
    one-rank MambaModel."""
    from megatron.core import dist_checkpointing

    with hybrid_patches():
        model = build(kind, 1, seed=123)  # other weights: the load must replace them all
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(state["model"])
        model.eval()
        positions = torch.arange(mc.TOKENS.shape[1])[None]
        length = mc.TOKENS.shape[1]
        mask = torch.triu(torch.ones(length, length), 1).bool()[None, None]
        with torch.no_grad():
            return model(mc.TOKENS, positions, mask)
