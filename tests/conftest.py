"""Shared pytest setup."""

import os

# Triton fixes interpreter mode when its jit decorators run (at kernel-module import), so this
# must precede any triton import; scripts/test.sh exports it too, this covers direct pytest runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build their models; nothing comes from a hub

from hypothesis import settings  # noqa: E402

# CI replays the same examples every run (a red CI is then reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
