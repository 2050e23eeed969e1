"""The test venv's torchvision import hook (tests/standins/torchvision_ops.py)."""

import subprocess
import sys

PROBE = """
import sys
import torchvision.transforms as T
import torchvision
import torch
from torchvision.transforms.functional import InterpolationMode

print("has_ops", torchvision.extension._has_ops())
hook = sys.modules.get("_sglang_tests_torchvision_ops")
print("hook", hook is not None)
if hook is not None:
    print("declared", hook._LIBRARY is not None)
try:
    torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
    print("nms ran")
except RuntimeError as e:
    print("nms raised", "Couldn't load custom C++ ops" in str(e))
img = T.Compose([T.ToTensor(), T.Normalize(mean=(0.5,), std=(0.5,))])
from PIL import Image
out = img(Image.new("L", (2, 2), color=255))
print("transform", out.flatten().tolist())
"""


def test_torchvision_imports_in_a_fresh_interpreter():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    lines = dict(line.split(" ", 1) for line in out if line)
    # The pure-Python part of torchvision works (a real transform on a real image).
    assert lines["transform"] == "[1.0, 1.0, 1.0, 1.0]"
    if lines["has_ops"] == "True":
        # torchvision's own extension loaded: the hook must have declared nothing.
        assert lines.get("declared", "False") == "False"
        assert lines["nms"] == "ran"
    else:
        # The hook declared the schemas and registered no kernel: nms still raises
        # torchvision's own error.
        assert lines["hook"] == "True" and lines["declared"] == "True"
        assert lines["nms"] == "raised True"
