"""radixlm: a fast runtime for structured language-model programs."""

__version__ = "0.1.0"

from radixlm.core.engine.engine import Engine  # noqa: E402
from radixlm.adapters.native import *  # noqa: E402,F401,F403  (the SGLang frontend language: `import radixlm as sgl`)
