"""``dtype: auto``: bfloat16 only where the CPU has native bf16, float32 elsewhere; explicit names
kept; anything else refused naming it."""

from __future__ import annotations

import pytest

from fastserve.kernels.cpu_features import cpu_has_bf16
from fastserve.worker import executor
from fastserve.worker.executor import resolve_dtype


@pytest.mark.parametrize(("native", "expected"), [(True, "bfloat16"), (False, "float32")])
def test_auto_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, native: bool, expected: str) -> None:
    monkeypatch.setattr(executor, "cpu_has_bf16", lambda: native)
    assert resolve_dtype("auto", "cpu") == expected
    # An explicit choice is the user's, whatever the CPU.
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"


def test_auto_on_this_machine_reads_proc_cpuinfo() -> None:
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if cpu_has_bf16() else "float32")


def test_unknown_dtype_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", "cpu")
