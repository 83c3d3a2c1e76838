"""What the benchmark scripts (scripts/bench_*.py) share: the engine-vs-HF timing helpers and the
llama.cpp / vLLM-CPU anchors. Nothing here runs in a training job; importing it imports nothing heavy."""
