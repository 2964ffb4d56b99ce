"""The sparse indexer loss's per-row KL kernel (:mod:`megatron_glm5.kernels.indexer_kl`, Triton) against its torch
oracle ``kernels.indexer_loss.kl_loss_and_dscore_``, on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set
in a subprocess so no other test sees it): the loss and ``dscore`` agree to fp32 rounding (summation orders differ),
on rows with -1 holes, a key past ``n_keys``, a duplicated key, an empty row, a zero-weight row and a width that is not
a power of two."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import torch
    from megatron_glm5.kernels.indexer_kl import kl_rows_and_dscore_, kl_supported
    from megatron_glm5.kernels.indexer_loss import kl_loss_and_dscore_

    torch.manual_seed(0)
    t_len, k, n_keys = 9, 37, 30
    topk = torch.stack([torch.randperm(n_keys)[:k] if k <= n_keys else torch.cat(
        [torch.randperm(n_keys), torch.full((k - n_keys,), -1)]) for _ in range(t_len)]).int()
    topk[1, ::3] = -1                      # holes
    topk[2, 5] = n_keys + 4                # past the last key: invalid
    topk[3, 7] = topk[3, 2]                # the same key in two slots
    topk[4] = -1                           # no valid slot
    score = torch.randn(t_len, k) * 3
    valid = (topk >= 0) & (topk < n_keys)
    target = torch.rand(t_len, k) * valid
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    target[6, :4] = 0.0                    # zero target slots (the log is clamped)
    rw = torch.full((t_len,), 0.25)
    rw[5] = 0.0                            # a valid row with zero weight
    assert kl_supported(score)
    got_s, ref_s = score.clone(), score.clone()
    rows = kl_rows_and_dscore_(got_s, target, rw, topk, n_keys)
    ref = kl_loss_and_dscore_(ref_s, target, rw, topk, n_keys)
    assert rows.shape == (t_len,) and rows[4] == 0 and rows[5] == 0
    assert abs(float(rows.sum()) - float(ref)) <= 1e-6 * abs(float(ref)), (float(rows.sum()), float(ref))
    assert torch.equal(got_s[~valid], torch.zeros_like(got_s[~valid])), "dscore is 0 on invalid slots"
    err = float((got_s - ref_s).abs().max() / ref_s.abs().max())
    assert err <= 1e-6, err
    for bad in (dict(target=target.double()), dict(topk=topk.long()), dict(rw=rw[:3])):
        args = dict(score=score.clone(), target=target, rw=rw, topk=topk, n_keys=n_keys) | bad
        try:
            kl_rows_and_dscore_(**args)
        except ValueError as e:
            assert next(iter(bad)) in str(e), e
        else:
            raise AssertionError(f"{bad} was accepted")
    print("OK", err)
''')


def test_kl_kernel_matches_the_torch_glue_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
