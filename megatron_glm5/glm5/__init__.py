"""GLM-5.x (HF ``glm_moe_dsa``: GLM-5 / 5.1 / 5.2): MLA + DSA (per-token indexer, IndexShare) + MoE + MTP, as one
family on the core (:mod:`megatron_glm5.core`). Importing the package loads nothing heavy.

* :mod:`.config`: raw ``config.json`` -> frozen :class:`~.config.GLM5Architecture`.
* :mod:`.mcore_config`: the architecture -> megatron-core ``MLATransformerConfig`` kwargs, ``GPTModel`` kwargs.
* :mod:`.layer`: the decoder layer (the core's DSA decoder layer with a pre-norm residual).
* :mod:`.spec`: attention backends, layer / block / MTP specs, the ``--spec`` entry points.
* :mod:`.family` / :mod:`.build`: what the registry (:mod:`megatron_glm5.families`) reaches through (the config
  parser; the model side, imported on first use).
"""

from .config import GLM5Architecture, parse_hf_config

__all__ = ["GLM5Architecture", "parse_hf_config"]
