"""Forward parity of our megatron-core model against transformers on the same weights, for every model family: GLM-5.x
against ``GlmMoeDsaForCausalLM``, GLM-5.3-Flash against ``Glm5NextForConditionalGeneration`` (text only).

One harness: what differs between families (loading the reference, where its layers are, what its indexer returns,
the indexer scores that decide it) comes from the family's :class:`~bridge.parity_reference.HFReference`; the checks
below are the same for both. For GLM-5.3-Flash a "candidate" of the indexer is a KPool pool (``index_topk // P`` are
kept, each expanded to ``P`` tokens, plus the tail pool) instead of a token, and the per-layer outputs are the mHC
streams ``[b, s, hc_mult, h]``.

:func:`verify` runs both models on the same random tokens, in fp32 or bf16, and returns one JSON-able dict:

* ``max_abs_logit_diff``, ``mean_abs_logit_diff``, ``logit_cosine``, ``argmax_agreement``; ``logit_scale``
  (max |HF logit|), ``max_rel_logit_diff`` (max |diff| / max(1, logit_scale)) and ``mean_rel_logit_diff``
  (mean |diff| / mean |HF logit|);
* ``topk_overlap``: per IndexShare "full" layer, the mean over query rows of |ours & HF| / |HF| of the selected
  causal keys (HF's indexer output is captured with a forward hook on ``self_attn.indexer``, ours from each
  layer's attention output ``(out, bias, topk)``; rows are ``b * s + pos``, -1 padding and HF's masked picks for
  rows with fewer than ``index_topk`` causal keys are dropped);
* ``indexer_recall``: per loss-computing layer (the full layers in order, then MTP) ``[captured, best]``: the mean
  share of the dense attention mass (head-summed, normalised) our indexer's top-k keys hold, and the most any as many
  keys could hold (:func:`megatron_glm5.dsa.indexer_loss.attention_recall`; the indexer warm-up's diagnostic);
* ``topk_boundary_ties``: query rows whose last kept and first dropped HF indexer candidates score *equal*, and
  ``topk_boundary_near_ties``: rows where they are closer than ``tie_eps`` times the row's best score (:data:`TIE_EPS`,
  above the two sides' rounding). There the rounding or the reference's ``torch.topk`` tie order, not the math,
  decides which key is kept, and logits may differ by O(0.1) between two correct implementations;
* ``max_abs_logit_diff_with_hf_topk`` (and its ``max_rel`` / ``mean_rel`` forms): the logits of our model when HF's
  discrete choices are replayed - its top-k indices returned in place of our indexer's selection, its experts fed
  to our routers through megatron-core's ``RouterReplay`` - which tests everything but the choices. Our indexer and
  routers still run in that forward, on activations that match HF's to rounding, and their own choices are compared
  with HF's: ``topk_rows_differing_on_hf_inputs``, ``topk_overlap_on_hf_inputs``,
  ``moe_rows_routed_differently_on_hf_inputs``, ``min_choice_agreement_on_hf_inputs`` (the least per-layer key
  overlap or fraction of tokens routed alike), and whether every difference is at a (near-)tie
  (``topk_differences_only_at_ties``, ``moe_differences_only_at_ties``; HF's expert choice is read from
  ``mlp.gate``'s output). The free-running forward's ``topk_rows_differing`` and ``moe_rows_routed_differently`` are
  reported too, but there one flipped tie changes every later choice for that token for good reasons;
* ``layer_max_rel_diff`` (per decoder layer output: max |diff| / max(1, max |HF|)), ``layer_mean_rel_diff``
  (mean |diff| / mean |HF|) and ``first_divergent_layer`` (the first layer above ``tol`` on the max form in fp32,
  the mean form in bf16), to point at the layer to debug;
* ``ok`` (defaults in :data:`TOLERANCES`):

  - fp32: ``max_rel_logit_diff <= tol`` (default 1e-4); or the same for the replay of HF's choices when our own
    choices on HF's activations differ from HF's only at (near-)ties. Both sides do the same float32 math in a
    different order, so *every* logit must agree to ~1e-5 relative; a choice that differs away from a tie, or a
    replayed diff above ``tol``, is a bug. This is the precise check (it fails a 5 % norm-weight or a 0.01
    expert-bias error on the test models);
  - bf16: ``mean_rel_logit_diff_with_hf_topk <= tol`` (default 2e-2) and ``min_choice_agreement_on_hf_inputs >=
    0.95``. A bf16 value carries 8 significant bits (relative spacing 2^-8 to 2^-7, 0.4-0.8 %) and each side rounds
    activations after every op in a different order, so indexer top-k and expert choices near a tie flip for some
    tokens (a few percent per layer) and move those tokens' logits by O(1): no max can be a test in bf16. With the
    choices replayed, a correct model stays at about one to three bf16 steps on average (measured on random models,
    whose random weights amplify rounding more than trained ones: 0.4 % after one layer and 1.4 % after four on the
    CPU test model; 0.75 % after two and 1.3 % after four for the 1024-wide ``small_glm52_config`` on an H200) and
    agrees on >= 97 % of choices; 2e-2 (about 4 bf16 steps) and 95 % leave that margin for checks of a few layers
    (``--num-layers``). A wrong expert order, router or indexer weight fails both (measured: 50 % mean difference,
    10-50 % agreement); errors of a few percent in one weight stay inside bf16 noise: use fp32 for those. Deeper
    bf16 checks accumulate more rounding: pass a larger ``tol``. ``max_*``, ``logit_cosine`` and
    ``argmax_agreement`` are reported for judgement.

``num_layers=N`` checks a layer-truncated model on both sides: the first N decoder layers, the final norm and the
LM head, without MTP (IndexShare pattern ``indexer_types[:N]``). Our side validates the whole HF checkpoint (every
tensor accounted for) but reads only the kept layers' tensors; transformers builds the truncated config and its
loader reads only the tensors the truncated model has (other layers and MTP are reported as unexpected keys, which
are checked to be exactly layers >= N). Memory is then about two copies of the kept layers in ``dtype``: for
GLM-5.x with N=4 in bf16 (3 dense + 1 MoE layer, embeddings, LM head: 13.0 B parameters) 26 GB per side.

The sequence must be longer than ``index_topk``, otherwise DSA selects every key and the indexer is not tested;
the default is :func:`default_seq_len`.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_glm5 import compat

from .errors import BridgeError
from .metrics import logit_cosine
from .parity_reference import boundary_ties, reference_for
from .preflight import hf_checkpoint_dir, read_hf_config

TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""Default ``tol`` per dtype, and what it bounds: fp32 ``max_rel_logit_diff``, bf16
``mean_rel_logit_diff_with_hf_topk`` (the module docstring says why)."""
BF16_MIN_CHOICE_AGREEMENT = 0.95
"""bf16: least agreement of our DSA top-k (key overlap) and expert choice (tokens) with HF's, on HF-equivalent
activations, per layer (module docstring)."""
TIE_EPS = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
"""A DSA top-k or expert choice whose boundary gap is below this fraction of the row's best score is a near-tie:
the two sides' rounding (about 1e-6 relative in fp32, 1e-2 in bf16) may order it either way."""
SEQ_MARGIN = 256
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # GLM-5.x / GLM-5.3-Flash HF names


