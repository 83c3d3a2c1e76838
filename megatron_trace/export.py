"""`python -m megatron_trace.export`: see megatron_trace/transfer/export.py."""
from __future__ import annotations

import sys

from megatron_trace.transfer.export import main

if __name__ == "__main__":
    sys.exit(main())
