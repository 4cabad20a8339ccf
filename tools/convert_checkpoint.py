"""Convert checkpoints between Hugging Face (safetensors), threefold and Megatron-LM (torch_dist).

    python tools/convert_checkpoint.py --loader hf --saver threefold \\
        --load-dir path/to/hf_model --save-dir checkpoints/converted
    python tools/convert_checkpoint.py --loader threefold --saver hf \\
        --load-dir checkpoints/finetuned --save-dir exported_hf_model
    python tools/convert_checkpoint.py --loader megatron --saver threefold \\
        --load-dir megatron_run/checkpoints --save-dir checkpoints/from_megatron
    python tools/convert_checkpoint.py --loader threefold --saver megatron \\
        --load-dir checkpoints/run --save-dir megatron_checkpoints
    python tools/convert_checkpoint.py --loader threefold --saver peft \\
        --load-dir checkpoints/lora_finetuned --save-dir my_adapter --base-model path/to/hf_model

HF side: config.json plus model.safetensors or a sharded model.safetensors.index.json, and the
tokenizer files, which travel along (into the threefold checkpoint's tokenizer/ directory and
back). threefold side: a weights-only checkpoint at TP = PP = 1 (train or fine-tune from it with
--finetune; it loads into any layout); exports read threefold checkpoints of any layout.
Supported: Llama 2/3 (and SmolLM-style tied embeddings), Mistral, Qwen2, Qwen3, GPT-2,
Mixtral, Qwen3-MoE, DeepSeek-V3, Qwen3-Next, GPT-OSS (its MXFP4 experts read); see
threefold/checkpoint/hf/.

Megatron side: megatron-core's torch_dist directory (tracker, iter_N/ with common.pt,
metadata.json and the .distcp shards) of a GPT/LLaMA model, dense or a mixture of experts, saved
at any TP/PP/EP layout, local or Transformer Engine layer names; written at TP = PP = 1
(Megatron-LM loads it into any layout),
with Adam's state where the threefold checkpoint has it, shaped for the Megatron-LM run that goes
on from it: its distributed optimizer or its non-distributed one as the saving run stepped (or
--[no-]target-use-distributed-optimizer says), a mixture of experts' for the saving run's expert
layout (or the one --target-expert-parallel-size, --target-tensor-parallel-size and
--target-expert-tensor-parallel-size give); else the model only (threefold/checkpoint/megatron/,
docs/checkpoints.md). A threefold run can also --load a Megatron checkpoint directly.

PEFT side (--saver peft): a LoRA fine-tune's adapters, unmerged, as a PEFT adapter directory
(adapter_config.json, adapter_model.safetensors) over its Hugging Face base model, for the dense
LLaMA family (LLaMA, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3); --saver hf writes the model merged.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from threefold.arguments import ToolParser  # noqa: E402
from threefold.config import ConfigError  # noqa: E402
from threefold.inference_flags import add_strictness_flag  # noqa: E402
from threefold.output_directory import make_parent_directory  # noqa: E402
from threefold.startup import frozen_imports  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(
        prog="convert_checkpoint.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    formats = ["hf", "threefold", "megatron"]
    parser.add_argument("--loader", required=True, choices=formats, help="the format read")
    parser.add_argument(
        "--saver", required=True, choices=[*formats, "peft"], help="the format written"
    )
    parser.add_argument(
        "--load-dir",
        required=True,
        help="a Hugging Face model directory, a threefold --save, or a Megatron-LM torch_dist "
        "--save",
    )
    parser.add_argument("--save-dir", required=True, help="where the converted model goes")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of exported HF or Megatron weights (default: what was imported, or what "
        "the run trained in; float32 otherwise)",
    )
    parser.add_argument(
        "--hf-architecture",
        help="with --saver hf or peft: the Hugging Face architecture written (default: the one "
        "the checkpoint was converted from, else the one its model matches)",
    )
    parser.add_argument(
        "--base-model",
        help="with --saver peft: the base model's Hub name or path, which the adapter records",
    )
    layout = (
        "of the Megatron-LM run that goes on from a mixture of experts' optimizer state (at EP "
        "> 1, or an expert TP other than TP, it steps the experts with an optimizer of their "
        "own, and its --load takes only the state shaped so; default: the saving run's layout "
        "where none of these is given, else Megatron-LM's defaults for the others)"
    )
    parser.add_argument(
        "--target-expert-parallel-size",
        type=int,
        help=f"with --saver megatron: the expert parallelism {layout}",
    )
    parser.add_argument(
        "--target-tensor-parallel-size", type=int, help=f"with --saver megatron: the TP {layout}"
    )
    parser.add_argument(
        "--target-expert-tensor-parallel-size",
        type=int,
        help=f"with --saver megatron: the experts' TP {layout}",
    )
    parser.add_argument(
        "--target-use-distributed-optimizer",
        action=argparse.BooleanOptionalAction,
        help="with --saver megatron: whether the Megatron-LM run that goes on from the optimizer "
        "state steps with its distributed optimizer (--use-distributed-optimizer); its --load "
        "takes only the state its own optimizer saves (default: as the saving run stepped, "
        "FSDP2's shards as the distributed optimizer's)",
    )
    add_strictness_flag(parser)
    args = parser.parse_args(argv)
    # The flags first, before torch is imported: --help or a mistyped flag costs a second.
    if args.loader == args.saver:
        parser.error(f"--loader and --saver are both {args.loader}; nothing to convert")
    if args.saver == "peft" and args.loader != "threefold":
        parser.error("--saver peft writes the adapters of a threefold LoRA run: --loader threefold")
    if args.hf_architecture and args.saver not in ("hf", "peft"):
        parser.error(f"--hf-architecture names what --saver hf or peft writes, not {args.saver}")
    if args.base_model and args.saver != "peft":
        parser.error("--base-model is the base of a PEFT adapter: it goes with --saver peft")
    sizes = {
        "--target-expert-parallel-size": args.target_expert_parallel_size,
        "--target-tensor-parallel-size": args.target_tensor_parallel_size,
        "--target-expert-tensor-parallel-size": args.target_expert_tensor_parallel_size,
    }
    shaping = {
        **sizes,
        "--[no-]target-use-distributed-optimizer": args.target_use_distributed_optimizer,
    }
    for flag, value in shaping.items():
        if value is not None and (args.saver, args.loader) != ("megatron", "threefold"):
            parser.error(
                f"{flag} shapes the optimizer state a threefold checkpoint exports to "
                "Megatron-LM: it goes with --loader threefold --saver megatron"
            )
    for flag, size in sizes.items():
        if size is not None and size < 1:
            parser.error(f"{flag} must be at least 1, not {size}")
    try:
        make_parent_directory(args.save_dir, "--save-dir")
    except ConfigError as error:
        parser.error(str(error))
    with frozen_imports():
        from threefold.checkpoint import convert

    strictness = args.dist_ckpt_strictness
    try:
        if (args.loader, args.saver) == ("hf", "threefold"):
            path = convert.hf_to_threefold_checkpoint(args.load_dir, args.save_dir)
        elif args.saver == "hf":
            path = convert.to_hf_checkpoint(
                args.load_dir,
                args.save_dir,
                args.dtype,
                args.loader,
                strictness,
                args.hf_architecture,
            )
        elif args.saver == "peft":
            path = convert.to_peft_adapter(
                args.load_dir,
                args.save_dir,
                args.dtype,
                strictness,
                args.hf_architecture,
                args.base_model,
            )
        elif args.saver == "megatron":
            target = convert.TargetRun(
                args.target_use_distributed_optimizer,
                args.target_expert_parallel_size,
                args.target_tensor_parallel_size,
                args.target_expert_tensor_parallel_size,
            )
            path = convert.to_megatron_checkpoint(
                args.load_dir, args.save_dir, args.dtype, args.loader, strictness, target
            )
        else:
            path = convert.megatron_to_threefold_checkpoint(
                args.load_dir, args.save_dir, strictness
            )
    except ConfigError as error:  # the loading code names pretrain_gpt.py's --load
        parser.error(re.sub(r"^--load ", "--load-dir ", str(error)))
    print(f"converted {args.load_dir} ({args.loader}) -> {path} ({args.saver})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
