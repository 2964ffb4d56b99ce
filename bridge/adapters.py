"""LoRA adapters between megatron-core and HF PEFT: the table and formats, :func:`load_peft_adapter`, and the
adapter-only checkpoint :func:`write_adapter_checkpoint` that :func:`bridge.lora_convert.export_peft_adapter` (also
``bridge.export_peft_adapter``) converts to a PEFT directory.

An adapter set is ``{logical megatron module: Adapter(A [R, in], B [out, R], alpha)}`` with *global* tensors and
the logical names of :mod:`bridge.mapping` (``decoder.layers.1.mlp.experts.local_experts.5.linear_fc1``). The HF
side is read from the same table, so names and shapes come from one place.

HF PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``, keys ``base_model.model.<HF module>.lora_A
.weight``) as peft 0.21.2 writes it for transformers 5's ``GlmMoeDsaForCausalLM``:

* attention and indexer linears: one ``lora_A [R, in]`` / ``lora_B [out, R]`` per HF module, listed in
  ``target_modules``;
* routed experts: transformers stores them fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
  and peft puts one ``ParamWrapper`` per targeted 3-D parameter, listed in ``target_parameters``: ``lora_A
  [R*E, in]`` with expert-major rows (``A[e*R:(e+1)*R]`` is expert ``e``'s) and ``lora_B [out, R*E]`` with
  expert-minor columns (``B.reshape(out, R, E)[..., e]``). With both parameters targeted the wrappers nest, the
  inner one (``gate_up_proj``, registered first by transformers) under ``mlp.experts.base_layer.lora_*``, the outer
  (``down_proj``) under ``mlp.experts.lora_*``; with one, it is ``mlp.experts.lora_*``. megatron's ``linear_fc1``
  adapter (rank ``2r``) is exactly peft's ``gate_up_proj`` adapter, declared with ``rank_pattern`` /
  ``alpha_pattern`` ``{".*\\.gate_up_proj": 2r / 2*alpha}`` as peft writes it for ``gate_proj`` + ``up_proj``.
* **dense MLP and shared experts cannot be represented**: peft 0.21 + transformers 5 rewrite any ``gate_proj`` /
  ``up_proj`` / ``down_proj`` target to the routed experts' fused parameters and drop such tensors without a word
  (``notes/lora_research.md`` §2.2). Export refuses them, naming the modules and the two ways out: merge the
  adapter into the weights (``export_hf(..., merge_lora=True)``, ``megatron-glm5 lora merge``) or train without
  them (``exclude_modules=("dense_mlp", "shared_experts")``).
* MTP layers: exported at ``model.layers.{N+k}`` like the base checkpoint's MTP weights. transformers builds no MTP
  layer, so peft ignores these keys, as transformers ignores the MTP weights; inference engines with MTP read them.

Import also accepts the per-module layout of transformers-4-era PEFT files and serving engines
(``mlp.experts.{e}.gate_proj``, ``mlp.gate_proj``, ``mlp.shared_experts.up_proj``, ...): a ``gate_proj`` / ``up_proj``
pair of rank ``r`` becomes one ``linear_fc1`` adapter of rank ``2r`` (``A = [A_g; A_u]``, ``B = blockdiag(B_g,
B_u)``, peft's own conversion rule).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from megatron_glm5.config import GLM5Architecture, load_hf_config, natural_key, parse_hf_config
from megatron_glm5.lora import LoraConfig, MEGATRON_TARGETS, scope_of

from .errors import BridgeError, CheckpointFormatError, ShapeMismatchError, TensorSetError
from .mapping import TensorMap, expand

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
GATE_UP_PATTERN = r".*\.gate_up_proj"


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapted linear, global tensors: ``W' = W + alpha / rank * B @ A``."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    alpha: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def delta(self) -> torch.Tensor:
        """fp32 ``alpha / rank * B @ A``."""
        return self.scaling * (self.b.float() @ self.a.float())


AdapterSet = dict[str, Adapter]


# --------------------------------------------------------------------------------------------------------------------
# The table: logical adapter modules <-> HF tensors
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdapterTable:
    """Every module of ``arch`` that can carry an adapter: its row of the mapping table (HF names in the
    per-expert layout), and its fused-experts row (``mlp.experts.gate_up_proj`` row ``e``) for routed experts."""

    arch: GLM5Architecture
    rows: Mapping[str, TensorMap]  # logical module -> per-expert-layout row
    fused: Mapping[str, TensorMap]  # logical module of a routed expert -> fused-layout row
    by_hf: Mapping[str, tuple[str, int]]  # HF module (no ".weight") -> (logical module, part index)

    def shape(self, module: str) -> tuple[int, int]:
        """(out, in) of the megatron weight."""
        out, inp = self.rows[module].mcore_shape
        return out, inp

    def group(self, module: str) -> str:
        return scope_of(module)[1]


def adapter_table(arch: GLM5Architecture) -> AdapterTable:
    def modules(layout):
        out = {}
        for m in expand(arch, expert_layout=layout).maps:
            if not m.mcore.endswith(".weight"):
                continue
            module = m.mcore[: -len(".weight")]
            if scope_of(module) is not None:
                out[module] = m
        return out

    rows, fused = modules("per_expert"), modules("fused")
    fused = {k: v for k, v in fused.items() if ".local_experts." in k}
    by_hf = {}
    for module, m in rows.items():
        for i, ref in enumerate(m.hf):
            by_hf[ref.name[: -len(".weight")]] = (module, i)
    return AdapterTable(arch, rows, fused, by_hf)


def _hf_layer(name: str) -> int | None:
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m[1]) if m else None


# --------------------------------------------------------------------------------------------------------------------
# Adapter set -> PEFT
# --------------------------------------------------------------------------------------------------------------------


def _pattern_match(patterns: Mapping[str, Any], key: str):
    """peft's ``get_pattern_key`` rule: the first pattern ``p`` with ``re.match(rf"(.*\\.)?({p})$", key)``."""
    for p, v in patterns.items():
        if re.match(rf"(.*\.)?({p})$", key):
            return v
    return None


