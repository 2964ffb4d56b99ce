"""megatron-glm5: GLM-5.x (glm_moe_dsa) on Megatron-Core: block specs, DSA backends, HF <-> Megatron bridge."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="megatron-glm5",
    version="0.1.0",
    description="Train, convert and RL-fine-tune GLM-5.x (glm_moe_dsa, MLA + DSA) on Megatron-Core",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_glm5", "megatron_glm5.*", "bridge", "bridge.*"]),
    install_requires=[
        "torch",
        "megatron-core==0.19.2",
        # megatron-core imports triton at module load without declaring it.
        "triton",
        "einops",
        "numpy",
        # glm_moe_dsa with interleaved MLA and indexer RoPE (transformers PRs #46372, #46842).
        "transformers>=5.13",
        "safetensors",
        "huggingface-hub",
        "tqdm",
        "peft",
    ],
    extras_require={
        "tilelang": ["tilelang==0.1.15"],
        "dev": ["pytest>=8", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["megatron-glm5=megatron_glm5.cli:main"]},
)
