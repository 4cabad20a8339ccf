"""Sliding-window attention: Megatron-LM's --window-size and --window-attn-skip-freq (Mistral's
and GPT-OSS's sliding window).

--window-size L,R lets a query attend to the keys from L tokens back up to R ahead; causal
models take R = 0, so a query sees itself and the L tokens before it (a Hugging Face
`sliding_window` of L + 1). --window-attn-skip-freq picks the layers that keep full
attention: N makes every N-th layer full and the others windowed (N-1 : 1, megatron-core's
`is_layer_window_attention`), a pattern such as [1,1,1,0]*3 gives 1 (window) or 0 (full) per
layer. Gated delta net layers have no window. The window is a band of the causal mask, built
where the attention runs (model/attention.py; over CP ranks a block at a time), and combines
with packed documents' masks.

`ModelConfig` inherits the fields; `finalize_window_attention` is called from its finalize.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from threefold.config.errors import require as _require
from threefold.config.fields import ARCHITECTURE, arg
from threefold.config.moe import every_nth_layer, parse_layer_pattern

GROUP = "sliding-window attention"


@dataclass
class WindowAttentionConfig:
    window_size: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="L,R: a query attends to the keys L tokens back to R ahead (causal: R = 0)",
    )
    window_attn_skip_freq: str | None = arg(
        None,
        checkpoint=ARCHITECTURE,
        group=GROUP,
        help="N: every N-th layer full attention, the others windowed; or a pattern such as "
        "[1,1,1,0]*3 with 1 for window, 0 for full attention",
    )

    def attention_window(self) -> int | None:
        """How many keys back from its own a query sees (None: no window)."""
        if self.window_size is None:
            return None
        return int(self.window_size.strip("()").split(",")[0])

    def window_pattern(self, num_layers: int) -> list[int]:
        """1 for each layer with the window, 0 for full attention."""
        if self.window_size is None:
            return [0] * num_layers
        freq = self.window_attn_skip_freq
        if freq is None:
            return [1] * num_layers
        if freq.strip().isdigit():  # (the N-th, 2N-th, ... layers are full)
            full = every_nth_layer(int(freq), num_layers, "--window-attn-skip-freq")
            return [1 - layer for layer in full]
        return parse_layer_pattern(freq, num_layers, "--window-attn-skip-freq")

    def finalize_window_attention(self) -> None:
        if self.window_size is None:
            _require(
                self.window_attn_skip_freq is None,
                "--window-attn-skip-freq picks the layers of --window-size's window; give it",
            )
            return
        match = re.fullmatch(r"\(?\s*(-?\d+)\s*,\s*(-?\d+)\s*\)?", self.window_size.strip())
        _require(
            match is not None,
            f"--window-size {self.window_size}: give L,R, the keys back and ahead (e.g. 4095,0)",
        )
        back, ahead = int(match.group(1)), int(match.group(2))
        _require(
            back >= 0 and ahead == 0,
            f"--window-size {self.window_size}: a causal model's window is L,0 with L >= 0 (the "
            "keys back from the query)",
        )
        self.window_size = f"{back},{ahead}"
        self.window_pattern(self.num_layers)  # (a malformed pattern: one line now)
