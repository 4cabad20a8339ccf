"""Megatron-LM's GPT-OSS launch script (examples/gptoss/02_train.sh) parses unchanged, each flag
with its Megatron-LM meaning. The other launch scripts and flags: tests/test_megatron_compat.py."""

from threefold.arguments import parse_args

# Megatron-LM's examples/gptoss/02_train.sh with its mock data, as written for 4 GPUs (one
# pipeline stage each; its default 8 do not divide its 12 layers, which Megatron-LM refuses
# too), the model's widths and the sample counts shrunk
GPT_OSS_EXAMPLE = """--no-masked-softmax-fusion --transformer-impl transformer_engine
--disable-bias-linear --untie-embeddings-and-output-weights --no-rope-fusion --normalization
RMSNorm --num-layers 12 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8
--group-query-attention --num-query-groups 2 --seq-length 8192 --max-position-embeddings 8192
--use-mcore-models --rotary-percent 1.0 --rope-type rope --position-embedding-type rope
--rotary-base 10000 --no-bias-gelu-fusion --export-force-local-attention
--no-bias-dropout-fusion --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable
--window-attn-skip-freq 2 --activation-func-clamp-value 7.0 --window-size 127,0
--enable-gpt-oss --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-3 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce --moe-ffn-hidden-size 128 --moe-router-dtype fp32
--moe-z-loss-coeff 1e-3 --moe-permute-fusion --mock-data --tokenizer-type NullTokenizer
--vocab-size 128256 --data-cache-path DIR --tiktoken-pattern v2 --split 99,1,0
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--micro-batch-size 1 --global-batch-size 128 --lr 1.0e-5 --train-samples 19531
--lr-decay-samples 19492 --lr-decay-style cosine --min-lr 1.0e-6 --weight-decay 0.1
--lr-warmup-fraction 0.05 --clip-grad 1.0 --bf16 --use-flash-attn --attention-softmax-in-fp32
--accumulate-allreduce-grads-in-fp32 --disable-bf16-reduced-precision-matmul
--recompute-activations --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--expert-model-parallel-size 1 --sequence-parallel --context-parallel-size 1
--use-distributed-optimizer --fp8-format hybrid --fp8-param-gather --fp8-amax-compute-algo max
--fp8-amax-history-len 1024 --log-interval 1 --save-interval 10000 --eval-interval 50000000
--eval-iters 0 --save DIR/ckpt --tensorboard-dir DIR/ckpt/tensorboard --moe-per-layer-logging
--no-load-optim --no-load-rng --log-throughput"""


def test_megatrons_gpt_oss_example_parses_with_its_meaning(tmp_path, capsys):
    """examples/gptoss/02_train.sh: GPT-OSS's attention and MLP, experts, FP8 with parameter
    gathering, the ModelOpt builder's flags (which Megatron-LM's pretrain_gpt.py uses only
    for a ModelOpt checkpoint) named at start-up, --no-load-optim without --load warned."""
    argv = GPT_OSS_EXAMPLE.replace("DIR", str(tmp_path)).split()
    config = parse_args(argv, world_size=4)
    model = config.model
    assert (model.quick_geglu, model.glu_linear_offset) == (True, 1.0)
    assert (model.activation_func_clamp_value, model.softmax_type) == (7.0, "learnable")
    assert (model.window_size, model.window_pattern(4)) == ("127,0", [1, 0, 1, 0])
    assert (model.num_experts, model.moe_router_dtype) == (4, "fp32")
    assert not model.add_bias_linear
    assert config.fp8.fp8_param_gather and config.kernels.disable_bf16_reduced_precision_matmul
    out = capsys.readouterr().out
    for flag in ("--enable-gpt-oss", "--export-force-local-attention"):
        assert f"> {flag} has no effect: " in out
    assert "WARNING: --no-load-optim has no effect without --load" in out
