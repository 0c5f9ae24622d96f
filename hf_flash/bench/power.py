"""The GPU's SM clock and its energy counter, read through NVML (``libnvidia-ml.so.1``, which every NVIDIA driver
installs), for the benchmarks' sustained timing: after a second or so of back-to-back work an H100 runs at its
board power limit, and the clock that limit leaves, not the kernel's schedule alone, sets the speed. Two kernels
doing the same FLOPs then differ by the energy each spends on them."""
from __future__ import annotations

import ctypes

_NVML_CLOCK_SM = 1


class Meter:
    """SM clock (MHz) and the board's energy counter (mJ since the driver loaded) of the GPU torch calls
    ``device``. Construction raises OSError / RuntimeError where NVML is missing; ``meter()`` returns None then."""

    def __init__(self, device: int = 0):
        import torch

        self._lib = lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(lib.nvmlInit_v2(), "nvmlInit")
        self._handle = ctypes.c_void_p()
        props = torch.cuda.get_device_properties(device)
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:  # NVML numbers GPUs unlike CUDA_VISIBLE_DEVICES may: find this one by its PCI address
            pci = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            self._check(lib.nvmlDeviceGetHandleByPciBusId_v2(pci, ctypes.byref(self._handle)), "handle by PCI id")
        else:
            self._check(lib.nvmlDeviceGetHandleByIndex_v2(device, ctypes.byref(self._handle)), "handle by index")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVML {what} failed (status {status})")

    def clock_mhz(self) -> float:
        mhz = ctypes.c_uint()
        self._check(self._lib.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)), "SM clock")
        return float(mhz.value)

    def energy_mj(self) -> float:
        mj = ctypes.c_ulonglong()
        self._check(self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(mj)), "energy")
        return float(mj.value)


def meter(device: int = 0) -> Meter | None:
    """A Meter, or None where NVML cannot be read (no driver library, a GPU without an energy counter)."""
    try:
        m = Meter(device)
        m.clock_mhz(), m.energy_mj()
    except (OSError, RuntimeError, AttributeError):
        return None
    return m
