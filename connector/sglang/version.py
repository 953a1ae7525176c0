"""Which SGLang this backend was built and tested against, and the guard that says so.

SGLang's storage interface changes between releases (v1/v2 batch calls, the dynamic loader's
constructor call, `HiCacheStorageExtraInfo`), so a backend written for one release can fail
in silent ways on another. We refuse to start instead.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_VERSIONS = ("0.5.23",)


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not one this backend supports."""


def installed_version() -> str | None:
    """The installed sglang distribution's version, or None when it is not installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_version(found: str | None = None) -> str:
    """Return the SGLang version when supported; raise UnsupportedSGLangVersion otherwise."""
    found = installed_version() if found is None else found
    supported = ", ".join(SUPPORTED_VERSIONS)
    if found is None:
        raise UnsupportedSGLangVersion(
            f"sglang is not installed; the MemPool HiCache backend needs sglang {supported}"
        )
    if found not in SUPPORTED_VERSIONS:
        raise UnsupportedSGLangVersion(
            f"sglang {found} is installed, but the MemPool HiCache backend supports only "
            f"sglang {supported} (its HiCacheStorage interface changes between releases); "
            f"install sglang=={SUPPORTED_VERSIONS[-1]} or use a matching memserve-router"
        )
    return found
