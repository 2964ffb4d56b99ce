"""mHC (manifold-constrained hyper-connections): GLM-5.3-Flash's ``hc_mult`` residual streams.

Between decoder layers a token is ``N = hc_mult`` streams of width ``h``, carried as one ``[s, b, N * h]`` tensor
(stream-major: ``[stream 0 | stream 1 | ...]``, transformers' ``[B, S, N, D]`` flattened), so megatron-core's
TransformerBlock, activation recompute and sequence parallelism (which shards ``s``) carry them unchanged. Around
each sublayer (attention, MLP) of a layer (transformers ``Glm5NextTextHyperConnection``, all coefficient math fp32):

* ``xhat = vec(X) * rsqrt(mean(vec(X)^2) + rms_norm_eps)`` (no weight), ``m = fn @ xhat`` (``fn [(2 + N) N, N h]``);
* ``pre = sigmoid(scale_0 m[:N] + base[:N]) + hc_eps``, ``post = 2 sigmoid(scale_1 m[N:2N] + base[N:2N])``,
  ``C = softmax_row(scale_2 m[2N:] + base[2N:]) + hc_eps`` then Sinkhorn: columns, then ``iters - 1`` times rows and
  columns, every denominator ``+ hc_eps``;
* the sublayer sees ``u = sum_i pre_i X_i`` (cast to the model dtype) through its usual pre-norm, and its output
  ``y`` comes back as ``X'_i = post_i y + sum_j C[j, i] X_j`` (``post`` and ``C`` cast to the model dtype first).

The model enters the streams by copying the embedding into all ``N`` (:func:`expand_streams`, the first decoder layer)
and leaves them through :class:`StreamMeanNorm`, the block's final norm: the plain mean over streams, then RMSNorm.

Parallelism: every coefficient is per token, so under sequence parallelism each rank works on its own tokens; the
``fn`` / ``base`` / ``scale`` gradients are then partial per rank and are summed over TP through their
``sequence_parallel`` tag, like the norms'. ``base`` and ``scale`` are fp32 parameters (transformers keeps them fp32),
``fn`` is in the model dtype and used in fp32.

Kernels (``MEGATRON_GLM5_MHC_KERNEL``): by default (``auto``) the two stream mixes (``u`` and the merge) run on CUDA
as one Triton kernel each way (:mod:`megatron_glm5.kernels.stream_mix`: fp32 math, one rounding; the torch merge
rounds its three terms to the model dtype separately, so the two differ by an ulp or two). ``fused`` also computes
``pre`` / ``post`` / ``comb`` from the projection in one kernel each way
(:mod:`megatron_glm5.kernels.mhc_coefficients`, fp32; experimental until a whole step has been timed with it).
``torch`` keeps the torch expressions everywhere (they are what CPU runs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megatron_glm5.kernels.mhc_coefficients import (mhc_coefficients, mhc_coefficients_reference,
                                                    mhc_coefficients_supported)
from megatron_glm5.kernels.stream_mix import stream_mix, stream_mix_supported
from megatron_glm5.providers import TorchNorm

MHC_KERNEL_ENV = "MEGATRON_GLM5_MHC_KERNEL"
MHC_KERNEL_CHOICES = ("auto", "fused", "torch")  # module docstring


def _kernel_choice() -> str:
    choice = os.environ.get(MHC_KERNEL_ENV, "auto")
    if choice not in MHC_KERNEL_CHOICES:
        raise ValueError(f"{MHC_KERNEL_ENV}={choice!r}: expected one of {MHC_KERNEL_CHOICES}")
    return choice


def _use_kernel(streams: torch.Tensor) -> bool:
    return _kernel_choice() != "torch" and stream_mix_supported(streams)


def expand_streams(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[s, b, h]`` -> ``[s, b, n * h]``: the embedding copied into every stream."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).reshape(*x.shape[:-1], n * x.shape[-1])


class HyperConnection(MegatronModule):
    """One sublayer's mHC coefficients (module docstring). ``forward(streams) -> (post, comb, u)``;
    :meth:`merge` puts the sublayer output back into the streams."""

    def __init__(self, config):
        super().__init__(config=config)
        n, h = config.hc_mult, config.hidden_size
        if n < 1:
            raise ValueError(f"HyperConnection needs hc_mult >= 1, found {n}")
        self.n, self.hidden = n, h
        self.eps, self.norm_eps, self.iters = config.hc_eps, config.layernorm_epsilon, config.hc_sinkhorn_iters
        device = None if config.init_model_with_meta_device else (
            "cpu" if config.use_cpu_initialization else torch.cuda.current_device())
        rows = (2 + n) * n
        self.fn = torch.nn.Parameter(torch.empty(rows, n * h, dtype=config.params_dtype, device=device))
        self.base = torch.nn.Parameter(torch.empty(rows, dtype=torch.float32, device=device))
        self.scale = torch.nn.Parameter(torch.empty(3, dtype=torch.float32, device=device))
        for p in (self.fn, self.base, self.scale):
            p.sequence_parallel = config.sequence_parallel
        if config.perform_initialization and not self.fn.is_meta:
            with torch.no_grad():  # transformers' initialisation
                self.fn.normal_(0.0, 0.02)
                self.base.zero_()
                self.scale.fill_(1.0)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [.., N h]`` -> ``post [.., N]`` fp32, ``comb [.., N, N]`` fp32 (``comb[j, i]``: stream ``j``
        into stream ``i``), the sublayer input ``u [.., h]`` in the streams' dtype."""
        n = self.n
        x = streams.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        m = F.linear(x, self.fn.float())
        fused = _kernel_choice() == "fused" and mhc_coefficients_supported(m)
        coefficients = mhc_coefficients if fused else mhc_coefficients_reference
        pre, post, comb = coefficients(m, self.base, self.scale, n, self.iters, self.eps)
        if _use_kernel(streams):
            u = stream_mix(streams, pre.unsqueeze(-2))
        else:
            u = (pre.unsqueeze(-1) * streams.unflatten(-1, (n, self.hidden))).sum(-2).to(streams.dtype)
        return post, comb, u

    def merge(self, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``X'_i = post_i y + sum_j comb[j, i] X_j``: ``y [.., h]``, ``streams [.., N h]`` -> ``[.., N h]``."""
        dtype = streams.dtype
        if _use_kernel(streams):
            return stream_mix(streams, comb.to(dtype).transpose(-1, -2), post.to(dtype), y)
        x = streams.unflatten(-1, (self.n, self.hidden))
        mixed = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
        return mixed.flatten(-2)


class StreamMeanNorm(TorchNorm):
    """The block's final norm under mHC: mean over the ``hc_mult`` streams (in the streams' dtype, as transformers'
    ``Glm5NextTextHyperHead``), then the weighted RMSNorm. Parameter ``weight [h]``, like the plain final norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kw):
        super().__init__(config, hidden_size, eps)
        self.n = config.hc_mult

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.unflatten(-1, (self.n, -1)).mean(-2))
