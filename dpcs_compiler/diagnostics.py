"""The warning category of everything dpcs warns about.

Every warning dpcs gives is a `DpcsWarning` (a `UserWarning`), so a program or a test suite can turn dpcs's
warnings into errors without touching torch's or a library's: `python -W error::dpcs_compiler.DpcsWarning`,
or `warnings.filterwarnings("error", category=DpcsWarning)`. `DpcsFallbackWarning` (a graph compiled by plain
Inductor instead) is one.
"""

from __future__ import annotations


class DpcsWarning(UserWarning):
    """Something dpcs did that the user should know: a plan that does not fit, a fallback, a setting left off."""
