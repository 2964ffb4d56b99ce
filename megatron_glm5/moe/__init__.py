"""MoE pieces megatron-core 0.19.2 lacks without Transformer Engine (:mod:`.grouped_experts`)."""
