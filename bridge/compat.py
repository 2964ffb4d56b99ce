"""The one place that knows how the installed megatron-core lays out the DSA indexer's RoPE dimensions.

HF GLM-5.x stores each indexer head as ``[rope (qk_rope_head_dim) | nope]`` rows (``wq_b`` per head, ``wk``,
``k_norm.weight`` / ``k_norm.bias``). megatron-core's ``DSAIndexer._apply_rope`` changed over time
(shared/notes/glm5_model.md §4.4):

* early versions split ``[nope, pe]`` (rope on the *last* dims): HF weights need their two halves swapped
  (slime and radixark convert this way);
* newer versions, 0.19.2 included, split ``[pe, nope]`` like HF and honour ``dsa_indexer_rope_interleaved``: the
  weights map unchanged (NVIDIA Megatron-Bridge converts this way).

The answer is measured, not read off a version number: :func:`indexer_rope_layout` runs the installed
``DSAIndexer._apply_rope`` on a probe whose rotary angle is pi (cos -1, sin 0, so RoPE negates exactly the rope
dims, whatever the pairing) and sees which dims came back negated. If the private method cannot be called the
same way any more, the source text is inspected instead; if neither works, :class:`CompatError` says so rather
than guessing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import types
from typing import Literal

from .errors import CompatError

RopeLayout = Literal["pe_first", "nope_first"]


@functools.lru_cache(maxsize=None)
def indexer_rope_layout() -> RopeLayout:
    """Where the installed megatron-core's DSA indexer applies RoPE within a head: first or last dims."""
    try:
        return _probe_behaviour()
    except CompatError:
        raise
    except Exception as probe_error:  # the private signature moved: fall back to reading the source
        try:
            return _inspect_source()
        except CompatError as e:
            raise CompatError(f"{e} (the behavioural probe also failed: {probe_error!r})") from None


def needs_indexer_rope_swap() -> bool:
    """True when HF's ``[pe | nope]`` indexer rows must be swapped to megatron-core's ``[nope | pe]``."""
    return indexer_rope_layout() == "nope_first"


def honours_indexer_rope_interleave() -> bool:
    """Whether megatron-core reads ``dsa_indexer_rope_interleaved`` (GLM-5.x needs interleaved indexer RoPE)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "dsa_indexer_rope_interleaved" in {f.name for f in dataclasses.fields(TransformerConfig)}


def _probe_behaviour() -> RopeLayout:
    import torch
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    rope, head = 4, 8
    config = types.SimpleNamespace(
        apply_rope_fusion=False,
        multi_latent_attention=True,
        rotary_interleaved=False,
        dsa_indexer_rope_interleaved=True,
        mrope_section=None,
        context_parallel_size=1,
    )
    cp = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    fake = types.SimpleNamespace(
        qk_pos_emb_head_dim=rope, index_head_dim=head, config=config, pg_collection=types.SimpleNamespace(cp=cp)
    )
    x = torch.ones(1, 1, 1, head)
    angle = torch.full((1, 1, 1, rope), torch.pi)
    out = DSAIndexer._apply_rope(fake, x, angle, 1.0).reshape(head)
    negated = (out < 0).tolist()
    if negated == [True] * rope + [False] * (head - rope):
        return "pe_first"
    if negated == [False] * (head - rope) + [True] * rope:
        return "nope_first"
    raise CompatError(
        f"megatron-core DSAIndexer._apply_rope negated dims {negated} of a probe with rope={rope}, head={head}; "
        "expected the first or the last rope dims. The bridge does not know this indexer RoPE layout"
    )


_SPLIT = re.compile(r"(x_pe|x_nope)\s*,\s*(x_pe|x_nope)\s*=\s*torch\.split")


def _inspect_source() -> RopeLayout:
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    src = inspect.getsource(DSAIndexer._apply_rope)
    m = _SPLIT.search(src)
    if m is None:
        raise CompatError(
            "cannot tell where megatron-core's DSAIndexer._apply_rope puts the rope dims (no 'x_pe, x_nope = "
            "torch.split' in its source); the bridge does not support this megatron-core version"
        )
    return "pe_first" if m.group(1) == "x_pe" else "nope_first"
