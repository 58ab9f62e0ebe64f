"""radixlm: a fast runtime for structured language-model programs."""

import importlib.util
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # `radixlm.Engine` and the SGLang frontend language (`import radixlm as sgl; sgl.gen(...)`) are
    # imported on first use, so that the command line answers --help and its pre-load checks at once
    # instead of after importing torch.
    if name == "Engine":
        from radixlm.core.runtime.engine import Engine

        return Engine
    # `from radixlm import server` asks here before importing the submodule: not the frontend for that.
    if not name.startswith("__") and importlib.util.find_spec(f"radixlm.{name}") is None:
        import radixlm.adapters.native as native

        if name in native.__all__:
            return getattr(native, name)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")


def __dir__() -> list[str]:
    import radixlm.adapters.native as native

    return sorted([*globals(), "Engine", *native.__all__])
