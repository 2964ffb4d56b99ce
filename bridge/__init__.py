"""HF <-> Megatron checkpoint conversion for GLM-5.x."""
