"""Torch's single-tensor all-gather and reduce-scatter under their current names.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and warns (FutureWarning) on every call of the old names: thousands of
lines in a sequence-parallel log. Older torch (the GPU image's 2.11) has only the old names.
"""

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
