"""What every benchmark's JSON records about its run: the command line, the git
revision, the series label (the wheel's local version label for the committed
patches) and the machine (no paths); and where a run's files go: one folder per
run, ``results/<YYYYMMDDTHHMMZ>-<measurement>/`` (UTC start time)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The GPU host's copy of the tree carries the revision and label of the tree
# it was made from here (gpu_bundle.sh writes it). That copy may hold a .git
# of an older commit than its files, so the record, not git, is read there:
# wherever SGL_BENCH_BUNDLED=1 (gpu_session.sh sets it) or there is no .git.
BUNDLED = ROOT / ".gpu" / "revision.json"


def _bundled(key: str) -> str | None:
    """``key`` of the bundle's record, on the GPU host's copy only."""
    if os.environ.get("SGL_BENCH_BUNDLED") != "1" and (ROOT / ".git").exists():
        return None
    try:
        return json.loads(BUNDLED.read_text())[key]
    except (OSError, ValueError, KeyError):
        if os.environ.get("SGL_BENCH_BUNDLED") == "1":
            raise RuntimeError(
                f"SGL_BENCH_BUNDLED=1 but {BUNDLED} has no {key!r}: run "
                "benchmark/hicache_rank_shard/gpu_bundle.sh"
            ) from None
        return None


def git_revision() -> str:
    bundled = _bundled("git_revision")
    if bundled:
        return bundled
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except Exception:
        return "unknown"


def series_label() -> str:
    """The local version label ``make wheel`` gives the series as committed."""
    bundled = _bundled("series_label")
    if bundled:
        return bundled
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from build_wheel import default_label

        return default_label()
    except Exception:
        return "unknown"
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def run_dir(out: str | Path, measurement: str) -> Path:
    """The run folder ``<out>/<UTC start>-<measurement>/``, created."""
    stamp = time.strftime("%Y%m%dT%H%MZ", time.gmtime())
    path = Path(out) / f"{stamp}-{measurement}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def gpu_names(device: str) -> list[str]:
    """The GPU a run on ``device`` used (none for the CPU)."""
    import torch

    if torch.device(device).type != "cuda":
        return []
    return [torch.cuda.get_device_name(torch.device(device).index or 0)]


def command_line() -> str:
    """The command as run from the repository root: ``python -m <module> ARGS``
    for a module (every benchmark), ``python <script> ARGS`` otherwise."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return " ".join([Path(sys.executable).name, *argv])


def run_metadata() -> dict:
    return {
        "command": command_line(),
        "git_revision": git_revision(),
        "series_label": series_label(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    }


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated
    between the two nearest ranks (numpy's default); None for no values.
    Every benchmark's percentiles come from here."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
