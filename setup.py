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
        # bridge/megatron_io.py writes torch_dist records with torch.distributed.checkpoint internals
        # (_StorageInfo, FileSystemWriter.write_data) and toggles torch.save's CRC-32 for its own records: pinned to
        # the releases tested here (2.14 in CI, 2.11 on the GPU machine).
        "torch>=2.11,<2.15",
        "megatron-core==0.19.2",
        # megatron-core imports triton and einops at module load without declaring them.
        "triton",
        "einops",
        "numpy",
        # glm_moe_dsa with interleaved MLA and indexer RoPE (transformers PRs #46372, #46842).
        "transformers>=5.13",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "tilelang": ["tilelang==0.1.15"],
        # peft: the oracle of the PEFT-adapter tests (the library reads and writes the format itself).
        # megatron-bridge==0.6.2, the oracle of the Megatron-layout tests, is installed --no-deps by scripts/setup.sh
        # (an extra cannot say --no-deps, and its declared dependencies are a GPU training stack).
        "dev": ["pytest>=8", "pytest-timeout", "peft"],
    },
    entry_points={"console_scripts": ["megatron-glm5=bridge.cli:main"]},
)
