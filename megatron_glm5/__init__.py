"""megatron-glm5: GLM-5.x (glm_moe_dsa: MLA + DSA + MoE + MTP) on Megatron-Core."""

__version__ = "0.1.0"
