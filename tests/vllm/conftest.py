"""vLLM's CUDA platform on a machine without a GPU (make test-vllm; scripts/test-vllm.sh).

What is stubbed, and only that:
- ``libcuda.so.1``: vLLM's compiled modules link the CUDA driver; scripts/test-vllm.sh builds a stand-in that
  defines every ``cu*`` function they import, each returning CUDA_ERROR_NO_DEVICE (100), and puts it on
  LD_LIBRARY_PATH. Nothing here calls them.
- the device: vLLM's own ``NvmlCudaPlatform`` with ``get_device_capability`` / ``get_device_name`` answering the
  capability a test sets (NVML has no device to ask), installed as ``vllm.platforms.current_platform`` before any
  other vLLM module is imported.
Everything else (plugin loading, the selector, backend validation, config parsing) is vLLM's own code.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))  # vllm_case.py, reference.py

import vllm.platforms  # noqa: E402

try:
    from vllm.platforms.cuda import NvmlCudaPlatform
except ImportError as e:  # pragma: no cover - the script's job
    raise RuntimeError(f"vLLM's CUDA platform does not import ({e}); run through scripts/test-vllm.sh, which puts "
                       "a libcuda.so.1 stand-in on LD_LIBRARY_PATH") from e
from vllm.platforms.interface import DeviceCapability  # noqa: E402


class CapabilityOnlyCudaPlatform(NvmlCudaPlatform):
    """vLLM's CUDA platform with the device's capability set by the test."""

    capability = DeviceCapability(9, 0)

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return cls.capability

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"GPU of capability {cls.capability.major}.{cls.capability.minor} (test)"


vllm.platforms._current_platform = CapabilityOnlyCudaPlatform()


@pytest.fixture
def capability():
    """Sets the device's compute capability: capability(8, 6)."""
    saved = CapabilityOnlyCudaPlatform.capability

    def set_capability(major: int, minor: int) -> None:
        CapabilityOnlyCudaPlatform.capability = DeviceCapability(major, minor)

    yield set_capability
    CapabilityOnlyCudaPlatform.capability = saved


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """A folder per model holding its real config.json (tests/data/configs), as vLLM's --model takes it."""
    dirs = {}
    for name in ("glm-5", "deepseek-v3.2", "glm-5.3-flash"):
        d = tmp_path_factory.mktemp(name)
        shutil.copy(ROOT / "tests" / "data" / "configs" / f"{name}.json", d / "config.json")
        dirs[name] = d
    return dirs