def default_seq_len(arch) -> int:
    """``index_topk + 256`` rounded up to a multiple of 64 (2304 for GLM-5.x, whose ``index_topk`` is 2048): the
    last 256+ query rows have more causal keys than ``index_topk``, so the indexer really selects on them (with
    ``seq_len <= index_topk`` DSA keeps every key and the indexer is not tested); a multiple of 64 suits the
    fused kernels' tiles. The attention cost is quadratic in the length, so no longer than needed."""
    return -(-(arch.index_topk + SEQ_MARGIN) // 64) * 64


def parse_verify_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in TOLERANCES:
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise BridgeError(f"--dtype {dtype!r}: expected bf16 or fp32")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``cuda`` when available, else ``cpu``. Our megatron-core model cannot run on the CPU of a machine whose GPUs
    are visible (megatron-core places some buffers on the current CUDA device), so that combination is refused
    with the remedy; the command line hides the GPUs itself for ``--device cpu``."""
    cuda = torch.cuda.is_available()
    if device is None:
        return torch.device("cuda" if cuda else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise BridgeError(f"--device {device!r}: expected cpu or cuda") from None
    if d.type == "cuda" and not cuda:
        raise BridgeError(f"--device {device}: CUDA is not available on this machine (torch.cuda.is_available() is "
                          "False); use --device cpu")
    if d.type == "cpu" and cuda:
        raise BridgeError(f"--device {device}: this process sees CUDA devices, and megatron-core then places some "
                          "buffers on the GPU; hide them (CUDA_VISIBLE_DEVICES=) to verify on the CPU")
    if d.type not in ("cpu", "cuda"):
        raise BridgeError(f"--device {device}: expected cpu or cuda")
    return d


def _boundary_ties(scores: torch.Tensor, topk: int, rel_eps: float = 0.0) -> set[tuple[int, int]]:
    """GLM-5.x token scores ``[B, S, T]`` (before causal masking): rows ``(batch, query)`` with more than ``topk``
    causal keys whose ``topk``-th and next-best scores are equal (or within ``rel_eps`` of the row's best); see
    :func:`bridge.parity_reference.boundary_ties`."""
    s = scores.shape[1]
    future = torch.ones(s, scores.shape[2], dtype=torch.bool, device=scores.device).triu(1)
    return boundary_ties(scores.masked_fill(future, float("-inf")), topk, rel_eps)


def _routing_ties(logits: torch.Tensor, bias: torch.Tensor, topk: int, rel_eps: float) -> torch.Tensor:
    """Bool per token: the router's ``topk``-th and next-best choice scores (sigmoid + correction bias, as HF and
    megatron-core choose) are closer than ``rel_eps`` times the best one."""
    v = (logits.float().sigmoid() + bias.float().to(logits.device)).sort(dim=-1, descending=True).values
    return ((v[:, topk - 1] - v[:, topk]) <= rel_eps * v[:, 0].abs()).cpu()


def load_hf_model(hf_path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  num_layers: int | None = None):
    """transformers' reference model of ``hf_path``'s family (:mod:`bridge.parity_reference`) in ``dtype`` on
    ``device``; with ``num_layers`` the first N decoder layers only, so that its loader reads only their tensors.
    Every parameter must come from the checkpoint, else :class:`BridgeError`."""
    from megatron_glm5.architectures import parse_architecture

    ref = reference_for(parse_architecture(read_hf_config(hf_path)))
    return ref.load(hf_path, dtype=dtype, device=device, num_layers=num_layers)


def _batch_major(routing_map: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """megatron-core's ``[s * b, E]`` rows -> HF's ``[b * s, E]``."""
    return routing_map.reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)


def _batch_major_ids(indices: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """megatron-core's ``[s * b, k]`` expert ids -> HF's ``[b * s, k]``, as int64."""
    return indices.reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1).long()


def _seq_major(indices: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """HF's ``[b * s, k]`` rows -> megatron-core's ``[s * b, k]``."""
    return indices.reshape(b, s, -1).transpose(0, 1).reshape(s * b, -1)


def _replay_forward(model, ids, pos, *, device, dsa_topk: dict, experts: dict) -> tuple[torch.Tensor, dict, dict]:
    """Our logits with HF's discrete choices forced: the DSA top-k of full layer ``i`` is ``dsa_topk[i]`` (returned
    in place of our indexer's selection; shared layers reuse it as usual) and the experts of MoE layer ``i`` are
    ``experts[i]`` (megatron-core's ``RouterReplay``, which gathers the router's own scores for the given experts and
    normalises and scales them as usual).

    Our indexer and routers still run on the replayed activations, which match HF's to rounding, and their own
    choices are returned too: ``(logits, {layer: our top-k}, {layer: our expert ids [s * b, k]})``. Comparing those
    with HF's separates a real selection bug from a flip at a near-tie, without the free-running forward's
    propagation (once a tie flips, every later choice for that token may differ for good reasons)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class _ReplayAndRecord(RouterReplay):
        natural: torch.Tensor | None = None

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            self.natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    our_topk: dict[int, torch.Tensor] = {}
    patched, replays = [], []
    try:
        for layer in model.decoder.layers:
            gi = layer.layer_number - 1
            core = getattr(layer.self_attention, "core_attention", None)
            if gi in dsa_topk and core is not None:
                def forced(*args, gi=gi, original=core.compute_topk, **kwargs):
                    our_topk[gi] = original(*args, **kwargs).cpu()
                    return dsa_topk[gi]

                compat.override_method(core, "compute_topk", forced)
                patched.append(core)
            router = getattr(layer.mlp, "router", None)
            if router is not None and gi in experts:
                replay = _ReplayAndRecord()
                replay.set_target_indices(experts[gi].to(device=device, dtype=torch.long))
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                replays.append((gi, router, router.router_replay, replay))
                router.router_replay = replay
        logits = model(ids, pos, None).float().cpu()
    finally:
        for core in patched:
            compat.restore_method(core, "compute_topk")  # back to the class's method
        for _, router, previous, replay in replays:
            router.router_replay = previous
            compat.forget_router_replay(replay)
    return logits, our_topk, {gi: r.natural.cpu() for gi, _, _, r in replays if r.natural is not None}


def _global_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sequence-relative ``[B, S, W]`` key positions (-1 padded) -> int32 ``[B * S, W]`` key rows of the flattened
    batch (batch-major, as our attention takes them)."""
    b, s, _ = rows.shape
    offset = torch.arange(b, device=rows.device)[:, None, None] * s
    return torch.where(rows >= 0, rows + offset, rows).to(torch.int32).reshape(b * s, -1)


def _set_differences(mine: torch.Tensor, want: torch.Tensor) -> tuple[float, set[int]]:
    """(mean over rows of |mine & want| / |want|, rows whose key sets differ) of two ``[R, *]`` -1-padded index
    tensors (our and HF's key rows; widths may differ)."""
    mine = mine.reshape(want.shape[0], -1)
    fractions, differing = [], set()
    for row, (x, y) in enumerate(zip(mine.tolist(), want.tolist())):
        got, ref = {v for v in x if v >= 0}, {v for v in y if v >= 0}
        fractions.append(len(got & ref) / max(len(ref), 1))
        if got != ref:
            differing.add(row)
    return sum(fractions) / max(len(fractions), 1), differing


def _routing_differences(hf_idx: torch.Tensor, ours_map: torch.Tensor) -> torch.Tensor:
    """Bool per token (batch-major): our routing map ``[b * s, E]`` selects other experts than HF's expert ids
    ``[b * s, k]``."""
    return (torch.zeros_like(ours_map).scatter_(1, hf_idx.long(), True) != ours_map).any(dim=1)


def _build_ours(hf_path, megatron_path, *, dtype: torch.dtype, cuda: bool, num_layers: int | None):
    from megatron_glm5.config import RuntimePolicy

    if megatron_path is None:
        from .pretrained import from_hf_pretrained

        return from_hf_pretrained(hf_path, params_dtype=dtype, num_layers=num_layers)
    from megatron.core import parallel_state as ps

    from .inmemory import load_megatron_checkpoint

    policy = RuntimePolicy(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        params_dtype=dtype, use_cpu_initialization=not cuda, perform_initialization=False,
    )
    model = load_megatron_checkpoint(megatron_path, policy=policy, num_layers=num_layers)
    return model.cuda() if cuda else model


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |diff| / max(1, max |ref|), mean |diff| / mean |ref|)."""
    return ((diff.max() / ref.abs().max().clamp(min=1.0)).item(),
            (diff.mean() / ref.abs().mean().clamp(min=torch.finfo(torch.float32).tiny)).item())


@torch.no_grad()
def verify(
    *,
    hf_path: str | Path,
    megatron_path: str | Path | None = None,
    seq_len: int | None = None,
    batch_size: int = 1,
    seed: int = 0,
    tol: float | None = None,
    model=None,
    num_layers: int | None = None,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device | None = None,
) -> dict:
    """Compare logits of our model (from ``megatron_path``, or ``model``, or loaded from ``hf_path``) with
    transformers on ``hf_path``, for a checkpoint of any registered family. Single process (TP=PP=EP=1).

    ``seq_len`` defaults to :func:`default_seq_len`; ``tol`` to ``TOLERANCES[dtype]``; ``device`` to cuda when
    available. ``num_layers``: the layer-truncated check (module docstring); a given ``model`` must then be the
    truncated one (``from_hf_pretrained(..., num_layers=N)``).
    """
    from megatron.core import parallel_state as ps

    from megatron_glm5.architectures import parse_architecture
    from megatron_glm5.parallel import initialize_model_parallel
    from megatron_glm5.dsa.indexer_training import RECALL

    t0 = time.perf_counter()
    hf_checkpoint_dir(hf_path, flag="--hf-path")
    raw = read_hf_config(hf_path)
    arch = parse_architecture(raw)
    ref = reference_for(arch)
    if raw.get("quantization_config") or getattr(arch, "is_fp8", False):
        raise BridgeError(f"--hf-path {hf_path}: verify needs an unquantised HF checkpoint (this one is FP8); export "
                          "one with `megatron-glm5 convert import` + `convert export` first")
    torch_dtype = parse_verify_dtype(dtype)
    dev = resolve_device(device)
    if num_layers is not None:
        from .source import check_num_layers

        check_num_layers(num_layers, arch, source=f"{hf_path}/config.json")
        if model is not None and model.config.num_layers != num_layers:
            raise BridgeError(f"verify(model=..., num_layers={num_layers}): the given model has "
                              f"{model.config.num_layers} decoder layers; build it with "
                              f"from_hf_pretrained(..., num_layers={num_layers})")
    kept = arch.num_hidden_layers if num_layers is None else num_layers
    seq_len = default_seq_len(arch) if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= arch.index_topk:
        raise BridgeError(f"--seq-len {seq_len} must exceed index_topk ({arch.index_topk}); otherwise DSA keeps every "
                          f"key and the indexer is not exercised (default: {default_seq_len(arch)})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BridgeError(f"--batch-size: expected an integer >= 1, got {batch_size!r}")
    tol = TOLERANCES[torch_dtype] if tol is None else tol
    if not (isinstance(tol, (int, float)) and tol > 0 and math.isfinite(tol)):
        raise BridgeError(f"--tol: expected a positive number, got {tol!r}")
    skipped: dict[str, str] = {}
    if num_layers is not None:  # validate the whole checkpoint and list what the truncated models leave out
        from .source import open_hf_source

        src = open_hf_source(hf_path, num_layers=num_layers)
        skipped = src.skipped
        src.reader.close()

    if not ps.model_parallel_is_initialized():
        initialize_model_parallel()
    if model is None:
        model = _build_ours(hf_path, megatron_path, dtype=torch_dtype, cuda=dev.type == "cuda", num_layers=num_layers)
    model.eval()
    device = next(model.parameters()).device
    hf = ref.load(hf_path, dtype=torch_dtype, device=device, num_layers=num_layers)

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (batch_size, seq_len), generator=gen)
    pos = torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len)

    ours_topk: dict[int, torch.Tensor] = {}  # [b * s, W] global key rows, batch-major
    ours_hidden: dict[int, torch.Tensor] = {}  # [b, s, h] (GLM-5.3-Flash: the mHC streams, flattened)
    ours_experts: dict[int, torch.Tensor] = {}  # [b * s, E] bool routing map, batch-major rows
    hf_topk: dict[int, torch.Tensor] = {}  # [b * s, W] global key rows (HF's choice as we take it)
    hf_hidden: dict[int, torch.Tensor] = {}
    hf_scores: dict[int, torch.Tensor] = {}  # [b, s, candidates], -inf where not selectable
    hf_experts: dict[int, torch.Tensor] = {}  # [b * s, k] expert ids, batch-major rows
    routing_ties: dict[int, torch.Tensor] = {}  # [b * s] bool: HF's expert choice is a near-tie
    tie_eps = TIE_EPS[torch_dtype]
    hooks = []
    for layer in model.decoder.layers:
        gi = layer.layer_number - 1
        hooks.append(layer.register_forward_hook(
            lambda mod, a, out, gi=gi: ours_hidden.__setitem__(
                gi, (out[0] if isinstance(out, tuple) else out).transpose(0, 1).float().cpu())))
        if getattr(layer.self_attention, "computes_topk", False):
            hooks.append(layer.self_attention.register_forward_hook(
                lambda mod, a, out, gi=gi: ours_topk.__setitem__(gi, out[2].cpu())))
        router = getattr(layer.mlp, "router", None)
        if router is not None:  # rows are [s, b]-major in megatron-core: reorder to HF's [b, s]
            hooks.append(router.register_forward_hook(lambda mod, a, out, gi=gi: ours_experts.__setitem__(
                gi, _batch_major(out[1].cpu(), batch_size, seq_len))))
    for i, layer in enumerate(ref.decoder_layers(hf)):
        hooks.append(layer.register_forward_hook(lambda mod, a, out, i=i: hf_hidden.__setitem__(
            i, (out[0] if isinstance(out, tuple) else out).float().cpu())))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):  # (router_logits, weights, indices)
            def routed(mod, a, out, i=i):
                hf_experts[i] = out[2].cpu()
                if arch.n_group == 1:
                    routing_ties[i] = _routing_ties(out[0], mod.e_score_correction_bias, arch.num_experts_per_tok,
                                                    tie_eps)
                else:  # group-limited routing: no near-tie analysis, every difference counts
                    routing_ties[i] = torch.zeros(len(out[0]), dtype=torch.bool)

            hooks.append(gate.register_forward_hook(routed))
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            hooks.append(indexer.register_forward_hook(lambda mod, a, out, i=i: hf_topk.__setitem__(
                i, _global_rows(ref.sequence_rows(out.cpu())))))

            def pre(mod, args, kwargs, i=i):
                hf_scores[i] = ref.candidate_scores(mod, args, kwargs).cpu()

            hooks.append(indexer.register_forward_pre_hook(pre, with_kwargs=True))
    hf_device = next(hf.parameters()).device
    try:
        RECALL.take()
        with RECALL.record():  # the indexer's recall of the dense attention mass, per full layer (and MTP)
            ours = model(ids.to(device), pos.to(device), None).float().cpu()
        recall = RECALL.take()
        theirs = hf(input_ids=ids.to(hf_device)).logits.float().cpu()
    finally:
        for h in hooks:
            h.remove()

    kept_per_row = ref.selected(arch)
    exact_ties = {(i, bi * seq_len + q) for i, sc in hf_scores.items() for bi, q in boundary_ties(sc, kept_per_row)}
    tie_rows = {(i, bi * seq_len + q) for i, sc in hf_scores.items()
                for bi, q in boundary_ties(sc, kept_per_row, tie_eps)}
    overlap: dict[str, float] = {}
    differing: set[tuple[int, int]] = set()
    for i, want in sorted(hf_topk.items()):
        if i in ours_topk:
            fraction, rows_differing = _set_differences(ours_topk[i], want)
            overlap[str(i)] = fraction
            differing |= {(i, r) for r in rows_differing}
    routing_differs = {str(i): int(_routing_differences(want, ours_experts[i]).sum())
                       for i, want in sorted(hf_experts.items()) if i in ours_experts}

    # The same forward with HF's choices replayed: tests everything but the choices, and gives our choices on
    # HF-equivalent activations, which may differ from HF's only at near-ties.
    replayed, replay_topk, replay_experts = _replay_forward(
        model, ids.to(device), pos.to(device), device=device,
        dsa_topk={gi: rows.to(device) for gi, rows in hf_topk.items() if gi in ours_topk},
        experts={gi: _seq_major(idx, batch_size, seq_len) for gi, idx in hf_experts.items()})
    replay_differing: set[tuple[int, int]] = set()
    replay_overlap: dict[str, float] = {}
    for i, mine in sorted(replay_topk.items()):
        fraction, rows = _set_differences(mine, hf_topk[i])
        replay_overlap[str(i)] = fraction
        replay_differing |= {(i, r) for r in rows}
    routing_replay_differs: dict[str, int] = {}
    routing_only_ties = True
    for i, natural in sorted(replay_experts.items()):
        rows = (torch.zeros(len(natural), arch.n_routed_experts, dtype=torch.bool)
                .scatter_(1, _batch_major_ids(natural, batch_size, seq_len), True))
        rows = _routing_differences(hf_experts[i], rows)
        routing_replay_differs[str(i)] = int(rows.sum())
        routing_only_ties &= bool((rows <= routing_ties[i]).all())
    tokens = batch_size * seq_len
    agreement = min([*replay_overlap.values(), *(1 - n / tokens for n in routing_replay_differs.values())], default=1.0)
    choices = tokens * (len(replay_topk) + len(replay_experts))
    flipped = (len(replay_differing) + sum(routing_replay_differs.values())) / max(choices, 1)

    diff = (ours - theirs).abs()
    replay_diff = (replayed - theirs).abs()
    del replayed
    max_rel, mean_rel = _rel(diff, theirs)
    replay_max_rel, replay_mean_rel = _rel(replay_diff, theirs)
    cosine = logit_cosine(ours, theirs)  # fp64, never above 1
    layers = [i for i in sorted(ours_hidden) if i in hf_hidden]
    layer_rel = [_rel((ours_hidden[i].reshape(hf_hidden[i].shape) - hf_hidden[i]).abs(), hf_hidden[i])
                 for i in layers]
    bf16 = torch_dtype == torch.bfloat16
    metric = 1 if bf16 else 0  # index into (max_rel, mean_rel)
    first_bad = next((i for i, r in zip(layers, layer_rel) if not r[metric] <= tol), None)
    max_diff = diff.max().item()
    only_ties = replay_differing <= tie_rows
    if bf16:
        ok = math.isfinite(max_diff) and replay_mean_rel <= tol and agreement >= BF16_MIN_CHOICE_AGREEMENT
    else:
        ok = math.isfinite(max_diff) and (max_rel <= tol or (only_ties and routing_only_ties and replay_max_rel <= tol))
    skipped_layers = sorted({int(m.group(1)) for n in skipped if (m := _LAYER.match(n))})
    return {
        "model_type": arch.model_type,
        "max_abs_logit_diff": max_diff,
        "mean_abs_logit_diff": diff.mean().item(),
        "max_rel_logit_diff": max_rel,
        "mean_rel_logit_diff": mean_rel,
        "logit_scale": theirs.abs().max().item(),
        "logit_cosine": cosine,
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "topk_overlap": overlap,
        "topk_boundary_ties": len(exact_ties),
        "topk_boundary_near_ties": len(tie_rows),
        "topk_rows_differing": len(differing),
        "topk_rows_differing_on_hf_inputs": len(replay_differing),
        "topk_overlap_on_hf_inputs": replay_overlap,
        "topk_differences_only_at_ties": only_ties,
        # per loss slot (full decoder layers in order, then MTP): (mean share of the dense attention mass the top-k
        # holds, the most any as many keys could hold)
        "indexer_recall": [[round(c, 6), round(b, 6)] for _, (c, b) in sorted(recall.items())],
        "moe_rows_routed_differently": routing_differs,
        "moe_rows_routed_differently_on_hf_inputs": routing_replay_differs,
        "moe_routing_near_ties": {str(i): int(t.sum()) for i, t in sorted(routing_ties.items())},
        "moe_differences_only_at_ties": routing_only_ties,
        "choices_flipped_on_hf_inputs": flipped,
        "min_choice_agreement_on_hf_inputs": agreement,
        "tie_eps": tie_eps,
        "max_abs_logit_diff_with_hf_topk": replay_diff.max().item(),
        "max_rel_logit_diff_with_hf_topk": replay_max_rel,
        "mean_rel_logit_diff_with_hf_topk": replay_mean_rel,
        "layer_max_rel_diff": [r[0] for r in layer_rel],
        "layer_mean_rel_diff": [r[1] for r in layer_rel],
        "first_divergent_layer": first_bad,
        "layers_checked": layers,
        "num_layers": kept,
        "num_hidden_layers": arch.num_hidden_layers,
        "mtp_loaded": bool(getattr(model, "mtp_process", False)),
        "layers_skipped": [i for i in skipped_layers if i < arch.num_hidden_layers],
        "mtp_layers_skipped": [i - arch.num_hidden_layers for i in skipped_layers if i >= arch.num_hidden_layers],
        "hf_tensors_skipped": len(skipped),
        "dtype": "bf16" if bf16 else "fp32",
        "device": str(device),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "index_topk": arch.index_topk,
        "seed": seed,
        "tol": tol,
        "tol_metric": "mean_rel_logit_diff_with_hf_topk" if bf16 else "max_rel_logit_diff",
        "ok": bool(ok),
        "seconds": time.perf_counter() - t0,
        "source": str(megatron_path) if megatron_path is not None else str(hf_path),
    }