def to_peft(adapters: AdapterSet, table: AdapterTable, *, r: int, alpha: float, dropout: float = 0.0,
            base_model: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """PEFT tensors and ``adapter_config.json`` for ``adapters`` (see the module docstring). ``r`` / ``alpha``: the
    config's base values; adapters that differ (fc1's ``2r``) get ``rank_pattern`` / ``alpha_pattern`` entries."""
    unknown = sorted(set(adapters) - set(table.rows), key=natural_key)
    if unknown:
        raise TensorSetError(f"adapters for modules the model does not have: {unknown[:8]}", unexpected=unknown)
    unrepresentable = sorted((m for m in adapters if table.group(m) in ("dense_mlp", "shared_experts")),
                             key=natural_key)
    if unrepresentable:
        shown = ", ".join(unrepresentable[:6]) + (f", ... ({len(unrepresentable) - 6} more)"
                                                   if len(unrepresentable) > 6 else "")
        raise BridgeError(
            f"{len(unrepresentable)} adapter(s) on the dense MLP / shared experts ({shown}) have no HF PEFT "
            "representation: peft 0.21 with transformers 5 retargets gate_proj/up_proj/down_proj to the routed "
            "experts' fused parameters and silently drops such tensors. Merge the adapter into the weights instead "
            "(bridge.export_hf(model, path, merge_lora=True) or `megatron-glm5 lora merge`), or train without them "
            "(LoraConfig's default targets; they are adapted only when 'dense_mlp' / 'shared_experts' is named in "
            "target_modules)"
        )
    tensors: dict[str, torch.Tensor] = {}
    targets: dict[str, list[str]] = {}  # short HF name -> HF module paths adapted
    params: dict[str, list[str]] = {}  # "gate_up_proj" / "down_proj" -> fused HF parameter names adapted
    ranks: dict[str, tuple[int, float]] = {}  # HF module / parameter -> (rank, alpha)
    experts: dict[str, dict[int, Adapter]] = {}  # fused HF parameter name -> {expert: adapter}
    for module in sorted(adapters, key=natural_key):
        ad = adapters[module]
        if table.group(module) == "routed_experts":
            ref = table.fused[module].hf[0]
            experts.setdefault(ref.name, {})[ref.row] = ad
            continue
        (ref,) = table.rows[module].hf
        hf_module = ref.name[: -len(".weight")]
        tensors[f"{PEFT_PREFIX}{hf_module}.lora_A.weight"] = ad.a
        tensors[f"{PEFT_PREFIX}{hf_module}.lora_B.weight"] = ad.b
        targets.setdefault(hf_module.rsplit(".", 1)[1], []).append(hf_module)
        ranks[hf_module] = (ad.rank, ad.alpha)
    both = {p.rsplit(".", 1)[0] for p in experts if p.endswith("gate_up_proj")} & \
           {p.rsplit(".", 1)[0] for p in experts if p.endswith("down_proj")}
    n_exp = table.arch.n_routed_experts
    for param, per_expert in sorted(experts.items(), key=lambda kv: natural_key(kv[0])):
        missing = sorted(set(range(n_exp)) - set(per_expert))
        if missing:
            raise BridgeError(f"{param}: peft stores one adapter per fused expert parameter; experts {missing} have "
                              "none (adapt all routed experts of a layer, or none)")
        first = per_expert[0]
        if any((ad.rank, ad.alpha) != (first.rank, first.alpha) for ad in per_expert.values()):
            raise BridgeError(f"{param}: experts' adapters differ in rank or alpha; peft's fused adapter has one")
        a = torch.cat([per_expert[e].a for e in range(n_exp)])  # [R*E, in], expert-major
        b = torch.stack([per_expert[e].b for e in range(n_exp)], dim=-1)  # [out, R, E]
        b = b.reshape(b.shape[0], -1)  # column j*E + e = expert e's column j (expert-minor)
        module, kind = param.rsplit(".", 1)
        where = f"{module}.base_layer" if module in both and kind == "gate_up_proj" else module
        tensors[f"{PEFT_PREFIX}{where}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{where}.lora_B.weight"] = b.contiguous()
        params.setdefault(kind, []).append(param)
        ranks[param] = (first.rank, first.alpha)
    # rank_pattern / alpha_pattern: peft's own ".*\.gate_up_proj" entry when every gate_up adapter shares one
    # (rank, alpha) other than (r, alpha) (its 2r rule), exact names for anything else that differs.
    patterns: dict[str, tuple[int, float]] = {}
    gate_up = {v for k, v in ranks.items() if k.endswith(".gate_up_proj")}
    if len(gate_up) == 1 and gate_up != {(r, alpha)}:
        patterns[GATE_UP_PATTERN] = gate_up.pop()
    for key, value in sorted(ranks.items(), key=lambda kv: natural_key(kv[0])):
        if value != (r, alpha) and not (key.endswith(".gate_up_proj") and GATE_UP_PATTERN in patterns):
            patterns[re.escape(key)] = value
    hf_layers = table.arch.num_hidden_layers

    def names(short: str, paths: list[str], every: list[str]) -> list[str]:
        """The short name when it covers exactly the adapted HF modules, else the full paths."""
        inside = [p for p in paths if (_hf_layer(p) or 0) < hf_layers]
        return [short] if sorted(inside) == sorted(every) else sorted(inside, key=natural_key)

    hf_modules = list(table.by_hf)
    target_modules: list[str] = []
    for short, paths in sorted(targets.items()):
        every = [h for h in hf_modules if h.rsplit(".", 1)[1] == short and (_hf_layer(h) or 0) < hf_layers]
        target_modules += names(short, paths, every)
    fused_all = {k.hf[0].name for k in table.fused.values()}
    target_parameters: list[str] = []
    for kind, paths in sorted(params.items(), key=lambda kv: ("gate_up_proj", "down_proj").index(kv[0])):
        every = sorted(n for n in fused_all if n.endswith(kind) and (_hf_layer(n) or 0) < hf_layers)
        target_parameters += names(kind, paths, every)
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": int(r),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "target_modules": target_modules,
        "target_parameters": target_parameters,
        "rank_pattern": {k: v[0] for k, v in patterns.items()},
        "alpha_pattern": {k: v[1] for k, v in patterns.items()},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "exclude_modules": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "auto_mapping": {"base_model_class": "GlmMoeDsaForCausalLM",
                         "parent_library": "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa"},
    }
    return tensors, config


