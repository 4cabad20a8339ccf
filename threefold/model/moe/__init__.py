"""Mixture-of-experts layers (Megatron's --num-experts): router, dispatch, experts."""

from threefold.model.moe.layer import MoELayer, start_aux_losses

__all__ = ["MoELayer", "start_aux_losses"]
