"""Stand-in for torchvision's C++ op library when only a CUDA build of it exists.

The CPU test venv uses PyTorch's CPU build (2.13.0+cpu: about 1 GB installed,
against 5.5 GB for PyPI's CUDA build of 2.14.1 with its nvidia-* wheels).  PyPI's
torchvision wheels for x86_64 link their ``_C`` extension against
``libtorch_cuda.so``, so beside a CPU torch ``_C`` does not load.  torchvision is
built to run without ``_C`` (``extension._has_ops()`` is then False and its C++
ops raise on use), except that ``_meta_registrations`` registers fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` unconditionally, which fails with
"operator torchvision::nms does not exist".  sglang imports
``torchvision.transforms`` at module level (``srt/multimodal/internvl_utils.py``,
reached from ``srt/configs``), so every server-args resolution needs it.

This module declares those two schemas, and only when ``_C`` cannot be loaded
(with a CPU build of torchvision, or a CUDA torch, ``_C`` loads and this does
nothing).  No kernel is registered: calling ``torchvision.ops.nms`` still raises
torchvision's own "Couldn't load custom C++ ops".  ``make venv`` installs it into
the test venv as a ``.pth`` hook that runs just before torchvision is first
imported, so the pytest process and every spawned rank get it; it is never part
of the wheel.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

# Same signatures as torchvision/csrc/ops/nms.cpp and its fake registrations.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None  # keeps the torch.library registration alive


def extension_loads(package_dir: str) -> bool:
    import torch

    for path in glob.glob(os.path.join(package_dir, "_C*.so")):
        try:
            torch.ops.load_library(path)
            return True
        except (ImportError, OSError):
            return False
    return False


def declare_missing_ops(package_dir: str) -> bool:
    """Declare the schemas if torchvision's ``_C`` cannot load; True if declared."""
    global _LIBRARY
    if _LIBRARY is not None or extension_loads(package_dir):
        return False
    import torch

    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _LIBRARY.define(schema)
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations:
            declare_missing_ops(list(spec.submodule_search_locations)[0])
        return spec


def install_hook() -> None:
    if "torchvision" not in sys.modules and not any(
        isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _BeforeTorchvision())


def install_into_venv(site_packages: str) -> None:
    """Copy this module into ``site_packages`` with a ``.pth`` line that hooks it."""
    name = "_sglang_tests_torchvision_ops"
    with open(__file__, encoding="utf-8") as src:
        code = src.read()
    with open(os.path.join(site_packages, name + ".py"), "w", encoding="utf-8") as dst:
        dst.write(code)
    with open(os.path.join(site_packages, name + ".pth"), "w", encoding="utf-8") as dst:
        dst.write(f"import {name}; {name}.install_hook()\n")


if __name__ == "__main__":
    import sysconfig

    install_into_venv(sysconfig.get_paths()["purelib"])
