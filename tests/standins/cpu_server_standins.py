"""Stand-ins that let a real ``sglang.launch_server`` run on a CPU-only machine.

Active only in processes started with ``SGLANG_TEST_CPU_SERVER_STANDINS=1``
(the live-server tests and ``make serve-cpu`` set it); ``make venv`` installs
this module into the test venv as a ``.pth`` hook so the server's spawned
scheduler and detokenizer processes get it too.  Elsewhere it does nothing.

* ``sgl_kernel``: sglang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports
  ``*_cpu`` names from ``sgl_kernel`` at module level (``cache_move.py`` and
  others), and sgl-kernel's CPU build is not on PyPI.  When no real
  ``sgl_kernel`` can be found, a lazy module provides any name (and any
  submodule); calling one raises ``NotImplementedError`` naming it, so a path
  that would need a real kernel fails loudly instead of computing nothing, and
  an ``if sgl_kernel.X:`` probe finds it false (not available).
  With no AMX ops registered the CPU engine takes its plain torch paths, which
  is all a tiny model needs.
* HiCache: the host pools pin their buffers with ``cudaHostRegister`` ("Torch
  not compiled with CUDA enabled" on CPU) and bind the ``sgl_kernel.kvcacheio``
  direct-copy ops only on CUDA/ROCm, and the L3 read path allocates each page
  in pinned memory.  When a host-pool module is imported, the stand-ins of
  ``standins.cpu_pinned_memory_standin`` (registration, and the L3 read
  page unpinned on a CPU torch) and ``standins.cpu_kvcacheio_standin`` (torch
  copies with the real ops' per-page semantics) are bound into it.
* DeepSeek MLA on ``torch_native`` (a tiny DeepSeek-V3 on CPU): the handler
  registry has no ``torch_native`` entry; the stand-in registers one that
  takes the absorbed-MLA path (``_torch_native_mla_handler`` says why).
* DeepSeek-V3.2 (DSA) on CPU: the SM query of the DSA server-args hook, the
  indexer's missing torch path, its Hadamard and its triton index-K store
  (``standins.dsa`` says what each one computes and where it raises).
* PD transfer (mooncake): a prefill sender that ``supports_host_tensor_indices``
  stages page indices in pinned host memory behind a ``torch.cuda.Event``
  (``prefill.py`` ``_send_kv_chunk``); on CPU neither exists.  The stand-in sets
  ``MooncakeKVSender.supports_host_tensor_indices = False``, so the prefill
  takes its other branch (``kv_to_page_indices``, same pages, synchronous).
* PD room-open hold (test-only, ``SGLANG_TEST_HOLD_ROOM_OPEN_S``): widens the
  window between a prefill sender's read of its new room and its write
  (``_bind_room_open_hold``), to reproduce the lost bootstrap on a live pair.
* Debug loggers: ``SGLANG_TEST_DEBUG_LOGGERS`` (comma-separated logger names,
  ``harness.pd_stall``) puts those loggers at DEBUG in every server process,
  the rest of the server staying at its ``--log-level``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

ENV = "SGLANG_TEST_CPU_SERVER_STANDINS"
DEBUG_LOGGERS_ENV = "SGLANG_TEST_DEBUG_LOGGERS"
HOLD_ROOM_OPEN_ENV = "SGLANG_TEST_HOLD_ROOM_OPEN_S"
_POOL_MODULES = {
    "sglang.srt.mem_cache.pool_host.common": "pinned",
    "sglang.srt.mem_cache.pool_host.mha": "kvcacheio",
    "sglang.srt.mem_cache.pool_host.mla": "kvcacheio",
    "sglang.srt.mem_cache.pool_host.dsa": "kvcacheio",
    "sglang.srt.disaggregation.mooncake.conn": "mooncake",
    "sglang.srt.models.deepseek_common.attention_backend_handler": "mla_handler",
    "sglang.srt.arg_groups.model_hook": "dsa_capability",
    "sglang.srt.layers.attention.dsa.dsa_indexer": "dsa_indexer",
    "sglang.kernels.ops.kvcache.dsa_index_k_cache": "dsa_index_k_store",
    "sglang.srt.layers.attention.torch_native_backend": "load_record",
}
RECORD_ENV = "SGLANG_TEST_LOAD_RECORD_DIR"  # harness.load_record
_KVCACHEIO_NAMES = (
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_per_layer_direct_pf_lf",
)


class KernelStandIn:
    """A name imported from the stand-in ``sgl_kernel``; raises when called."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._name} is a CPU-server test stand-in: sgl_kernel is not "
            "installed, and this path needs a real kernel"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return KernelStandIn(f"{self._name}.{attr}")

    def __bool__(self) -> bool:
        return False  # an ``if sgl_kernel.X:`` probe: no such kernel here

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


class _LazyKernelModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = KernelStandIn(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _KernelLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _LazyKernelModule(spec.name)
        module.__path__ = []  # a package: submodules come from the finder too
        module.__version__ = "0.0.0+cpu-server-standin"
        return module

    def exec_module(self, module):
        return None


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader, kind: str):
        self._loader = loader
        self._kind = kind

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._kind == "pinned":
            from standins import cpu_pinned_memory_standin as pinned_memory

            module._cuda_host_register = pinned_memory.cuda_host_register_standin
        elif self._kind == "mooncake":
            module.MooncakeKVSender.supports_host_tensor_indices = False
            _bind_room_open_hold(module)
        elif self._kind == "mla_handler":
            module.AttentionBackendRegistry.register(
                "torch_native", _torch_native_mla_handler(module)
            )
        elif self._kind.startswith("dsa_"):
            _bind_dsa(module, self._kind)
        elif self._kind == "load_record":
            _bind_load_record(module)
        else:
            from standins import cpu_kvcacheio_standin as kvcacheio
            from standins import cpu_pinned_memory_standin as pinned_memory

            for name in _KVCACHEIO_NAMES:
                setattr(module, name, getattr(kvcacheio, name))
            pinned_memory.bind_dummy_page_standin(module)
            _bind_load_record(module)


