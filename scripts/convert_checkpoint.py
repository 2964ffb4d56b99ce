#!/usr/bin/env python
"""Thin wrapper: ``python scripts/convert_checkpoint.py import|export|roundtrip ...`` is
``megatron-glm5 convert import|export|roundtrip ...`` (see ``megatron-glm5 convert --help``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bridge.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
