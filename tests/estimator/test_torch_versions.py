"""torch version strings as vendors build them, and the supported range read from them."""

from __future__ import annotations

import pytest

from xmem_admission.contract.torch_version import (
    TorchVersionError,
    parse,
    supported_range,
    unsupported_reason,
)


@pytest.mark.parametrize("text, release", [
    ("2.6.0", (2, 6, 0)),                          # PyPI
    ("2.14.1+cu130", (2, 14, 1)),                  # PyPI's CUDA builds name their CUDA
    ("2.6.0a0+ecf3bae40a", (2, 6, 0)),             # a source build
    ("2.6.0a0+ecf3bae40a.nv25.01", (2, 6, 0)),     # NVIDIA's NGC containers
    ("2.16.0.dev20261201+cpu", (2, 16, 0)),        # a nightly
    ("2.5.1+rocm6.2", (2, 5, 1)),                  # ROCm
    ("2.3", (2, 3, 0)),                            # no patch
    (" 2.10.0\n", (2, 10, 0)),                     # read from a file
])
def test_vendor_version_strings_are_read_by_their_release(text, release):
    version = parse(text)
    assert (version.major, version.minor, version.patch) == release
    assert version.text == text.strip()


@pytest.mark.parametrize("text", ["", "nightly", "torch", None, "v", "2"])
def test_a_string_with_no_release_is_a_clear_error(text):
    with pytest.raises(TorchVersionError, match="names no MAJOR.MINOR release"):
        parse(text)


@pytest.mark.parametrize("text, refused", [
    ("2.1.2+cu121", True), ("2.0.1", True), ("1.13.1", True),
    ("2.2.0", False), ("2.2.0a0+81ea7a4", False), ("2.15.0", False),
    ("2.16.0.dev20261201", False),   # newer than tested: traced, not refused
])
def test_releases_older_than_the_range_are_refused_with_the_range(text, refused):
    reason = unsupported_reason(text)
    assert (reason is not None) == refused
    if refused:
        assert text in reason and supported_range() in reason