# --------------------------------------------------------------------------------------------------------------------
# PEFT -> adapter set
# --------------------------------------------------------------------------------------------------------------------


_UNSUPPORTED_PEFT = (("use_dora", True, "DoRA"), ("lora_bias", True, "LoRA bias"), ("fan_in_fan_out", True,
                                                                                      "fan_in_fan_out"))


def from_peft(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], table: AdapterTable, *,
              source: str) -> AdapterSet:
    """The adapter set of a PEFT adapter for ``table.arch`` (fused or per-module expert layouts, see the module
    docstring). Every tensor must map to a module of the model with the right shape."""
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointFormatError(f"{source}: peft_type is {config.get('peft_type')!r}; expected 'LORA'")
    for key, bad, what in _UNSUPPORTED_PEFT:
        if config.get(key) == bad:
            raise BridgeError(f"{source}: {what} adapters are not supported (adapter_config.json {key}={bad})")
    if config.get("bias", "none") != "none":
        raise BridgeError(f"{source}: LoRA bias={config.get('bias')!r} is not supported (expected 'none')")
    if config.get("modules_to_save"):
        raise BridgeError(f"{source}: modules_to_save {config['modules_to_save']} (fully trained modules) are not "
                          "supported; only LoRA factors")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    rank_pattern, alpha_pattern = dict(config.get("rank_pattern") or {}), dict(config.get("alpha_pattern") or {})
    rslora = bool(config.get("use_rslora", False))

    def alpha_of(key: str, rank: int) -> float:
        """Our alpha (scaling = alpha / rank) for a module ``key`` of rank ``rank``."""
        declared = _pattern_match(rank_pattern, key)
        declared = r if declared is None else int(declared)
        if declared != rank:
            raise ShapeMismatchError(f"{source}: {key} has rank {rank} but adapter_config.json declares "
                                     f"{declared} (r / rank_pattern)")
        a = _pattern_match(alpha_pattern, key)
        a = alpha if a is None else float(a)
        return a * math.sqrt(rank) if rslora else a  # rsLoRA scales by alpha / sqrt(rank)

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.match(rf"^{re.escape(PEFT_PREFIX)}(?P<mod>.+)\.lora_(?P<f>[AB])(?:\.default)?\.weight$", key)
        if m is None:
            raise TensorSetError(f"{source}: {key} is not a LoRA factor (expected "
                                 f"'{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight')", unexpected=[key])
        pairs.setdefault(m["mod"], {})[m["f"]] = t
    half = [k for k, v in pairs.items() if set(v) != {"A", "B"}]
    if half:
        raise TensorSetError(f"{source}: modules with only one LoRA factor: {sorted(half)[:8]}")

    out: AdapterSet = {}
    gated: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    unknown = []
    for hf_module, f in sorted(pairs.items(), key=lambda kv: natural_key(kv[0])):
        a, b = f["A"], f["B"]
        if re.search(r"\.mlp\.experts(\.base_layer)?$", hf_module):
            _fused_from_peft(hf_module, a, b, pairs, config, table, alpha_of, out, source)
            continue
        hit = table.by_hf.get(hf_module)
        if hit is None:
            unknown.append(hf_module)
            continue
        module, part = hit
        row = table.rows[module]
        ref = row.hf[part]
        out_f, in_f = ref.shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or b.shape[1] != a.shape[0]:
            raise ShapeMismatchError(f"{source}: {hf_module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not "
                                     f"fit the model's weight [{out_f}, {in_f}]")
        al = alpha_of(hf_module, a.shape[0])
        if len(row.hf) == 1:
            out[module] = Adapter(a, b, al)
        else:
            gated.setdefault(module, {})[part] = (a, b, al)
    if unknown:
        raise TensorSetError(f"{source}: adapters for modules this model does not have ({len(unknown)}): "
                             f"{unknown[:8]} - an adapter for another model or configuration?", unexpected=unknown)
    for module, parts in gated.items():  # per-module gate_proj + up_proj -> one fc1 adapter of rank 2r
        if set(parts) != {0, 1}:
            which = "gate_proj" if 0 in parts else "up_proj"
            raise TensorSetError(f"{source}: {module}: a {which} adapter without its "
                                 f"{'up_proj' if which == 'gate_proj' else 'gate_proj'} partner (megatron's linear_fc1 "
                                 "is [gate; up] and takes them together)")
        (ag, bg, sg), (au, bu, su) = parts[0], parts[1]
        if ag.shape[0] != au.shape[0] or sg != su:
            raise BridgeError(f"{source}: {module}: gate_proj and up_proj adapters differ in rank or alpha")
        rank = ag.shape[0]
        b = torch.zeros(bg.shape[0] + bu.shape[0], 2 * rank, dtype=bg.dtype)
        b[: bg.shape[0], :rank], b[bg.shape[0]:, rank:] = bg, bu
        out[module] = Adapter(torch.cat([ag, au]), b, 2 * sg)
    return out


