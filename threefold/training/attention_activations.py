"""What attention's variants keep for backward beyond its core (training/activation_estimate.py
adds them to a layer's or a micro-batch's activations; its module doc says what each is): the
query and key norms, the attention masks every layer shares, DeepSeek sparse attention's
mask and indexer loss."""

from __future__ import annotations

from threefold.config import Config


def shared_mask_bytes(config: Config, layers: list[int], s: int, b: int, e: int) -> int:
    """The attention masks a stage's layers share (context_parallel/masks.py), kept once a
    micro-batch on one CP rank: SDPA's additive copy (e bytes an entry) of the packed
    documents' mask [b, s, s] in the layers without a window or chunks, of the window's band
    ([s, s]; [b, s, s] within the documents) in those with one, and of the chunks' mask
    within the documents (chunks alone fold into the batch: no mask). Attention sinks' and
    capped scores' blocks keep the boolean masks instead (1 byte an entry). Over CP ranks
    Ulysses (a2a) masks the whole sequence likewise, windows and chunks from the ids of one
    document where there are none ([b, s, s]); the ring's blocks build theirs as they go."""
    model, data, parallel = config.model, config.data, config.parallel
    if model.multi_latent_attention:
        return 0
    ulysses = parallel.context_parallel_size > 1
    if ulysses:
        if parallel.comm_type != "a2a":
            return 0
        s *= parallel.context_parallel_size
    documents = data.reset_attention_mask or data.sft or data.dataloader_inter_document_masking
    count = model.num_layers
    windowed, linear = model.window_pattern(count), model.linear_attention_pattern(count)
    chunked = [0] * count  # (--attention-chunk-size: the layers with RoPE)
    if model.attention_chunk_size:
        chunked = [1 - nope for nope in model.no_rope_pattern(count)]
    kinds = set()
    for layer in layers:
        if not linear[layer]:
            kinds.add("window" if windowed[layer] else "chunk" if chunked[layer] else "plain")
    entry = 1 if model.softmax_type != "vanilla" or model.attn_logit_softcapping else e
    masks = 0
    if documents:
        masks = len(kinds) * b  # (one mask per kind: the documents', within a window, chunks)
    elif ulysses:
        masks = len(kinds - {"plain"}) * b
    elif "window" in kinds:
        masks = 1  # (the band alone)
    return entry * masks * s * s


def qk_norm_bytes(config: Config, s: int, b: int, e: int) -> int:
    """The query and key norms' tensors (in the QKV projection's offloading group, whose
    forward runs them): activation_estimate.py's module doc says what they are."""
    model = config.model
    t = config.parallel.tensor_model_parallel_size
    a, g, d = model.num_attention_heads // t, model.num_query_groups // t, model.kv_channels
    across = model.qk_layernorm and model.qk_layernorm_across_heads
    if not (model.qk_layernorm or model.qk_l2_norm):
        return 0
    tokens, rows = s * b, s * b * (a + g)
    copies = 4 * tokens * (a + g) * d if e == 2 or across else 4 * tokens * a * d
    if model.qk_l2_norm and not model.qk_layernorm:  # no weight: no normalized copy
        return copies + 4 * rows
    per_head = model.qk_layernorm_per_head
    normalized = 4 * tokens * (a + g) * d if per_head or model.normalization == "RMSNorm" else 0
    stats = 1 if model.normalization == "RMSNorm" else 2
    return copies + normalized + 4 * stats * (2 * tokens if across else rows)


def sparse_attention_bytes(config: Config, s: int, b: int, e: int) -> int:
    """DeepSeek sparse attention's additions (model/dsa.py): the attention's mask of chosen
    keys, as SDPA's additive bias (e b s^2), and, when the indexer learns, what its loss's
    graph keeps: its per-head ReLU scores (fp32, b H s^2), the softmax, logarithm and target of
    its KL divergence (fp32, 3 b s^2), the top-k indices, fp32 copies of its queries and keys,
    its key norm's input and statistics and its head weights; under sequence parallelism the
    gathered attention input and query latent too."""
    model, parallel = config.model, config.parallel
    if not model.sparse_attention:
        return 0
    mask = e * b * s * s
    if not model.dsa_indexer_loss_coeff:  # (the indexer then runs without a graph)
        return mask
    heads, d, k = model.dsa_indexer_n_heads, model.dsa_indexer_head_dim, model.dsa_indexer_topk
    scores = 4 * b * s * s * (heads + 3) + 8 * b * s * min(k, s)
    per_token = 4 * heads * d + 4 * d + e * d + 8 + e * heads
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1:
        per_token += e * (model.hidden_size + (model.q_lora_rank or model.hidden_size))
    return mask + scores + s * b * per_token
