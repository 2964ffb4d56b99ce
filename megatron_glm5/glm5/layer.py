"""GLM-5.x decoder layer: the core's DSA decoder layer (:class:`~megatron_glm5.core.layer.DSADecoderLayer`: top-k
through the layer ``context``, recompute replay, activation-offload window) with a pre-norm residual and a dense or
MoE MLP; every GLM-5.x layer is a DSA layer."""

from __future__ import annotations

from ..core.layer import DSADecoderLayer


class GLMTransformerLayer(DSADecoderLayer):
    """One GLM-5.x decoder (or MTP) layer; its attention must be a GLM DSA attention (either backend)."""

    family_title = "GLM-5.x"
    build_hint = "megatron_glm5.spec.get_glm5_spec"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.is_dsa:
            raise TypeError(f"GLMTransformerLayer needs a GLM DSA attention, got {type(self.self_attention).__name__}")