def _bind_room_open_hold(module) -> None:
    """Test-only injection (``SGLANG_TEST_HOLD_ROOM_OPEN_S`` seconds,
    ``scripts/pd_stall_stress.py --hold-room-open``): a prefill scheduler
    thread's read of a room it does not hold yet (the KV sender opening it in
    ``update_status``) returns only after that long, as a thread switch right
    after the read would; the bootstrap thread runs meanwhile."""
    delay = float(os.environ.get(HOLD_ROOM_OPEN_ENV) or 0)
    if delay <= 0:
        return
    import threading
    import time

    class HeldRoomStatus(dict):
        def get(self, key, default=None):
            value = super().get(key, default)
            if value is None and threading.current_thread() is threading.main_thread():
                time.sleep(delay)
            return value

    manager = module.MooncakeKVManager
    init = manager.__init__

    def held_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        prefill = self.disaggregation_mode == module.DisaggregationMode.PREFILL
        if prefill and type(self.request_status) is dict:
            self.request_status = HeldRoomStatus(self.request_status)

    manager.__init__ = held_init


def _torch_native_mla_handler(module):
    """0.5.23 registers no ``torch_native`` entry in the DeepSeek attention
    handler registry, so ``get_handler`` falls back to ``triton``'s, which
    sends prefix-free extends down the MHA path; ``TorchNativeAttnBackend``
    then runs SDPA on the latent pool and fails ("Expected size ... [2, 64]
    but got: [2, 96]"). The stand-in takes the absorbed-MLA path for every
    forward, which the torch_native backend computes in torch. A real
    upstream fix would register the same handler."""

    def handle_attention_torch_native(attn, forward_batch):
        return module._dispatch_mla_subtype(attn, forward_batch)

    return handle_attention_torch_native


def _bind_dsa(module, kind: str) -> None:
    """The DeepSeek-V3.2 stand-ins of ``standins.dsa`` (its docstring says
    which 0.5.23 gap each one bridges)."""
    from standins import dsa

    if kind == "dsa_capability":
        module.handle_model_specific_adjustments = dsa.device_capability_while(
            module.handle_model_specific_adjustments
        )
    elif kind == "dsa_indexer":
        module.rotate_activation = dsa.rotate_activation
        module.Indexer.forward_native = dsa.indexer_forward_native
    else:
        module.SetKAndS.triton = classmethod(dsa.set_k_and_s)


def _bind_load_record(module) -> None:
    """With ``SGLANG_TEST_LOAD_RECORD_DIR`` set (live rank-shard tests only):
    ``harness.load_record``'s record of the prefix rows attention reads, and
    its corrupted-host-page negative controls."""
    directory = os.environ.get(RECORD_ENV)
    if not directory:
        return
    from harness import load_record

    if module.__name__ == "sglang.srt.layers.attention.torch_native_backend":
        backend = module.TorchNativeAttnBackend
        backend.forward_extend = load_record.recording_forward_extend(
            backend.forward_extend, directory
        )
        backend.forward_decode = load_record.recording_forward_decode(
            backend.forward_decode, directory
        )
        return
    h2d = load_record.recording_h2d(
        module.transfer_kv_per_layer_direct_pf_lf,
        directory,
        module.__name__.rpartition(".")[2],
    )
    trigger = load_record.TRIGGERS.get(module.__name__)
    if trigger:
        h2d = load_record.corrupting_h2d(h2d, directory, trigger)
    module.transfer_kv_per_layer_direct_pf_lf = h2d


class CpuServerFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._real_kernel = None

    def _real_spec(self, fullname, path):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path)
            if spec is not None:
                return spec
        return None

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top == "sgl_kernel":
            if self._real_kernel is None:
                self._real_kernel = self._real_spec("sgl_kernel", None) is not None
            if self._real_kernel:
                return None
            return importlib.machinery.ModuleSpec(
                fullname, _KernelLoader(), is_package=True
            )
        kind = _POOL_MODULES.get(fullname)
        if kind is None:
            return None
        spec = self._real_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchAfterExec(spec.loader, kind)
        return spec


def install_hook(tests_dir: str) -> None:
    if os.environ.get(ENV) != "1":
        return
    if any(isinstance(f, CpuServerFinder) for f in sys.meta_path):
        return
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)
    sys.meta_path.insert(0, CpuServerFinder())
    _debug_loggers(os.environ.get(DEBUG_LOGGERS_ENV, ""))


def _debug_loggers(names: str) -> None:
    """The named loggers at DEBUG: a logger's own level outlasts sglang's
    ``configure_logger`` (``basicConfig(force=True)`` resets the root only)."""
    import logging

    for name in filter(None, (n.strip() for n in names.split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)


def install_into_venv(site_packages: str) -> None:
    """Copy this module into ``site_packages`` with a ``.pth`` line that hooks it."""
    name = "_sglang_tests_cpu_server"
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(__file__, encoding="utf-8") as src:
        code = src.read()
    with open(os.path.join(site_packages, name + ".py"), "w", encoding="utf-8") as dst:
        dst.write(code)
    with open(os.path.join(site_packages, name + ".pth"), "w", encoding="utf-8") as dst:
        dst.write(f"import {name}; {name}.install_hook({tests_dir!r})\n")


if __name__ == "__main__":
    import sysconfig

    install_into_venv(sysconfig.get_paths()["purelib"])
