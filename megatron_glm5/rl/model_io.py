"""What a GPTModel forward takes from a packed micro-batch, shared by the log-prob path (:mod:`.logprobs`) and the
choice capture (:mod:`.replay`) so that neither imports the other."""

from __future__ import annotations

import torch

from .packing import RankPlan


def unwrap(model) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module / other ``.module`` wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def mtp_loss_mask(plan: RankPlan, mask: torch.Tensor | None, device) -> torch.Tensor:
    """``loss_mask`` ``[b, s]`` for GPTModel (only its MTP loss reads it): zeros unless the caller trains MTP."""
    out = torch.zeros(plan.width, plan.seqlen, dtype=torch.float32, device=device)
    if mask is None:
        return out
    mask = torch.as_tensor(mask).to(device=device, dtype=torch.float32).reshape(-1)
    if mask.numel() != plan.batch.num_tokens:
        raise ValueError(f"mtp_loss_mask must have one entry per token ({plan.batch.num_tokens}), got {mask.numel()}")
    idx = plan.packed_index().to(device).view(plan.width, plan.seqlen)
    return torch.where(idx >= 0, mask[idx.clamp_min(0)], out)


def forward_kwargs(plan: RankPlan, device, mask: torch.Tensor | None = None) -> dict:
    """``GPTModel.forward`` kwargs for this rank's share of the micro-batch, with the MTP ``loss_mask``."""
    kwargs = plan.model_inputs(device)
    kwargs["loss_mask"] = mtp_loss_mask(plan, mask, device)
    return kwargs
