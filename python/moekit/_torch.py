"""torch, where it is installed, imported before moekit's native module. A CUDA build of the module
needs libnccl.so.2 (NCCL's device API is compiled into it) and the first libnccl.so.2 a process loads
serves everyone: importing torch first makes it torch's own (the version moekit is built against),
where an older one first on LD_LIBRARY_PATH would break torch's import. A torch that is installed
but does not import is an error with its reason, never "torch is not installed"."""
from __future__ import annotations


def import_torch():
    """torch, or None where it is not installed (moekit then runs on NumPy arrays)."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":  # torch is there, one of its own imports is not
            raise ImportError(f"moekit: torch is installed but does not import: {e}") from e
        return None
    except (ImportError, OSError) as e:
        raise ImportError(f"moekit: torch is installed but does not import: {e}. Where it names an NCCL or CUDA "
                          "symbol or library, another version of that library was loaded first (LD_LIBRARY_PATH, "
                          "LD_PRELOAD, or a module imported before torch): import torch first or fix the path; "
                          "without torch, uninstall it and moekit runs on NumPy arrays") from e
    return torch
