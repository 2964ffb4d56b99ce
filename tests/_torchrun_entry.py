"""torchrun entry for tests/distributed.py: python _torchrun_entry.py module:function out_dir json_kwargs."""

import importlib
import json
import os
import sys
from pathlib import Path
from megatron_glm5.parallel import destroy_model_parallel

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> None:
    target, out_dir, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    dump_after = float(os.environ.get("GLM5_TORCHRUN_DUMP_AFTER", "0"))
    if dump_after > 0:  # a hang (a collective one rank never joins): print every thread's stack before the kill
        import faulthandler

        faulthandler.dump_traceback_later(dump_after, exit=False)
    import torch.distributed as dist

    from megatron_glm5.cpu import enable_cpu_mode

    enable_cpu_mode()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mod_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    result = fn(rank, world, **kwargs)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            destroy_model_parallel()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
