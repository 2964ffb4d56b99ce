"""GLM-5.3-Flash (HF ``glm5_next``): hybrid KDA / NoPE-MLA-DSA (KPool indexer) layers, mHC residual streams,
clamped-SwiGLU MoE. Importing the package loads nothing heavy and patches nothing.

* :mod:`.config`: raw ``config.json`` -> frozen :class:`~.config.GLM5NextArchitecture`.
* :mod:`.swiglu`: megatron-core settings for the clamped SwiGLU and a check for the paths that drop the clamp.
* :mod:`.mcore_config`: the architecture -> ``GLM5NextTransformerConfig`` (megatron-core ``MLATransformerConfig`` +
  KPool, KDA and mHC fields).
* :mod:`.attention`: NoPE DSA core attentions with the KPool indexer, for both backends.
* :mod:`.kda_reference` / :mod:`.kda`: KDA linear attention (torch reference; megatron-core module with TP-sharded
  heads, flash-linear-attention's kernel when installed).
* :mod:`.mhc`: the mHC residual streams (hyper-connection coefficients, Sinkhorn, stream-mean final norm).
* :mod:`.layer` / :mod:`.spec`: the decoder layer (KDA or DSA mixer, dense or MoE MLP, plain or mHC residual), layer /
  block / MTP specs, IndexShare sources across KDA layers.
* :mod:`.family` / :mod:`.build`: what the registry (:mod:`megatron_glm5.families`) reaches through, so
  :func:`megatron_glm5.model.build_model` builds this family too; :mod:`.testing`: tiny checkpoints written by
  transformers.
* The KPool indexer lives with the other DSA code: :mod:`megatron_glm5.dsa.kpool` (torch reference) and
  :mod:`megatron_glm5.dsa.kpool_indexer` (the megatron-core module and its selection over a token layout).

Pipeline parallelism: the stages exchange the mHC streams (``[s, b, hc_mult * hidden]``, the config's
``pipeline_hidden_size``; megatron-core's 1F1B schedule is told that width by
:func:`megatron_glm5.compat.send_pipeline_hidden_size`), and each stage's first DSA layer must be full (a stage may
start on a KDA layer before one).
Not yet: virtual pipeline stages, context parallelism and the KPool indexer's loss (refused by name,
``Family.unsupported``), an inference cache.
"""

from .config import GLM5NextArchitecture, parse_glm5_next_config

__all__ = ["GLM5NextArchitecture", "parse_glm5_next_config"]
