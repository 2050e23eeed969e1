"""Stand-in for pinned-memory registration (``cudaHostRegister``) on CPU.

The host pools built through the assembler always ask for pinned memory;
``sglang.srt.mem_cache.pool_host.common._cuda_host_register`` then calls into
the CUDA driver ("Found no NVIDIA driver" on CPU).  The stand-in records what
would have been registered and leaves the buffer as ordinary memory.

The L3 read path allocates each page it reads in pinned memory
(``get_dummy_flat_data_page`` of the MLA KV and DSA indexer host pools:
``torch.zeros(..., pin_memory=True)``), which a CPU torch refuses
("pin_memory=True requires a CUDA or other accelerator backend").  Its stand-in
runs the real method on a view of the pool whose ``pin_memory`` reads False:
the same shape, dtype and device, in ordinary memory.  It is only effective on
a torch without CUDA; with CUDA the real method runs unchanged.
"""

from __future__ import annotations

UPSTREAM_TEST_MODULE = "sglang.test.cpu_pinned_memory_standin"

REGISTERED: list[tuple[int, int]] = []


def cuda_host_register_standin(buffer, registration_granularity_bytes=None):
    from sglang.srt.mem_cache.pool_host import common

    total = buffer.numel() * buffer.element_size()
    REGISTERED.append((buffer.data_ptr(), total))
    # Nothing was registered with the driver, so destroy() must not unregister.
    setattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR, [])


class _WithoutPinning:
    """A read-only view of a host pool whose ``pin_memory`` is False."""

    def __init__(self, pool):
        object.__setattr__(self, "_pool", pool)

    def __getattr__(self, name):
        return False if name == "pin_memory" else getattr(self._pool, name)


def unpinned_dummy_flat_data_page_standin(method):
    """Wrap a host pool class's ``get_dummy_flat_data_page`` (see above)."""
    import torch

    if torch.cuda.is_available() or getattr(method, "_cpu_standin", False):
        return method

    def get_dummy_flat_data_page(self):
        return method(_WithoutPinning(self))

    get_dummy_flat_data_page._cpu_standin = True
    return get_dummy_flat_data_page


def bind_dummy_page_standin(module) -> None:
    """Bind the stand-in into ``pool_host.mla`` or ``pool_host.dsa``."""
    for name in ("MLATokenToKVPoolHost", "DSAIndexerPoolHost"):
        cls = getattr(module, name, None)
        if cls is not None:
            cls.get_dummy_flat_data_page = unpinned_dummy_flat_data_page_standin(
                cls.get_dummy_flat_data_page
            )


def install() -> None:
    from sglang.srt.mem_cache.pool_host import common, dsa, mla

    common._cuda_host_register = cuda_host_register_standin
    bind_dummy_page_standin(mla)
    bind_dummy_page_standin(dsa)
