"""HF <-> Megatron checkpoint bridge for GLM-5.x (``glm_moe_dsa``) and GLM-5.3-Flash (``glm5_next``; the table and
conventions of each family are chosen in :mod:`bridge.tables`).

Streaming checkpoint conversion (bounded memory, any TP/PP/EP)::

    from bridge import convert_hf_to_megatron, convert_megatron_to_hf, roundtrip, verify
    convert_hf_to_megatron(hf_path="GLM-5.2", megatron_path="glm52_mcore", tp=1, pp=1, ep=1)
    convert_megatron_to_hf(megatron_path="glm52_mcore", hf_path="GLM-5.2-export")

In memory, with a built megatron-core model (this rank's shards)::

    load_hf_weights(model, "GLM-5.2")          # what megatron_glm5.from_hf_pretrained uses
    export_hf(model, "GLM-5.2-trained")        # gathers over TP/PP/EP through a temporary torch_dist checkpoint

LoRA adapters (:mod:`megatron_glm5.lora`) in HF PEFT format (:mod:`bridge.adapters`; the export goes through an
adapter checkpoint, :mod:`bridge.lora_convert`)::

    export_peft_adapter(model, "adapter")       # adapter_config.json + adapter_model.safetensors, from every rank
    load_peft_adapter(model, "adapter")         # adds the adapters if the model has none
    export_hf(model, "merged", merge_lora=True) # base + LoRA merged into the HF weights

Application layer (it uses both this package and :mod:`megatron_glm5`, which never imports this one):
:func:`from_hf_pretrained`, the ``megatron-glm5`` command line (:mod:`bridge.cli`) and its demo (:mod:`bridge.demo`).

All drivers share one mapping table (:mod:`bridge.mapping`); a second one (:mod:`bridge.megatron_layout`) names the
Megatron checkpoints other tools write (Transformer Engine layouts: NVIDIA Megatron-Bridge, slime, miles), detected on
reading and chosen on writing. Importing this package imports nothing heavy.
"""

from .errors import BridgeError

__all__ = [
    "BridgeError",
    "compare_hf_checkpoints",
    "convert_hf_to_megatron",
    "convert_megatron_to_hf",
    "export_hf",
    "export_peft_adapter",
    "from_hf_pretrained",
    "load_hf_weights",
    "load_megatron_checkpoint",
    "load_peft_adapter",
    "roundtrip",
    "verify",
]


def __getattr__(name):
    if name in ("convert_hf_to_megatron", "convert_megatron_to_hf", "roundtrip", "compare_hf_checkpoints"):
        from . import convert

        return getattr(convert, name)
    if name in ("export_hf", "load_hf_weights", "load_megatron_checkpoint"):
        from . import inmemory

        return getattr(inmemory, name)
    if name == "export_peft_adapter":
        from .lora_convert import export_peft_adapter

        return export_peft_adapter
    if name == "load_peft_adapter":
        from .adapters import load_peft_adapter

        return load_peft_adapter
    if name == "from_hf_pretrained":
        from .pretrained import from_hf_pretrained

        return from_hf_pretrained
    if name == "verify":
        from .parity import verify

        return verify
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")
