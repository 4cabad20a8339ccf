"""Multi-token prediction depths in Hugging Face files (DeepSeek-V3's, GLM-4.5's, Qwen3-Next's,
Nemotron 3 Super's): how many the files hold, and a depth's layer read and written as a decoder
layer is, under the names the adapters read (`DepthAsDecoder`, `RenamedSource`).

DeepSeek-V3 and GLM-4.5 keep depth k as the Hub's layer num_layers + k: a decoder layer of the
last layer's kind, with its enorm, hnorm, eh_proj and shared_head.norm (the depth's final
norm), and copies of the model's embedding and output layer (embed_tokens, shared_head.head),
which megatron-core's depths share: a copy that differs is refused, and an export writes them.
"""

from __future__ import annotations

import torch

from threefold.checkpoint.hf.common import Adapter, Take
from threefold.config import ConfigError, ModelConfig


def keep_held_depths(adapter: Adapter, config: ModelConfig, hf_state: dict) -> None:
    """The multi-token prediction depths config.json names that the files hold:
    transformers computes none and saves none, so a model it saved (fine-tuned, say) keeps
    the count in its config without the layers. Fewer held: `config` has those, said."""
    named = config.mtp_depths_built()
    held = 0
    while held < named and adapter.depth_marker(config, held) in hf_state:
        held += 1
    if held == named:
        return
    print(
        f"> config.json names {named} multi-token prediction depths and the files hold "
        f"{held} (transformers saves none): the conversion has {held}"
    )
    if config.hybrid:  # (the pattern's `/` parts)
        decoder, depth = config.hybrid_layer_pattern.split("/")[0], config.hybrid_mtp_layers()
        config.hybrid_layer_pattern = decoder + f"/{depth}" * held
    config.mtp_num_layers = held or None


class DepthAsDecoder(dict):
    """threefold's tensors with a multi-token prediction depth's transformer layer (`depth`)
    read under a decoder layer's names (`decoder`), as the adapters' `give_*` read them."""

    def __init__(self, state, depth: str, decoder: str) -> None:
        super().__init__()
        self.state, self.depth, self.decoder = state, depth, decoder

    def _ours(self, name: str) -> str:
        return (
            self.depth + name.removeprefix(self.decoder) if name.startswith(self.decoder) else name
        )

    def __getitem__(self, name: str):
        return self.state[self._ours(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._ours(name) in self.state

    def get(self, name: str, default=None):
        return self[name] if name in self else default


class RenamedSource:
    """A Hugging Face state dict read under other names: the adapters' `take_*` read a decoder
    layer's `model.layers.{i}.`, which a multi-token prediction module's layer is (`ours`
    -> `theirs` at the start of a name)."""

    def __init__(self, take: Take, ours: str, theirs: str) -> None:
        self.take, self.ours, self.theirs = take, ours, theirs

    def _theirs(self, name: str) -> str:
        return self.theirs + name.removeprefix(self.ours) if name.startswith(self.ours) else name

    def __call__(self, name: str) -> torch.Tensor:
        return self.take(self._theirs(name))

    def __contains__(self, name: str) -> bool:
        return self._theirs(name) in self.take


# A depth's own tensors in its Hub layer: threefold's name under mtp.layers.{k}. -> the file's
_MTP_PARTS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
# ... and its copies of what megatron-core's depths share: the file's -> threefold's tensor
_MTP_COPIES = {
    "embed_tokens.weight": "embedding.word_embeddings.weight",
    "shared_head.head.weight": "output_layer.weight",
}


def mtp_depths(hf: dict) -> int | None:
    """--mtp-num-layers of the Hub's num_nextn_predict_layers (None: none)."""
    return hf.get("num_nextn_predict_layers") or None


def as_depth(layer: dict, i: int, k: int) -> dict:
    """The file's layer i, taken as a decoder layer, as depth k's transformer layer."""
    prefix, depth = f"decoder.layers.{i}.", f"mtp.layers.{k}.transformer_layer."
    return {depth + name.removeprefix(prefix): tensor for name, tensor in layer.items()}


def take_mtp_depths(adapter: Adapter, take: Take, config: ModelConfig, out: dict) -> dict:
    """Each built depth k from the file's layer num_layers + k (`out`: the decoder's tensors,
    which its copies must equal)."""
    depths = {}
    for k in range(config.mtp_depths_built()):
        i, ours = config.num_layers + k, f"mtp.layers.{k}."
        p = f"model.layers.{i}."
        depths.update(as_depth(adapter.take_layer(take, config, i), i, k))
        depths.update({ours + name: take(p + part) for name, part in _MTP_PARTS.items()})
        for copy, shared in _MTP_COPIES.items():
            shared = shared if shared in out else "embedding.word_embeddings.weight"  # (tied)
            if p + copy in take and not torch.equal(take(p + copy), out[shared]):
                raise ConfigError(
                    f"{p + copy} differs from the model's own ({shared}): threefold's "
                    "multi-token prediction depths share the model's, as megatron-core's do"
                )
    return depths


def give_mtp_depths(adapter: Adapter, state: dict, config: ModelConfig) -> dict:
    """`take_mtp_depths`' inverse, with the copies the Hub's files hold."""
    out = {}
    for k in range(config.mtp_depths_built()):
        i, ours = config.num_layers + k, f"mtp.layers.{k}."
        p, depth = f"model.layers.{i}.", f"{ours}transformer_layer."
        as_decoder = DepthAsDecoder(state, depth, f"decoder.layers.{i}.")
        out.update(adapter.give_layer(as_decoder, config, i))
        out.update({p + part: state[ours + name] for name, part in _MTP_PARTS.items()})
        for copy, shared in _MTP_COPIES.items():  # (copies: a file holds no shared tensors)
            shared = shared if shared in state else "embedding.word_embeddings.weight"
            out[p + copy] = state[shared].clone()
    return out
