"""Lets the CUDA build of torchvision (what PyPI serves) import against CPU torch.

Its `_C.so` cannot load without CUDA torch, and `torchvision/_meta_registrations.py` then dies
registering fakes for `torchvision::nms`/`qnms`, which nobody defined. SGLang imports
torchvision unconditionally (and never runs its ops for a text model). This module, imported
by a .pth at interpreter start, waits for the first `import torchvision` and defines just the
two op schemas (no kernels: calling them raises torch's "no kernel" error) right before it.
Torch is not imported until torchvision is.
"""

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


class _Hook(importlib.abc.MetaPathFinder):
    done = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision" or _Hook.done:
            return None
        _Hook.done = True
        import torch

        if torch.version.cuda is None and not hasattr(torch.ops.torchvision, "nms"):
            lib = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901 - schema only
            for s in SCHEMAS:
                lib.define(s)
            _KEEP.append(lib)
        return None  # the normal finders import torchvision itself


_KEEP: list = []
if not any(isinstance(f, _Hook) for f in sys.meta_path):
    sys.meta_path.insert(0, _Hook())
