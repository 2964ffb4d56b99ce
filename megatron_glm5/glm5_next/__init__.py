"""GLM-5.3-Flash (HF ``glm5_next``): hybrid KDA / NoPE-MLA-DSA (KPool indexer) layers, mHC residual streams,
clamped-SwiGLU MoE. Importing the package loads nothing heavy and patches nothing.

* :mod:`.config`: raw ``config.json`` -> frozen :class:`~.config.GLM5NextArchitecture`.
* :mod:`.swiglu`: megatron-core settings for the clamped SwiGLU and a check for the paths that drop the clamp.
* :mod:`.mcore_config`: the architecture -> ``GLM5NextTransformerConfig`` (megatron-core ``MLATransformerConfig`` +
  KPool fields) for the NoPE DSA and MLP/MoE layers.
* :mod:`.attention`: NoPE DSA core attentions with the KPool indexer, for both backends.
* :mod:`.spec`: layer / block specs (NoPE DSA + dense MLP / MoE), IndexShare sources across non-DSA layers.
* The KPool indexer lives with the other DSA code: :mod:`megatron_glm5.dsa.kpool` (torch reference) and
  :mod:`megatron_glm5.dsa.kpool_indexer` (the megatron-core module and its selection over a token layout).

KDA layers and the mHC residual streams are not implemented yet.
"""

from .config import GLM5NextArchitecture, parse_glm5_next_config

__all__ = ["GLM5NextArchitecture", "parse_glm5_next_config"]
