"""RL support for GLM-5.x and GLM-5.3-Flash on megatron-core: log-probabilities of packed rollouts, rollout-engine
replay of the DSA indexer top-k and of MoE routing (R3), and a slime/miles-shaped model provider.

Importing this package imports megatron-core (it is the model side); nothing is patched or installed at import.

* :func:`compute_logprobs`, :func:`logprobs_forward_step`, :class:`RolloutMicroBatch`, :class:`LogProbs`
  (:mod:`megatron_glm5.rl.logprobs`)
* :class:`ReplayStats`, :class:`ReplayHooks`, :class:`ReplayLayerError` (:mod:`megatron_glm5.rl.replay`; GLM-5.x and
  GLM-5.3-Flash alike, through :mod:`megatron_glm5.inventory`); payload formats and checks in
  :mod:`megatron_glm5.rl.payload`
* :func:`vocab_parallel_logprobs` (:mod:`megatron_glm5.rl.vocab_parallel`)
* :func:`model_provider`, :func:`add_rl_args` (:mod:`megatron_glm5.rl.provider`, imported on first use)
"""

from .logprobs import LogProbs, RolloutMicroBatch, compute_logprobs, logprobs_forward_step
from .payload import ReplayPayloadError
from .replay import ReplayHooks, ReplayLayerError, ReplayOverlapWarning, ReplayStats, topk_overlap
from .vocab_parallel import vocab_parallel_logprobs

__all__ = [
    "LogProbs",
    "ReplayHooks",
    "ReplayLayerError",
    "ReplayOverlapWarning",
    "ReplayPayloadError",
    "ReplayStats",
    "RolloutMicroBatch",
    "add_rl_args",
    "compute_logprobs",
    "logprobs_forward_step",
    "model_provider",
    "topk_overlap",
    "vocab_parallel_logprobs",
]


def __getattr__(name):
    if name in ("model_provider", "add_rl_args"):
        from . import provider

        return getattr(provider, name)
    raise AttributeError(f"module 'megatron_glm5.rl' has no attribute {name!r}")
