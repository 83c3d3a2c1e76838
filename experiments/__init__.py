"""Experiment drivers behind the README's and docs' result tables (`compare_methods.py`: the four
rollout methods on one task; `quality_real_model.py`: FP4 quality on a real Qwen2.5). Run from the
repository root as `python experiments/NAME.py`; `--help` says what each writes."""
