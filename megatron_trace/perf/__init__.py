"""Performance and memory models and what the benchmark scripts (benchmarks/*.py) share: the rollout
roofline (`roofline`), the rest of the RL step (`step`), the trainer's memory per rank (`memory`,
`python -m megatron_trace.perf.memory`), the report's tables, the engine-vs-HF timing helpers and the
llama.cpp / vLLM-CPU anchors. Importing it imports nothing heavy."""
