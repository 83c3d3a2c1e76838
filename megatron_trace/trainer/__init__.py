"""Megatron-Core training side: CPU compatibility, process groups, GPTModel build/load/export.

Submodules import megatron lazily where they can; import `gpt` / `parallel` explicitly.
"""
