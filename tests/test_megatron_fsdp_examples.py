"""Megatron-LM's Megatron-FSDP example launch scripts (examples/megatron_fsdp/): DeepSeek-V3's
(sbatch_mfsdp_deepseek_v3.sh: MLA, 256 experts at EP8 through the flex dispatcher, MTP,
--moe-router-force-load-balancing) and Llama-3 8B's FP8 recipe (train_llama3_8b_fsdp_h100_fp8.sh)
take their flags as they are, the model's sizes shrunk: what they select that threefold runs
another way is said at start-up, nothing refused; and the router's forced balance is
megatron-core's (random logits, the gradient straight through)."""

from __future__ import annotations

import pytest
import torch

from threefold.arguments import parse_args

# sbatch_mfsdp_deepseek_v3.sh's PRETRAIN_ARGS with USE_MEGATRON_FSDP=1 (its default), sizes
# shrunk (61 layers of 7168 with 256 experts in 8 groups: 4 of 64 with 16 experts in 8 groups)
DEEPSEEK_V3 = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel
--use-flash-attn --disable-bias-linear --micro-batch-size 1 --global-batch-size 16
--train-samples 1600 --exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad
--manual-gc --manual-gc-interval 10 --recompute-granularity selective
--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine
--seq-length 32 --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader
--num-workers 1 --num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--kv-channels 16 --max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000
--make-vocab-size-divisible-by 32 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
--untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0
--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 1500
--lr-warmup-samples 16 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 16
--moe-layer-freq [0]*1+[1]*3 --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 8
--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax
--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4
--moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid
--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
--moe-permute-fusion --moe-router-force-load-balancing --q-lora-rank 24 --kv-lora-rank 16
--qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --rotary-scaling-factor 40 --mscale 1.0
--mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 2
--eval-interval 100 --auto-detect-ckpt-format --save-interval 100 --dist-ckpt-strictness log_all
--init-method-std 0.02 --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40 --bf16
--enable-experimental --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
--no-gradient-accumulation-fusion --use-distributed-optimizer --calculate-per-token-loss
--init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer --use-nccl-ub
--megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16 --mock-data
--vocab-size 500
""".split()
# train_llama3_8b_fsdp_h100_fp8.sh's flags with its mock data (FP8, USE_MEGATRON_FSDP=1),
# sizes shrunk
LLAMA3_FP8 = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32
--max-position-embeddings 32 --position-embedding-type rope --rotary-base 1000000
--rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu
--normalization RMSNorm --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1
--global-batch-size 8 --train-samples 1600 --lr-decay-samples 1500 --lr-warmup-samples 16
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--bf16 --cross-entropy-loss-fusion --no-check-for-nan-in-loss-and-grad --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235 --use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
--calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor
--use-nccl-ub --fsdp-double-buffer --fsdp-manual-registration --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --fp8-format hybrid --fp8-amax-history-len 1024
--fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1
--context-parallel-size 1 --sequence-parallel --mock-data --tokenizer-type NullTokenizer
--vocab-size 128256 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
--num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100
""".split()


def test_deepseek_v3s_script_runs_its_flex_dispatcher_as_alltoall(capsys):
    config = parse_args(DEEPSEEK_V3, world_size=8)
    out = capsys.readouterr().out
    model = config.model
    assert (model.moe_token_dispatcher_type, model.moe_router_force_load_balancing) == (
        "alltoall",
        True,
    )
    assert config.parallel.expert_model_parallel_size == 8
    assert config.parallel.distributed_strategy == "fsdp"
    assert config.parallel.init_model_with_meta_device
    for said in (
        "--moe-token-dispatcher-type flex (hybridep) runs as alltoall",
        "--moe-router-force-load-balancing routes by random logits",
        "--enable-experimental has no effect",
        "--fsdp-double-buffer has no effect",
        "--use-nccl-ub has no effect",
    ):
        assert said in out, said


def test_llama3s_fp8_script_parses_with_its_megatron_fsdp_flags(capsys):
    config = parse_args(LLAMA3_FP8, world_size=2)
    out = capsys.readouterr().out
    assert config.parallel.distributed_strategy == "fsdp" and config.fp8.fp8_param_gather
    assert "--fsdp-manual-registration has no effect" in out


def test_the_flex_backend_without_flex_is_one_line(capsys):
    argv = [a for a in DEEPSEEK_V3 if a != "flex"]
    argv[argv.index("--moe-token-dispatcher-type")] = "--moe-shared-expert-overlap"
    with pytest.raises(SystemExit):
        parse_args(argv, world_size=8)
    error = capsys.readouterr().err
    assert "--moe-flex-dispatcher-backend hybridep belongs to --moe-token-dispatcher-type" in error
    assert error.count("\n") == 1


def test_forced_balance_routes_by_random_logits_and_passes_the_gradient_through():
    """megatron-core's RandomSTE: the router's own logits choose nothing (a router of zeros
    routes as a trained one), each expert gets about its share, the same draw repeats under
    the same generator state (as a recomputation restores it), and the router's input gets
    the gradient of the random logits through its weight."""
    from tests.parity import LLAMA_STYLE, TRAINING, _setup
    from threefold.model.moe.router import TopKRouter
    from threefold.parallel.tensor_parallel.random import get_rng_tracker

    moe = ["--num-experts", "4", "--moe-router-topk", "1", "--moe-router-force-load-balancing"]
    moe += ["--moe-router-score-function", "sigmoid"]
    trainer = _setup(LLAMA_STYLE + TRAINING + moe)
    router = next(m for m in trainer.model.modules() if isinstance(m, TopKRouter))
    tokens = torch.randn(4000, router.weight.shape[1])
    state = {name: s.clone() for name, s in get_rng_tracker().states.items()}
    probs, routing_map, _ = router(tokens, 1)
    counts = routing_map.sum(0).float()
    assert (counts - 1000).abs().max() < 100  # 4,000 tokens: ~1,000 each (sd ~27)
    get_rng_tracker().states.update({n: s.clone() for n, s in state.items()})
    with torch.no_grad():
        router.weight.zero_()
    again, again_map, _ = router(tokens.requires_grad_(), 1)
    assert torch.equal(again_map, routing_map) and torch.equal(again, probs)
    (grad,) = torch.autograd.grad(again.sum(), tokens)
    # straight through: d sum(sigmoid(draw)) / d tokens = sigmoid' at the draw times the
    # chosen expert's weight row: zero for a router of zeros
    assert grad.abs().sum() == 0
    with torch.no_grad():
        router.weight.normal_()
    get_rng_tracker().states.update({n: s.clone() for n, s in state.items()})
    third, _, _ = router(tokens, 1)
    (grad,) = torch.autograd.grad(third.sum(), tokens)
    chosen = third.gather(1, third.argmax(1, keepdim=True))
    slope = chosen * (1 - chosen)  # sigmoid' at the drawn logit
    expected = slope * router.weight[third.argmax(1)]
    torch.testing.assert_close(grad, expected)
