"""Build the ``pp`` forward kernels of ``tests/gpu/test_kernels_gpu.py``'s option and persistent-grid tests
(``-k "fwd_pp_options or fwd_pp_persistent"``, ``gpu_checks.sh pp_options``), for ``scripts/tl_cache.py`` on a
machine without a GPU, so that the device call compiles none of them:

    python scripts/tl_cache.py build .tlcache/pptests.tar.xz -- python scripts/bench/precompile_pp_tests.py

The options come from the test module (``PP_OPTIONS``); the shapes and CTA counts mirror its parametrisation.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FWD = "megatron_glm5.kernels.sparse_mla_fwd"
PP = (216, 216, 72)
SHAPES = [(64, 576, 1), (128, 576, 1), (64, 512, 1), (16, 576, 4)]  # (heads, d_qk, group)
PERSISTENT = [(132, False), (7, False), (132, True)]  # (ctas, named_exchange)


def cases() -> list[tuple]:
    from tests.gpu.test_kernels_gpu import PP_OPTIONS, SCALE

    out = []
    for heads, d_qk, group in SHAPES:
        out.append((FWD, "_jit_fwd_pp", (heads, d_qk, 512, SCALE, group)))
        out += [(FWD, "_jit_fwd_pp", (heads, d_qk, 512, SCALE, group, PP, *o)) for o in PP_OPTIONS.values()]
        out += [(FWD, "_jit_fwd_pp", (heads, d_qk, 512, SCALE, group, PP, True, True, True, False, named, ctas))
                for ctas, named in PERSISTENT]
    return out


if __name__ == "__main__":
    from bench_dsa_kernels import build_in_parallel

    sys.exit(0 if build_in_parallel(cases(), int(os.environ.get("WORKERS", "2"))) else 1)
