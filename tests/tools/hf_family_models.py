"""Tiny random models of the Hugging Face families whose layers go beyond LLaMA's options: the
kinds `build_hf_model` (tests/tools/hf_models.py) takes from here (cohere, cohere-qk, cohere2,
falcon, falcon-new, falcon-seq, starcoder2, phi, phi-qk, nemotron, smollm3, olmo3,
deepseek-v2, gptj, llama-mlp-bias, exaone4, ernie4_5, helium, seed-oss, arcee, glm4, gemma, olmoe,
granite, granite-moe, nemotron-h, nemotron-h-latent, bamba, granite-hybrid,
granite-hybrid-moe)."""

from __future__ import annotations

import torch


def shaken(model, biases: bool = False):
    """`model` with its norms away from 1 and expert biases that change the choice, so that a
    wrong mapping shows; `biases`: every bias away from 0 too, the norms' included."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            norm = "norm" in name or ".ln_" in name
            if norm and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif biases and name.endswith("bias"):
                param.normal_(0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1)
    return model


# (config class, model class, options) of the LLaMA layer's kin: RoPE on adjacent pairs and
# biases everywhere (ERNIE 4.5), pairs (Helium), q, k, v biases (Seed-OSS), ReLU² (Arcee); and
# GLM-4's layer
KIN = {
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"use_bias": True}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "seed-oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    # GLM-4-0414: four norms a layer, RoPE on pairs of half of each head, q, k, v biases
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "pad_token_id": None}),
}


def family_model(kind: str, common: dict):
    """transformers' random model of `kind` (its sizes from `common`, which
    `build_hf_model` sets), or None for a kind built in hf_models.py."""
    import transformers

    if kind in ("cohere", "cohere-qk"):  # one bias-free LayerNorm for the parallel attention
        # and MLP, interleaved RoPE, scaled logits, tied embeddings; cohere-qk: Command R+'s
        # query and key norms, a weight for each head
        config = transformers.CohereConfig(
            num_key_value_heads=2,
            logit_scale=0.25,
            use_qk_norm=kind == "cohere-qk",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
        model = shaken(transformers.CohereForCausalLM(config))
    elif kind.startswith("falcon"):  # falcon: Falcon-7B's layer (one norm, one key and value
        # head); falcon-new: 40B's (a norm each, 2 groups); falcon-seq: one after the other,
        # a key and value per head, biases
        layer = {
            "falcon": {},
            "falcon-new": {"new_decoder_architecture": True, "num_kv_heads": 2},
            "falcon-seq": {"parallel_attn": False, "multi_query": False, "bias": True},
        }[kind]
        falcon = {name: common[name] for name in ("vocab_size", "num_hidden_layers")}
        falcon.update(
            hidden_size=common["hidden_size"], ffn_hidden_size=common["intermediate_size"]
        )
        config = transformers.FalconConfig(
            **falcon,
            num_attention_heads=common["num_attention_heads"],
            max_position_embeddings=common["max_position_embeddings"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **layer,
        )
        model = shaken(transformers.FalconForCausalLM(config), biases=True)
    elif kind == "starcoder2":  # GQA, biases everywhere, LayerNorm, GELU, a window of 8
        config = transformers.Starcoder2Config(
            num_key_value_heads=2,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
        model = shaken(transformers.Starcoder2ForCausalLM(config), biases=True)
    elif kind in ("phi", "phi-qk"):  # phi: Phi-2's layer (RoPE on 0.4 of each head, biases,
        # the output layer's too); phi-qk: with LayerNorms on queries and keys, 2 groups, exact
        # GELU, tied embeddings
        options = {"qk_layernorm": True, "num_key_value_heads": 2, "hidden_act": "gelu"}
        config = transformers.PhiConfig(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.4,
            },
            **(dict(options, tie_word_embeddings=True) if kind == "phi-qk" else {}),
            **common,
        )
        model = shaken(transformers.PhiForCausalLM(config), biases=True)
    elif kind == "nemotron":  # LayerNorm1P, a squared-ReLU MLP, RoPE on half of each head,
        # 2 groups of heads wider than hidden / heads, biases
        config = transformers.NemotronConfig(
            num_key_value_heads=2,
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            **common,
        )
        model = shaken(transformers.NemotronForCausalLM(config), biases=True)
    elif kind == "smollm3":  # every other layer without RoPE, attending in a window of 8
        config = transformers.SmolLM3Config(
            num_key_value_heads=2,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=8,
            **dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),  # (Llama 3's ids)
            **common,
        )
        model = shaken(transformers.SmolLM3ForCausalLM(config))
    elif kind == "olmo3":  # OLMo 2's layers, three in four in a window of 8, YaRN (4x over
        # 16 positions) in the fourth
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
        config = transformers.Olmo3Config(
            num_key_value_heads=2,
            sliding_window=8,
            rope_parameters={
                "full_attention": {**yarn, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **common,
        )
        model = shaken(transformers.Olmo3ForCausalLM(config))
    elif kind == "deepseek-v2":  # DeepSeek-V2-Lite's MLA (no query latent; YaRN with a
        # temperature), a dense first layer, then a softmax over 8 experts kept as it is, in 4
        # groups scored by their best, 2 kept, scaled; a shared expert
        config = transformers.DeepseekV2Config(
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=32,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,  # (megatron-core's MLA YaRN's)
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            **common,
        )
        model = shaken(transformers.DeepseekV2ForCausalLM(config))
    elif kind == "gptj":  # one LayerNorm for the parallel attention and MLP, biases on the
        # MLP and the output layer, RoPE on adjacent pairs of half of each head
        config = transformers.GPTJConfig(
            vocab_size=common["vocab_size"],
            n_embd=common["hidden_size"],
            n_layer=common["num_hidden_layers"],
            n_head=common["num_attention_heads"],
            n_inner=common["intermediate_size"],
            n_positions=common["max_position_embeddings"],
            rotary_dim=8,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = shaken(transformers.GPTJForCausalLM(config), biases=True)
    elif kind == "llama-mlp-bias":  # LLaMA with biases on its MLP alone
        config = transformers.LlamaConfig(num_key_value_heads=2, mlp_bias=True, **common)
        model = shaken(transformers.LlamaForCausalLM(config), biases=True)
    elif kind == "exaone4":  # OLMo 2's norms, a norm over each head, layers 1-3 in a window
        # of 8 with RoPE, the fourth full without positions
        config = transformers.Exaone4Config(num_key_value_heads=2, sliding_window=8, **common)
        model = shaken(transformers.Exaone4ForCausalLM(config))
    elif kind in KIN:  # the LLaMA layer with one choice of its own (hf/llama_kin.py)
        config_class, model_class, options = KIN[kind]
        config = getattr(transformers, config_class)(num_key_value_heads=2, **options, **common)
        model = shaken(getattr(transformers, model_class)(config), biases=True)
    elif kind == "gemma":  # Gemma 1: GeGLU, (1 + weight) norms, scaled embeddings
        config = transformers.GemmaConfig(num_key_value_heads=2, head_dim=16, **common)
        model = transformers.GemmaForCausalLM(config)
        with torch.no_grad():  # norm weights away from their start (0: scaling by 1)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    elif kind == "olmoe":  # query and key norms across heads, unnormalized top-k
        config = transformers.OlmoeConfig(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            **{**common, "intermediate_size": 32},
        )
        model = shaken(transformers.OlmoeForCausalLM(config))
    elif kind == "granite":  # LLaMA with Granite's four multipliers, tied embeddings
        config = transformers.GraniteConfig(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            embedding_multiplier=3.0,
            attention_multiplier=0.1,
            residual_multiplier=0.5,
            logits_scaling=4.0,
            **common,
        )
        model = transformers.GraniteForCausalLM(config)
    elif kind == "granite-moe":  # Granite's multipliers, 4 experts of which 2 per token
        config = transformers.GraniteMoeConfig(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=3.0,
            attention_multiplier=0.1,
            residual_multiplier=0.5,
            logits_scaling=4.0,
            **{**common, "intermediate_size": 32},
        )
        model = transformers.GraniteMoeForCausalLM(config)
    elif kind == "cohere2":  # Cohere's layers; layers 1-3 in a window of 8 with RoPE, the
        # last attending to every key without positions
        config = transformers.Cohere2Config(
            num_key_value_heads=2,
            logit_scale=0.25,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
        model = shaken(transformers.Cohere2ForCausalLM(config))
    elif kind.startswith("nemotron-h"):  # Mamba-2, attention without positions, ReLU² MLP
        # and expert layers (sigmoid routing with expert biases, scaled, beside a shared
        # expert; nemotron-h-latent: Nemotron 3 Super's latent experts, 24 wide); the Mamba
        # decays, steps and skips away from transformers' initialization too
        sizes = {name: common[name] for name in ("vocab_size", "hidden_size", "intermediate_size")}
        config = transformers.NemotronHConfig(
            layers_block_type=["linear_attention", "full_attention", "mlp", "moe"]
            + ["linear_attention", "full_attention"],
            num_attention_heads=common["num_attention_heads"],
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=common["max_position_embeddings"],
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            routed_scaling_factor=2.5,
            moe_latent_size=24 if kind.endswith("latent") else None,
            **sizes,
        )
        model = shaken(transformers.NemotronHForCausalLM(config))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mixer.D", "mixer.dt_bias")):
                    param.uniform_(-1.0, 1.0)
                elif name.endswith("mixer.A_log"):
                    param.uniform_(-1.0, 1.0)
    elif kind in ("bamba", "granite-hybrid", "granite-hybrid-moe"):  # IBM's hybrids: Mamba-2
        # or attention, then an MLP; Bamba's RoPE on half of each head; Granite 4.0's
        # multipliers, no positions, and (granite-hybrid-moe) experts beside the shared MLP
        mamba = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16)
        sizes = {name: common[name] for name in ("vocab_size", "hidden_size", "num_hidden_layers")}
        sizes.update(num_attention_heads=common["num_attention_heads"], num_key_value_heads=2)
        sizes.update(max_position_embeddings=common["max_position_embeddings"], rms_norm_eps=1e-5)
        if kind == "bamba":
            config = transformers.BambaConfig(
                attn_layer_indices=[1, 3], intermediate_size=common["intermediate_size"], **mamba,
                **sizes,
            )  # fmt: skip
            model = transformers.BambaForCausalLM(config)
        else:
            experts = (
                {"num_local_experts": 4, "num_experts_per_tok": 2} if kind.endswith("moe") else {}
            )
            config = transformers.GraniteMoeHybridConfig(
                layer_types=["mamba", "attention", "mamba", "mamba"][: sizes["num_hidden_layers"]],
                intermediate_size=32,
                shared_intermediate_size=common["intermediate_size"],
                embedding_multiplier=2.0,
                attention_multiplier=0.2,
                residual_multiplier=0.5,
                logits_scaling=4.0,
                **{"num_local_experts": 0, **experts},
                **mamba,
                **sizes,
            )
            model = transformers.GraniteMoeHybridForCausalLM(config)
        model = shaken(model)
        with torch.no_grad():  # (the decays, steps and skips away from their initialization)
            for name, param in model.named_parameters():
                if name.endswith(("mamba.D", "mamba.dt_bias", "mamba.A_log")):
                    param.uniform_(-1.0, 1.0)
    else:
        return None
    return model
