"""`python -m megatron_glm5.pretrain` up to the model: Megatron-LM arguments take the architecture from --hf-config,
contradicting flags are refused, and the model provider builds the GLM-5.x GPTModel. (The training loop itself needs
CUDA; it runs on the GPU machine.)"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import pytest

from megatron_glm5.config import load_hf_config, parse_hf_config
from megatron_glm5.pretrain import add_glm5_args, apply_architecture, disable_unavailable_fusions, model_provider
from megatron_glm5.testing import tiny_glm52_config


def _parse(monkeypatch, argv):
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    return parse_args(extra_args_provider=add_glm5_args)


@pytest.fixture
def hf_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_glm52_config()))
    return tmp_path


BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--seq-length", "64", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "20", "--lr", "1e-3"]


@contextmanager
def _megatron_globals(monkeypatch, hf_dir, extra=()):
    """What ``pretrain.main`` does before megatron.training takes over: parse, apply the HF architecture, validate and
    set Megatron-LM's global args (unset afterwards). Yields ``(args, arch, changed flags)``."""
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    from megatron_glm5.pretrain import check_indexer_flags

    argv = ["--hf-config", str(hf_dir), *BASE, *extra]
    args = _parse(monkeypatch, argv)
    arch = parse_hf_config(load_hf_config(hf_dir))
    changed = apply_architecture(args, arch, argv)
    check_indexer_flags(args, argv)
    disable_unavailable_fusions(args)
    validate_args(args, {})
    set_global_variables(args)
    try:
        yield args, arch, changed
    finally:
        unset_global_variables()


def test_architecture_comes_from_hf_config(monkeypatch, hf_dir, model_parallel):
    with _megatron_globals(monkeypatch, hf_dir) as (args, arch, changed):
        assert {"num_layers", "hidden_size", "q_lora_rank", "dsa_indexer_rope_interleaved", "num_experts"} <= set(changed)
        assert (args.num_layers, args.num_experts, args.rotary_base, args.vocab_size) == (4, 8, 8e6, 512)
        assert args.dsa_indexer_topk_freq == 2 and args.dsa_indexer_rotate_activation is False
        model = model_provider(arch, "megatron")
        assert model.config.dsa_indexer_k_norm_fp32 and model.config.moe_router_dtype == "fp32"
        assert model.config.hidden_dropout == 0.0 and model.config.rope_type == "rope"
        assert model.vocab_size == 512 and len(model.decoder.layers) == 4 and model.mtp_process


def test_contradicting_flag_is_refused(monkeypatch, hf_dir):
    argv = ["--hf-config", str(hf_dir), "--num-layers", "6", *BASE]
    args = _parse(monkeypatch, argv)
    with pytest.raises(SystemExit, match=r"--num-layers 6 \(the HF config says 4\)"):
        apply_architecture(args, parse_hf_config(load_hf_config(hf_dir)), argv)


def test_pretrain_refuses_cpu(monkeypatch, hf_dir):
    import torch

    from megatron_glm5 import pretrain

    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(SystemExit, match="needs CUDA"):
        pretrain.main(["--hf-config", str(hf_dir), *BASE])


def test_get_batch_reads_mock_batches(monkeypatch, hf_dir, model_parallel):
    """The forward step's batch reader on a 1-rank TP group: the dataset's dict becomes (tokens, labels, loss_mask,
    None, position_ids) with the training dtypes."""
    import torch

    from megatron_glm5.pretrain import _get_batch

    with _megatron_globals(monkeypatch, hf_dir):
        item = {"tokens": torch.arange(64)[None], "labels": torch.arange(1, 65)[None],
                "loss_mask": torch.ones(1, 64, dtype=torch.int32), "position_ids": torch.arange(64)[None],
                "attention_mask": None}
        tokens, labels, loss_mask, mask, pos = _get_batch(iter([item]))
        assert mask is None and tokens.dtype == torch.int64 and loss_mask.dtype == torch.float32
        assert torch.equal(labels, item["labels"]) and torch.equal(pos, item["position_ids"])


def test_config_container_and_mock_datasets(monkeypatch, hf_dir, model_parallel):
    """What `main` hands to megatron.training.pretrain builds on CPU: the config container and the mock datasets,
    whose samples carry the keys the batch reader uses."""
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_glm5.pretrain import _BATCH_KEYS, train_valid_test_datasets_provider

    with _megatron_globals(monkeypatch, hf_dir) as (args, _, _):
        cfg = pretrain_cfg_container_from_args(args, model_cfg=None)
        assert cfg.train.train_iters == 20
        train, _, _ = train_valid_test_datasets_provider([8, 0, 0])
        sample = train[0]
        for key, _ in _BATCH_KEYS:
            assert sample[key].shape[-1] == 64, key
        assert int(sample["tokens"].max()) < 512


def test_prebuilt_dataset_helpers_replace_make(monkeypatch):
    """The wheel has the compiled helpers but no Makefile, so megatron.training's `make` would exit(1)."""
    import megatron.core.datasets.utils as dataset_utils

    from megatron_glm5.pretrain import use_prebuilt_dataset_helpers

    monkeypatch.setattr(dataset_utils, "compile_helpers", dataset_utils.compile_helpers)  # restored after the test
    assert use_prebuilt_dataset_helpers()
    dataset_utils.compile_helpers()  # no `make`, no exit: checks the prebuilt extension imports


def test_indexer_warmup_flag(monkeypatch, hf_dir, model_parallel):
    """``--dsa-indexer-warmup``: loss coefficient 1.0 by default, only the indexers trainable, the recall reported in
    the loss dictionary Megatron-LM logs."""
    import torch

    from megatron_glm5.dsa.indexer_training import RECALL, LossSlot
    from megatron_glm5.dsa.indexer_loss import RecallStats
    from megatron_glm5.pretrain import _loss_func

    with _megatron_globals(monkeypatch, hf_dir, ["--dsa-indexer-warmup"]) as (args, arch, _):
        assert args.dsa_indexer_loss_coeff == 1.0
        model = model_provider(arch, "megatron")
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(".indexer." in n for n in trainable)
        RECALL.take()
        RECALL.add(LossSlot(0, 2), RecallStats(torch.tensor(0.25), torch.tensor(0.75)))
        _, _, report = _loss_func(torch.ones(4), torch.ones(4))
        assert report["indexer recall"].tolist() == [0.25, 1.0]
        assert report["indexer recall best"].tolist() == [0.75, 1.0]
        _, _, report = _loss_func(torch.ones(4), torch.ones(4))  # nothing new: count 0
        assert report["indexer recall"].tolist() == [0.0, 0.0]


def test_indexer_warmup_refuses_sparse_loss(monkeypatch, hf_dir):
    from megatron_glm5.pretrain import check_indexer_flags

    argv = ["--hf-config", str(hf_dir), *BASE, "--dsa-indexer-warmup", "--dsa-indexer-use-sparse-loss"]
    args = _parse(monkeypatch, argv)
    with pytest.raises(SystemExit, match="dense loss"):
        check_indexer_flags(args, argv)


def test_kda_kernel_flag_is_refused_for_glm5(monkeypatch, hf_dir, model_parallel):
    """``--kda-kernel`` picks GLM-5.3-Flash's KDA kernel; GLM-5 has no KDA layer, so anything but ``auto`` is an
    error that names the flag (not silently ignored)."""
    with _megatron_globals(monkeypatch, hf_dir, extra=("--kda-kernel", "fla")) as (args, arch, _):
        assert args.kda_kernel == "fla"
        with pytest.raises(SystemExit, match="--kda-kernel fla: this model has no KDA layers"):
            model_provider(arch, "megatron")
