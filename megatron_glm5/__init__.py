"""megatron-glm5: GLM-5.x (glm_moe_dsa: MLA + DSA + MoE + MTP) and GLM-5.3-Flash (glm5_next) on Megatron-Core.

Layering (one-way; ``tests/test_layering.py``): kernels <- dsa <- core <- families (``glm5/``, ``glm5_next/``) <-
model, pretrain, rl, LoRA. This package is the model and imports nothing from :mod:`bridge`; :mod:`bridge`
(HF <-> Megatron conversion) builds on it, and the application layer (the ``megatron-glm5`` command line, the demo,
:func:`bridge.from_hf_pretrained`) lives in :mod:`bridge`. ``megatron_glm5.from_hf_pretrained`` is kept as a
convenience alias that resolves to the bridge function on first use. Importing the package does nothing to
megatron-core or torch: heavy modules load on first use.
"""

from .version import __version__


def from_hf_pretrained(hf_path, **kwargs):
    """Alias of :func:`bridge.from_hf_pretrained` (a megatron-core ``GPTModel`` with an HF checkpoint's weights)."""
    from bridge.pretrained import from_hf_pretrained as _from_hf_pretrained  # the one, lazy, upward reference

    return _from_hf_pretrained(hf_path, **kwargs)


__all__ = ["__version__", "from_hf_pretrained"]
