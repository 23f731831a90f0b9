import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_reason() -> str | None:
    try:
        from cuda.bindings import driver
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"cuda-bindings not importable: {e}"
    try:
        # Without a driver (CI), cuda-bindings 13 raises from cuInit instead of returning an error.
        (err,) = driver.cuInit(0)
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"no CUDA driver: {e}"
    if int(err) != 0:
        return f"cuInit failed ({err}): no usable GPU"
    err, n = driver.cuDeviceGetCount()
    if int(err) != 0 or n == 0:
        return "no CUDA device"
    return None


_REASON: list = []


def gpu_skip_reason() -> str | None:
    if not _REASON:
        _REASON.append(_cuda_reason())
    return _REASON[0]


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            if reason is None:
                reason = gpu_skip_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def host():
    from runtime.host_backend import HostBackend

    return HostBackend()
