"""The family-neutral core both model families build on (GLM-5.x in :mod:`megatron_glm5.glm5`, GLM-5.3-Flash in
:mod:`megatron_glm5.glm5_next`): runtime policy, HF config reading, layer patterns, pipeline stages, megatron-core
field tables, MLA spec helpers and the DSA decoder-layer base. It knows no family by name."""
