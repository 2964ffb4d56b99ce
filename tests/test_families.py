"""The family registry (:mod:`megatron_glm5.families`, :mod:`bridge.families`): every row provides the whole
interface, dispatch goes through it, and every combination a family does not support is refused by name before
anything is built."""

from __future__ import annotations

import inspect

import pytest

from megatron_glm5 import families
from megatron_glm5.core.layer import DSADecoderLayer
from megatron_glm5.families import FAMILIES, UnsupportedFeatureError, family_of_architecture, parse_architecture
from megatron_glm5.glm5_next.testing import tiny_flash_config
from megatron_glm5.model import build_model, default_cpu_policy
from megatron_glm5.testing import tiny_glm52_config


def _flash_arch():
    return parse_architecture({"model_type": "glm5_next", **tiny_flash_config()["text_config"]})


def _interface(protocol) -> list[str]:
    return list(protocol.__annotations__) + [n for n, _ in inspect.getmembers(protocol, inspect.isfunction)]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_provides_the_whole_interface(family):
    for part, protocol in ((family.entry, families.FamilyEntry), (family.build, families.FamilyBuild)):
        missing = [n for n in _interface(protocol) if not hasattr(part, n)]
        assert not missing, f"{family.name}: {part.__name__} lacks {missing}"
    assert issubclass(family.decoder_layer(), DSADecoderLayer)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_has_a_bridge_row_and_a_parity_reference(family):
    from bridge.families import BRIDGE_FAMILIES
    from bridge.parity_reference import REFERENCES

    assert family.name in BRIDGE_FAMILIES and family.name in REFERENCES


def test_dispatch_by_model_type():
    assert family_of_architecture(parse_architecture(tiny_glm52_config())).name == "glm5"
    assert family_of_architecture(_flash_arch()).name == "glm5_next"
    with pytest.raises(ValueError, match=r"'model_type': expected one of \['glm_moe_dsa', 'glm5_next'"):
        parse_architecture({"model_type": "llama"})


def test_glm5_supports_everything_the_registry_names():
    glm5 = families.family_named("glm5")
    for feature in ("context parallelism", "virtual pipeline parallelism", "the indexer loss", "the indexer warm-up"):
        glm5.refuse(feature)  # no error


@pytest.mark.parametrize(
    "policy, build, feature",
    [
        (dict(context_parallel_size=2), {}, "context parallelism"),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {},
         "virtual pipeline parallelism"),
        (dict(dsa_indexer_loss_coeff=1.0), {}, "the indexer loss"),
        (dict(dsa_indexer_warmup=True), {}, "the indexer warm-up"),
        ({}, dict(indexer_warmup=True), "the indexer warm-up"),
    ],
    ids=["context-parallel", "virtual-pipeline", "indexer-loss", "warmup-policy", "warmup-argument"],
)
def test_flash_refuses_unsupported_combinations_by_name(model_parallel, policy, build, feature):
    with pytest.raises(UnsupportedFeatureError, match=rf"GLM-5.3-Flash does not support {feature} yet: "):
        build_model(_flash_arch(), default_cpu_policy(**policy), **build)


def test_family_build_options_are_the_familys_own(model_parallel):
    with pytest.raises(TypeError, match="kda_kernel"):
        build_model(parse_architecture(tiny_glm52_config()), default_cpu_policy(), kda_kernel="torch")


@pytest.mark.parametrize("family", ["glm5", "glm5_next"])
def test_lora_adapts_both_families(model_parallel, family):
    """LoRA goes through the same builder and layer base for both families: every adapter gets a gradient."""
    import torch

    from megatron_glm5.lora import LoraConfig, add_lora, lora_modules

    arch = parse_architecture(tiny_glm52_config()) if family == "glm5" else _flash_arch()
    torch.manual_seed(0)
    model = build_model(arch, default_cpu_policy())
    add_lora(model, LoraConfig(4, 8))
    assert lora_modules(model)
    ids = torch.randint(0, arch.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(32)[None], None, labels=ids).sum().backward()
    lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert all(p.grad is not None for p in lora.values())
    assert all(p.requires_grad == (n in lora) for n, p in model.named_parameters())
    assert any(p.grad.abs().sum() > 0 for n, p in lora.items() if ".lora_B." in n)


def test_registry_lookups_import_no_megatron_core():
    """The command line checks a layout against config.json before megatron-core is imported: parsing a config and
    finding its family (and its bridge row) must stay that cheap."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from megatron_glm5.families import family_of_architecture, parse_architecture\n"
        "from megatron_glm5.testing import tiny_glm52_config\n"
        "from megatron_glm5.glm5_next.testing import tiny_flash_config\n"
        "from bridge.families import bridge_family\n"
        "for raw in (tiny_glm52_config(), {'model_type': 'glm5_next', **tiny_flash_config()['text_config']}):\n"
        "    arch = parse_architecture(raw)\n"
        "    bridge_family(arch).check_layout(arch, 1, 1, 1, source='x')\n"
        "    print(family_of_architecture(arch).name)\n"
        "print('megatron.core imported:', 'megatron.core' in sys.modules)\n"
    )
    repo = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(repo)}).stdout
    assert out.split() == ["glm5", "glm5_next", "megatron.core", "imported:", "False"]
