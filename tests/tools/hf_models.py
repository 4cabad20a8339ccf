"""Tiny random-init Hugging Face models and a tokenizer, built offline for conversion tests."""

from __future__ import annotations

import os
import sys

import torch

from tests.tools.hf_family_models import family_model, shaken

VOCAB = 300
# A batch of two sequences of 23 positions and their next tokens
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.join(ROOT, "tools"))  # tools/ is no package: its scripts by name
import convert_checkpoint  # noqa: E402


def convert_in_process(*argv: str) -> None:
    """tools/convert_checkpoint.py's main, in this process: for a conversion that only makes a
    test's inputs or exports what it checks (3 s of imports less than the tool's own process,
    whose exit codes and refusals tests/tools/test_convert_checkpoint.py runs)."""
    assert convert_checkpoint.main(list(argv)) == 0


def converted_hf_model(kind: str, root) -> tuple:
    """(transformers' random model of `kind`, its directory, threefold's checkpoint of it)
    under the directory `root`."""
    hf_dir, ours = str(root / "hf"), str(root / "threefold")
    model = build_hf_model(kind, hf_dir)
    convert_in_process(
        "--loader", "hf", "--saver", "threefold", "--load-dir", hf_dir, "--save-dir", ours
    )
    return model, hf_dir, ours


# ChatML, as Qwen's chat models render conversations.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The special tokens of Nemotron's tokenizers that Megatron-LM's SFT prompt formats use.
NEMOTRON_SPECIALS = ("<unk>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>")


