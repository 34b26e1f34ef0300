"""The real CUDA driver's checkpoint API (needs an NVIDIA GPU host; run by tests/gpu/check.sh there).

Skipped with the reason on hosts without libcuda.so.1 (development and CI machines have no GPU).
"""

from __future__ import annotations

from criuctl.cli import doctor
from criuctl.gpu import cuda
from tests.requirements import needs

pytestmark = needs("gpu")  # no install provides one: a skip with its reason, even under make test


def test_driver_exports_the_checkpoint_api():
    info = cuda.probe()
    assert info.loaded and info.driver_version and info.driver_version >= 12080
    assert info.has_checkpoint_api, f"missing: {set(cuda.CHECKPOINT_SYMBOLS) - set(info.checkpoint_symbols)}"


def test_doctor_reports_the_api():
    check = next(c for c in doctor.run_checks() if c.name == "CUDA checkpoint API")
    assert check.ok and "cuCheckpointProcess" in check.detail