def _fused_from_peft(hf_module, a, b, pairs, config, table, alpha_of, out, source) -> None:
    """``mlp.experts[.base_layer].lora_{A,B}`` (peft's ParamWrapper on fused expert parameters) -> per expert."""
    experts_module = hf_module.removesuffix(".base_layer")
    nested = f"{experts_module}.base_layer" in pairs
    arch = table.arch
    h, inter, n_exp = arch.hidden_size, arch.moe_intermediate_size, arch.n_routed_experts
    if hf_module.endswith(".base_layer"):
        kind = "gate_up_proj"
    elif nested:
        kind = "down_proj"
    elif h != inter:
        kind = "gate_up_proj" if a.shape[-1] == h else "down_proj"
    else:  # square experts: the config must say which parameter is adapted
        declared = {p.rsplit(".", 1)[-1] for p in config.get("target_parameters") or []}
        if len(declared & {"gate_up_proj", "down_proj"}) != 1:
            raise BridgeError(f"{source}: {hf_module}: cannot tell whether the fused adapter is gate_up_proj's or "
                              "down_proj's (equal shapes; target_parameters does not say)")
        kind = (declared & {"gate_up_proj", "down_proj"}).pop()
    param = f"{experts_module}.{kind}"
    out_f, in_f = (2 * inter, h) if kind == "gate_up_proj" else (h, inter)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1] \
            or a.shape[0] % n_exp:
        raise ShapeMismatchError(f"{source}: {hf_module} ({kind}): lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                                 f"do not fit {n_exp} experts of [{out_f}, {in_f}] (A [R*{n_exp}, {in_f}], "
                                 f"B [{out_f}, R*{n_exp}])")
    rank = a.shape[0] // n_exp
    al = alpha_of(param, rank)
    b3 = b.reshape(out_f, rank, n_exp)
    layer = _hf_layer(param)
    linear = "linear_fc1" if kind == "gate_up_proj" else "linear_fc2"
    prefix = _logical_layer(table, layer)
    if prefix is None:
        raise TensorSetError(f"{source}: {param}: the model has no MoE layer {layer}", unexpected=[hf_module])
    for e in range(n_exp):
        module = f"{prefix}.mlp.experts.local_experts.{e}.{linear}"
        if module not in table.rows:
            raise TensorSetError(f"{source}: {param}: layer {layer} has no routed experts", unexpected=[hf_module])
        out[module] = Adapter(a[e * rank:(e + 1) * rank].contiguous(), b3[..., e].contiguous(), al)


def _logical_layer(table: AdapterTable, hf_layer: int | None) -> str | None:
    if hf_layer is None:
        return None
    n = table.arch.num_hidden_layers
    if hf_layer < n:
        return f"decoder.layers.{hf_layer}"
    if hf_layer < n + table.arch.num_nextn_predict_layers:
        return f"mtp.layers.{hf_layer - n}.mtp_model_layer"
    return None


# --------------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------------


def adapted_targets(adapters: AdapterSet) -> list[str]:
    """``LoraConfig.target_modules`` that select exactly the linears ``adapters`` adapt: their megatron names, and
    the merge-only groups (dense MLP, shared experts) they reach, which the names alone do not."""
    from megatron_glm5.lora import MERGE_ONLY_GROUPS

    scopes = {scope_of(m) for m in adapters}
    names = sorted({t for t, _ in scopes}, key=MEGATRON_TARGETS.index)
    return names + sorted({g for _, g in scopes} & MERGE_ONLY_GROUPS)


def read_peft_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, adapter_config)`` of a PEFT adapter directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise CheckpointFormatError(f"{path}: PEFT adapter directory not found")
    cfg_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg_file.is_file():
        raise CheckpointFormatError(f"{path}: missing {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    if not weights.is_file():
        other = sorted(p.name for p in path.glob("adapter_model*"))
        raise CheckpointFormatError(f"{path}: missing {ADAPTER_WEIGHTS}" + (f" (found {other}; only safetensors "
                                                                            "adapters are read)" if other else ""))
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{cfg_file}: not valid JSON ({e})") from None
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise CheckpointFormatError(f"{cfg_file}: missing '{key}'")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointFormatError(f"{weights}: cannot read ({e})") from None
    return tensors, config


def write_peft_dir(path: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping, *,
                   overwrite: bool = False, source: str | Path | None = None) -> Path:
    """Write a PEFT adapter directory with the same output rules as every other output of this tool
    (:mod:`bridge.output`: staged, marked, atomically replaced, never over its source or an unmarked directory)."""
    import os

    from safetensors.torch import save

    from .output import atomic_output_dir

    with atomic_output_dir(path, overwrite=overwrite, kind="peft", source=source, sources=[source]) as tmp:
        data = save({k: v.detach().contiguous().cpu() for k, v in sorted(tensors.items(), key=lambda kv:
                                                                           natural_key(kv[0]))},
                    metadata={"format": "pt"})
        # safetensors' save_file creates the file 0600; every other output is 0644 less the umask
        fd = os.open(tmp / ADAPTER_WEIGHTS, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(path).absolute()


# --------------------------------------------------------------------------------------------------------------------
# In memory: model <-> PEFT directory
# --------------------------------------------------------------------------------------------------------------------


def write_adapter_checkpoint(model, ckpt_dir: str | Path, *, hf_config: Mapping | None = None,
                             sync_files: bool = False) -> Path:
    """Write ``model``'s adapters (collectively; each rank its main-replica shards) as an adapter-only
    ``torch_dist`` checkpoint, with the bridge's streaming writer (no CUDA, no helper processes). Same content as
    :func:`megatron_glm5.lora_checkpoint.save_lora_checkpoint`."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    from megatron_glm5.lora_checkpoint import LORA_META_KEY, all_ranks_meta, adapter_sharded_state_dict

    from .launch import world
    from .megatron_io import COMMON_STATE_KEY, Chunk, write_dist_checkpoint

    meta = all_ranks_meta(_first(model))
    if hf_config is not None:
        meta["hf_config"] = dict(hf_config)
    ssd = adapter_sharded_state_dict(_first(model))
    apply_factories(ssd)
    chunks, data = [], {}
    for sh in nested_values(ssd):
        if not isinstance(sh, ShardedTensor) or not is_main_replica(sh.replica_id):
            continue
        sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        chunk = Chunk(sh.key, tuple(sh.global_offset), sizes, tuple(sh.global_shape), sh.data.dtype)
        chunks.append(chunk)
        data[(chunk.key, chunk.offsets)] = sh.data
    objects = {COMMON_STATE_KEY: {LORA_META_KEY: meta}} if world()[0] == 0 else {}
    write_dist_checkpoint(Path(ckpt_dir), chunks, objects, lambda c: data[(c.key, c.offsets)].reshape(c.sizes),
                          sync_files=sync_files)
    return Path(ckpt_dir)


def model_arch(model, hf_config) -> tuple[dict, GLM5Architecture]:
    from .inmemory import HF_CONFIG_ATTR

    raw = hf_config if hf_config is not None else getattr(_first(model), HF_CONFIG_ATTR, None)
    if raw is None:
        raise BridgeError("the model's HF config.json is needed: pass hf_config=... (a dict or a path); models from "
                          "megatron_glm5.from_hf_pretrained carry it")
    if not isinstance(raw, Mapping):
        raw = load_hf_config(raw)
    return dict(raw), parse_hf_config(raw)


def _first(model):
    return model[0] if isinstance(model, (list, tuple)) else model


def load_peft_adapter(model, adapter_dir: str | Path, *, hf_config: Mapping | str | Path | None = None) -> dict:
    """Load an HF PEFT adapter into ``model`` (every rank reads the file and keeps its shards).

    If the model has no LoRA adapters yet, they are added (:func:`megatron_glm5.lora.add_lora`) exactly on the
    modules the file adapts, with its ranks and alphas; otherwise the file must adapt exactly the model's adapted
    modules with the same ranks and alphas. Returns a small report."""
    from megatron_glm5.lora import add_lora, lora_config, lora_modules
    from megatron_glm5.lora_checkpoint import LoraCheckpointError, check_same_adapters

    _, arch = model_arch(model, hf_config)
    tensors, config = read_peft_dir(adapter_dir)
    adapters = from_peft(tensors, config, adapter_table(arch), source=str(adapter_dir))
    if not adapters:
        raise TensorSetError(f"{adapter_dir}: the adapter holds no LoRA factors")
    mine = {m.lora_name: m for m in lora_modules(model)}
    if lora_config(model) is None:
        lcfg = LoraConfig(r=int(config["r"]), alpha=float(config["lora_alpha"]),
                          dropout=float(config.get("lora_dropout") or 0.0), target_modules=adapted_targets(adapters))
        overrides = {k: (ad.rank, ad.alpha) for k, ad in adapters.items()}
        add_lora(model, lcfg, only=overrides)
        mine = {m.lora_name: m for m in lora_modules(model)}
        stray = sorted(set(mine) - set(adapters))
        assert not stray, stray
    else:
        from megatron_glm5.lora_checkpoint import all_ranks_meta

        everywhere = all_ranks_meta(model)["modules"]  # collective: stages / expert ranks adapt different modules
        try:
            check_same_adapters(everywhere, {k: [ad.rank, ad.alpha] for k, ad in adapters.items()},
                                source=str(adapter_dir))
        except LoraCheckpointError as e:
            raise BridgeError(str(e)) from None
    for name, module in mine.items():
        ad = adapters[name]
        set_global_factors(module, ad.a, ad.b)
    return {"adapters": len(adapters), "local_adapters": len(mine), "r": int(config["r"]),
            "lora_alpha": float(config["lora_alpha"])}


def set_global_factors(module, a: torch.Tensor, b: torch.Tensor) -> None:
    """Copy global ``A [R, in]`` / ``B [out, R]`` into an adapted linear's local shards."""
    from megatron_glm5.lora import LoraDuplicated, LoraRow, local_rows, tp_rank_size

    rank, size = (0, 1) if isinstance(module, LoraDuplicated) else tp_rank_size(module)
    if isinstance(module, LoraRow):
        a = a.chunk(size, dim=1)[rank] if size > 1 else a
    elif not isinstance(module, LoraDuplicated):
        b = local_rows(b, rank, size, module.lora_swiglu)
    with torch.no_grad():
        for factor, value in ((module.lora_A.weight, a), (module.lora_B.weight, b)):
            if tuple(factor.shape) != tuple(value.shape):
                raise ShapeMismatchError(f"{module.lora_name}: local factor {list(factor.shape)} vs "
                                         f"{list(value.shape)} from the adapter")
            factor.copy_(value.to(factor.dtype))


def model_adapter_set(model) -> AdapterSet:
    """This process's adapters as global tensors (single process, TP = 1: tests and small tools)."""
    from megatron_glm5.lora import lora_modules

    out = {}
    for m in lora_modules(model):
        if getattr(m, "tp_group", None) is not None and m.tp_group.size() > 1:
            raise BridgeError("model_adapter_set: TP > 1; use export_peft_adapter (gathers through a checkpoint)")
        out[m.lora_name] = Adapter(m.lora_A.weight.detach().clone(), m.lora_B.weight.detach().clone(),
                                   m.lora_alpha)
    return out


__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "Adapter", "AdapterSet", "AdapterTable", "adapted_targets", "adapter_table",
    "export_peft_adapter", "from_peft", "load_peft_adapter", "model_adapter_set", "read_peft_dir",
    "set_global_factors", "to_peft", "write_adapter_checkpoint", "write_peft_dir",
]
