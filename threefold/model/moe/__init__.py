"""Mixture-of-experts layers (Megatron's --num-experts): router, dispatch, experts."""

from threefold.model.moe.layer import MoELayer, set_aux_loss_scale

__all__ = ["MoELayer", "set_aux_loss_scale"]
