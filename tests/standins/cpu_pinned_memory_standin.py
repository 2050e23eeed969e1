"""Stand-in for pinned-memory registration (``cudaHostRegister``) on CPU.

The host pools built through the assembler always ask for pinned memory;
``sglang.srt.mem_cache.pool_host.common._cuda_host_register`` then calls into
the CUDA driver ("Found no NVIDIA driver" on CPU).  The stand-in records what
would have been registered and leaves the buffer as ordinary memory.
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


def install() -> None:
    from sglang.srt.mem_cache.pool_host import common

    common._cuda_host_register = cuda_host_register_standin
