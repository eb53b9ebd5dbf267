"""``python -m lib_vram``: the VRAM Guard command line."""

from __future__ import annotations

import sys

from lib_vram.cli import main

if __name__ == "__main__":
    sys.exit(main())
