"""Benchmarks: scripts that time or size one part side by side in one run (`BENCHMARKS.md` keeps the
latest figures with the command behind each). Run from the repository root, as
`python benchmarks/NAME.py` or `python -m benchmarks.NAME`; their shared helpers are
`megatron_trace.bench`. Nothing here is installed or imported by a training job."""
