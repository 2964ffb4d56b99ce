"""GLM-5.3-Flash (HF ``glm5_next``): hybrid KDA / NoPE-MLA-DSA (KPool indexer) layers, mHC residual streams,
clamped-SwiGLU MoE. Importing the package loads nothing heavy and patches nothing.

* :mod:`.config`: raw ``config.json`` -> frozen :class:`~.config.GLM5NextArchitecture`.
* :mod:`.swiglu`: megatron-core settings for the clamped SwiGLU and a check for the paths that drop the clamp.
* The KPool indexer reference lives with the other DSA references: :mod:`megatron_glm5.dsa.kpool`.
"""

from .config import GLM5NextArchitecture, parse_glm5_next_config

__all__ = ["GLM5NextArchitecture", "parse_glm5_next_config"]
