"""Device memory that an idle engine gives back and takes again: the KV cache of sleep
mode (``rollout.enable_sleep_mode``, docs/engine.md).

The paged engine's CUDA graphs bake the KV cache's address into every replay, so the
memory must come back at the same address. On CUDA this is the driver's virtual memory
management (the mechanism of vLLM's sleep mode and SGLang's memory saver): a virtual
range is reserved once, and physical memory is created and mapped into it on
:meth:`SleepableBuffer.restore`, unmapped and released on :meth:`SleepableBuffer.release`.
Elsewhere (the CPU; CUDA without ``cuda-bindings``) the tensor's storage is resized to
nothing and back: its views stay valid, its address does not, so the caller drops what
holds the address (the CUDA graphs) -- :attr:`SleepableBuffer.keeps_address` says which.

Restored memory is zeroed: keys past a row's context are read (masked), never NaN.
"""

from __future__ import annotations

import logging

import torch

from ..schemas.errors import EngineError

log = logging.getLogger(__name__)


class SleepableBuffer:
    """``nbytes`` of device memory as a uint8 tensor (:attr:`tensor`), releasable."""

    keeps_address = False

    # Sizes are rounded up to this (the CUDA driver's granularity is 2 MiB; here a page,
    # so the CPU tests see a buffer longer than asked, as the GPU gives).
    GRANULARITY = 4096

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = -(-int(nbytes) // self.GRANULARITY) * self.GRANULARITY
        self.device = device
        self.tensor = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.asleep = False

    def release(self) -> None:
        """Give the memory back (nothing may use the tensor until :meth:`restore`)."""
        if self.asleep:
            return
        self.tensor.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.asleep = True

    def restore(self) -> None:
        """Take the memory again, zeroed."""
        if not self.asleep:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        self.tensor.zero_()
        self.asleep = False

    def close(self) -> None:
        pass


class VmmBuffer(SleepableBuffer):
    """The CUDA driver's virtual memory: the address stays across release / restore."""

    keeps_address = True

    def __init__(self, nbytes: int, device: torch.device) -> None:
        from cuda.bindings import driver

        self._d = driver
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        torch.empty(1, device=device)  # the primary context exists and is current here
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        gran = self._check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity")
        self.nbytes = -(-int(nbytes) // int(gran)) * int(gran)
        self._va = self._check(driver.cuMemAddressReserve(self.nbytes, 0, 0, 0), "cuMemAddressReserve")
        self._handle = None
        self.asleep = True
        self._map()
        ptr = int(self._va)
        nbytes_ = self.nbytes

        class _Iface:  # torch.as_tensor reads __cuda_array_interface__ and keeps this alive
            __cuda_array_interface__ = {"shape": (nbytes_,), "typestr": "|u1", "data": (ptr, False),
                                        "version": 3, "strides": None}

        self.tensor = torch.as_tensor(_Iface(), device=device)
        if self.tensor.data_ptr() != ptr:
            raise EngineError("the KV cache's virtual range did not map into a tensor in place")
        self.tensor.zero_()

    def _check(self, result, what: str):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise EngineError(f"CUDA virtual memory ({what}) failed with {err!r}; set "
                              "rollout.enable_sleep_mode=false")
        return rest[0] if len(rest) == 1 else (rest or None)

    def _map(self) -> None:
        d = self._d
        self._handle = self._check(d.cuMemCreate(self.nbytes, self._prop, 0), "cuMemCreate")
        self._check(d.cuMemMap(self._va, self.nbytes, 0, self._handle, 0), "cuMemMap")
        access = d.CUmemAccessDesc()
        access.location = self._prop.location
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._check(d.cuMemSetAccess(self._va, self.nbytes, [access], 1), "cuMemSetAccess")
        self.asleep = False

    def release(self) -> None:
        if self.asleep:
            return
        torch.cuda.synchronize(self.device)  # no kernel may still read or write it
        self._check(self._d.cuMemUnmap(self._va, self.nbytes), "cuMemUnmap")
        self._check(self._d.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None
        self.asleep = True

    def restore(self) -> None:
        if not self.asleep:
            return
        self._map()
        self.tensor.zero_()

    def close(self) -> None:
        if getattr(self, "_va", None) is None:
            return
        try:
            if not self.asleep:
                torch.cuda.synchronize(self.device)
                self._d.cuMemUnmap(self._va, self.nbytes)
                self._d.cuMemRelease(self._handle)
            self._d.cuMemAddressFree(self._va, self.nbytes)
        finally:
            self._va = None


def sleepable_buffer(nbytes: int, device: torch.device) -> SleepableBuffer:
    """A :class:`VmmBuffer` on CUDA where ``cuda-bindings`` imports and works, else the
    resizing :class:`SleepableBuffer` (whose address changes: the caller re-captures)."""
    if device.type == "cuda":
        try:
            return VmmBuffer(nbytes, device)
        except ImportError:
            log.info("sleep mode: cuda-bindings is not installed; the KV cache is freed and "
                     "reallocated, and the CUDA graphs captured again after each sleep")
        except EngineError as exc:
            log.warning("sleep mode: %s; falling back to freeing and reallocating", exc)
    return SleepableBuffer(nbytes, device)