def build_tokenizer(directory: str, chat: bool = False, specials: tuple[str, ...] = ()) -> None:
    """A byte-level BPE tokenizer trained on a few lines, saved as HF tokenizer files; `chat`:
    with ChatML's special tokens, <|im_end|> as end of sequence, and its chat template;
    `specials`: more special tokens (NEMOTRON_SPECIALS, say)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = [
        "To be, or not to be, that is the question:",
        "Whether 'tis nobler in the mind to suffer",
        "The slings and arrows of outrageous fortune",
    ] * 20
    specials = ["<s>", "</s>", *specials] + (["<|im_start|>", "<|im_end|>"] if chat else [])
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=alphabet
    )
    tokenizer.train_from_iterator(text, trainer)
    eos = "<|im_end|>" if chat else "</s>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token=eos)
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


# DeepSeek-V3's and V3.2's multi-latent attention: a query latent, a value head narrower than
# the query/key head
MLA_SIZES = dict(
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12
)


# DeepSeek-V3's routing, as DeepSeek-V3 and GLM-4.5 configure it: a dense first layer, then
# sigmoid scores with expert biases over 4 groups of 2 experts, 2 groups kept, scaled by 2.5
DEEPSEEK_ROUTING = dict(
    n_routed_experts=8,
    n_shared_experts=1,
    moe_intermediate_size=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
)


def build_hf_model(kind: str, directory: str, num_layers: int = 4, chat: bool = False):
    """Save a random-init HF model of `kind` (llama, llama-tied, llama3, llama-linear,
    llama-yarn, qwen2, qwen3, phi3, phi3-longrope, olmo2, gemma2, gemma3, gpt-neox, gpt2,
    mistral, mixtral, qwen3-moe, qwen2-moe, qwen3-next, deepseek-v3, glm4-moe, llama4,
    deepseek-v32, gpt-oss, and those of tests/tools/hf_family_models.py) with a tokenizer
    (`chat`: a ChatML chat tokenizer)."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        num_hidden_layers=num_layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    model = family_model(kind, common)
    if model is not None:
        pass
    elif kind == "llama":
        config = transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=50000.0,
            rms_norm_eps=1e-5,
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama3":  # Llama 3.2-style RoPE scaling; the head size puts one frequency
        # in each of the kept, interpolated and slowed bands
        config = transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama-linear":  # linear position interpolation, a context 4x as long
        config = transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "llama-yarn":  # YaRN 4x over an original context of 16, with a temperature
        config = transformers.LlamaConfig(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    elif kind == "mistral":  # saved in shards with an index file; a sliding window of 8
        config = transformers.MistralConfig(num_key_value_heads=2, sliding_window=8, **common)
        model = transformers.MistralForCausalLM(config)
        model.generation_config.eos_token_id = None
        model.save_pretrained(directory, max_shard_size="100KB")
        build_tokenizer(directory)
        return model.eval()
    elif kind == "llama-tied":  # SmolLM-style
        config = transformers.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=True, **common)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            num_key_value_heads=2, tie_word_embeddings=False, **common
        )
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # random biases, so a wrong mapping shows
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0, 0.5)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(
            num_key_value_heads=2, tie_word_embeddings=False, head_dim=24, **common
        )
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():  # norm weights away from 1, so a wrong mapping shows
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    elif kind == "phi3":  # fused QKV and gate/up; a window of 8; RoPE on half of each head
        config = transformers.Phi3Config(
            num_key_value_heads=2,
            sliding_window=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=False,
            pad_token_id=0,
            **common,
        )
        model = shaken(transformers.Phi3ForCausalLM(config))
    elif kind == "phi3-longrope":  # Phi-4 mini's: LongRoPE on 3/4 of each head (6 pairs),
        # an original context of 16 of 64, the Hub's top-level original_max_position_embeddings
        config = transformers.Phi3Config(
            num_key_value_heads=2,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
            },
            tie_word_embeddings=True,
            pad_token_id=0,
            **common,
        )
        model = shaken(transformers.Phi3ForCausalLM(config))
    elif kind == "gemma3":  # 3 layers with a window of 6 (their RoPE base 100), then a full
        # one (base 1e4, linear scaling 2); a query scale of its own; norms away from 0
        config = transformers.Gemma3TextConfig(
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=32,
            sliding_window=6,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            pad_token_id=0,
            **common,
        )
        model = transformers.Gemma3ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(-0.5, 0.5)
    elif kind == "gemma2":  # windows of 6 in layers 1 and 3; scores capped at 0.01 (random
        # ones are small), logits at 3
        config = transformers.Gemma2Config(
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=32,
            sliding_window=6,
            attn_logit_softcapping=0.01,
            final_logit_softcapping=3.0,
            pad_token_id=0,
            attn_implementation="eager",  # (transformers' other attention drops the cap)
            **common,
        )
        model = transformers.Gemma2ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(-0.5, 0.5)
    elif kind == "mixtral":
        config = transformers.MixtralConfig(
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            **{**common, "intermediate_size": 48},
        )
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3-moe":  # a dense layer among MoE ones, unnormalized top-k probabilities
        config = transformers.Qwen3MoeConfig(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            **common,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    elif kind == "qwen2-moe":  # Qwen2's biased attention; a dense layer; unnormalized top-k
        # probabilities beside a shared expert its sigmoid gate scales
        config = transformers.Qwen2MoeConfig(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            **common,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
        with torch.no_grad():  # random biases and norms, so a wrong mapping shows
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0, 0.5)
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    elif kind == "qwen3-next":  # gated delta nets (4 key heads of 2 value heads each, as wide
        # as the key heads) in layers 1-3, gated attention in 4; a dense layer; RoPE on a quarter
        config = transformers.Qwen3NextConfig(
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            **common,
        )
        model = transformers.Qwen3NextForCausalLM(config)
        with torch.no_grad():  # norms away from their start, so a wrong mapping shows
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5) if "linear_attn" not in name else param.uniform_(
                        0.5, 1.5
                    )
    elif kind == "deepseek-v3":  # MLA with YaRN and a temperature; a dense first layer, then
        # sigmoid routing with expert biases over 4 groups of 2 experts, 2 groups kept, scaled
        config = transformers.DeepseekV3Config(
            **MLA_SIZES,
            **DEEPSEEK_ROUTING,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            tie_word_embeddings=False,
            **common,
        )
        model = shaken(transformers.DeepseekV3ForCausalLM(config))
    elif kind == "glm4-moe":  # GLM-4.5's attention (biases on q, k, v; head norms; RoPE on half
        # of each head) with DeepSeek-V3's routing: a dense first layer, 4 groups of 2, 2 kept
        config = transformers.Glm4MoeConfig(
            num_key_value_heads=2,
            head_dim=24,
            attention_bias=True,
            use_qk_norm=True,
            **DEEPSEEK_ROUTING,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=False,
            **common,
        )
        model = shaken(transformers.Glm4MoeForCausalLM(config))
        with torch.no_grad():  # q/k/v biases away from 0 too
            for name, param in model.named_parameters():
                if name.endswith("_proj.bias"):
                    param.normal_(0, 0.5)
    elif kind == "llama4":  # Scout's layers shrunk: every other layer without RoPE (their
        # queries tempered from position 3 on), the others in chunks of 4 with the L2 norm;
        # experts in layers 2 and 4; Scout's RoPE scaling, its bands over a context of 8
        config = transformers.Llama4TextConfig(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size_mlp=96,
            num_local_experts=4,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=2,
            attention_chunk_size=4,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8,
            },
            tie_word_embeddings=False,
            **{**common, "intermediate_size": 32},
        )
        model = shaken(transformers.Llama4ForCausalLM(config))
        with torch.no_grad():  # the experts from their zeros
            for name, param in model.named_parameters():
                if "experts." in name:
                    param.normal_(0, 0.1)
    elif kind == "deepseek-v32":  # DeepSeek-V3's model (without its experts) whose attention
        # each query attends to the 6 keys an indexer of 4 heads of 32 picks
        config = transformers.DeepseekV32Config(
            **MLA_SIZES,
            first_k_dense_replace=num_layers,
            index_n_heads=4,
            index_head_dim=32,
            index_topk=6,
            num_key_value_heads=4,  # (its default of 128 leaves the eager attention no keys)
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            attn_implementation="eager",  # (its SDPA path hands the indexer no mask)
            **common,
        )
        model = transformers.DeepseekV32ForCausalLM(config)
        with torch.no_grad():  # norms away from 1, and the indexer's key norm's bias from 0
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5) if name.endswith("weight") else param.uniform_(-1, 1)
    elif kind == "gpt-oss":  # a window of 8 in layers 1 and 3, YaRN 4x unrounded, a clamp
        # the activations reach; biases and sinks random, so a mix-up shows
        config = transformers.GptOssConfig(
            num_key_value_heads=2,
            head_dim=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
            swiglu_limit=0.1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,  # (a correction range that rounding would move)
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            tie_word_embeddings=False,
            **{**common, "intermediate_size": 32},
        )
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0, 0.5 if name.endswith("sinks") else 0.1)
                elif name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    elif kind == "olmo2":  # norms after the sublayers only; q and k normed across heads
        config = transformers.Olmo2Config(
            num_key_value_heads=2, tie_word_embeddings=False, **common
        )
        model = shaken(transformers.Olmo2ForCausalLM(config))
    elif kind == "gpt-neox":  # Pythia's layer: attention and MLP in parallel; RoPE on a quarter
        config = transformers.GPTNeoXConfig(
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
            use_parallel_residual=True,
            **{**common, "intermediate_size": 256},
        )
        model = transformers.GPTNeoXForCausalLM(config)
        with torch.no_grad():  # biases and norms away from their start
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.1)
                elif "norm" in name:
                    param.uniform_(0.5, 1.5)
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_layer=num_layers, n_embd=64, n_head=4, n_positions=64
        )
        model = transformers.GPT2LMHeadModel(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.1)
    else:
        raise ValueError(kind)
    model.generation_config.eos_token_id = None  # compare full-length greedy generations
    model.save_pretrained(directory)
    build_tokenizer(directory, chat)
    return model.eval()


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("THREEFOLD_SKIP_HF") is None


def assert_live_experts_convert_as_saved(hf_model, hf_dir: str) -> dict:
    """transformers 5 stacks a mixture's experts in memory and saves them one by one: both
    convert to the same tensors. Returns them."""
    import json

    from safetensors import torch as safetensors_torch

    from threefold.checkpoint.hf import hf_to_threefold, model_config_from_hf

    with open(os.path.join(hf_dir, "config.json")) as f:
        architecture, config = model_config_from_hf(json.load(f))
    saved = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    live = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    assert any(name.endswith("experts.gate_up_proj") for name in live)
    from_saved = hf_to_threefold(saved, config, architecture)
    from_live = hf_to_threefold(live, config, architecture)
    assert from_saved.keys() == from_live.keys()
    assert all(torch.equal(from_saved[name], from_live[name]) for name in from_saved)
    return from_saved
