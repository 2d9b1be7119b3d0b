"""How an analysis asks for another: through the cache when one is given, else by computing it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def require(analyses: Any | None, analysis: Callable[..., T], subject: Any) -> T:
    """`analyses.get(analysis, subject)` with an AnalysisCache, else `analysis(subject)` uncached."""
    return analysis(subject) if analyses is None else analyses.get(analysis, subject)
