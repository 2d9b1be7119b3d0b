"""`dpcs`: the name of dpcs_compiler's loggers ("dpcs.pipeline", "dpcs.runtime", ...), importable so that
torch's `TORCH_LOGS="+dpcs"` finds it. torch parses TORCH_LOGS when it is imported, before any plugin can
register a name of its own; an importable module name is what it accepts then. (A one-file module: torch
imports a package it finds there to list its submodules, which would import dpcs_compiler inside torch's
own import.) Importing it gives dpcs_compiler's public API."""

from dpcs_compiler import *  # noqa: F401,F403
from dpcs_compiler import __all__, __version__  # noqa: F401
