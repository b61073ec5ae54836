"""Environment switches of the daemon, all in one place and all ``SERVICER_*``.

``SERVICER_DISABLE_NATIVE_KERNELS=1`` runs every CPU op on the torch paths;
``SERVICER_PROFILE_MAX_STEPS`` sets after how many steps a profile stops. Each is read when
first asked for, so a test may set it before use. Variables owned by other tools
(``TRITON_INTERPRET``, ``CC``, ``XDG_CACHE_HOME``, SGLang's ``SGLANG_TORCH_PROFILER_DIR``: the
profile directory when ``--profile-dir`` is not given) are read here too.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def native_kernels_disabled() -> bool:
    return os.environ.get("SERVICER_DISABLE_NATIVE_KERNELS") == "1"


def profile_dir() -> str | None:
    """SGLang's variable for where traces go; unset: profiling is off."""
    return os.environ.get("SGLANG_TORCH_PROFILER_DIR") or None


def profile_max_steps(default: int) -> int:
    value = os.environ.get("SERVICER_PROFILE_MAX_STEPS", "")
    try:
        return max(int(value), 1) if value else default
    except ValueError:
        logger.warning("SERVICER_PROFILE_MAX_STEPS=%r is not a number; using %d", value, default)
        return default


def triton_interpreter() -> bool:
    """Triton kernels run on the CPU (tests only) under ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def c_compiler() -> str | None:
    return os.environ.get("CC")


def cache_home() -> str:
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
