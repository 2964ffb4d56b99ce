"""megatron-glm5: GLM-5.x (glm_moe_dsa: MLA + DSA + MoE + MTP) on Megatron-Core.

Importing the package does nothing to megatron-core or torch: heavy modules load on first use.
"""

__version__ = "0.1.0"


def from_hf_pretrained(hf_path, **kwargs):
    """Build a megatron-core ``GPTModel`` from a GLM-5.x HF checkpoint and load its weights.
    See :func:`megatron_glm5.pretrained.from_hf_pretrained`."""
    from .pretrained import from_hf_pretrained as _from_hf_pretrained

    return _from_hf_pretrained(hf_path, **kwargs)


__all__ = ["__version__", "from_hf_pretrained"]
