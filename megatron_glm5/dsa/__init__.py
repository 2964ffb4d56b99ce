"""DSA (DeepSeek Sparse Attention) for GLM-5.x: the torch reference, layouts, the ``megatron`` backend's attention,
and indexer training (``indexer_parameters``: the indexer parameters of a model chunk, for an optimizer of its own)."""

from .indexer_training import freeze_all_but_indexers, indexer_parameters

__all__ = ["freeze_all_but_indexers", "indexer_parameters"]
