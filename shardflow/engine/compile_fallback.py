"""``torch.compile`` where it works, the eager function where it does not.

Compilation happens at the first call, deep inside generation; a compiler failure there (an
unsupported pattern, a code-generation bug of one torch release) must cost speed, not the run.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch

from shardflow.models import compile_settings

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)


def compiled_or_eager(fn: F, what: str, *, fallback: dict | None = None, **compile_options) -> F:
    """``torch.compile(fn, **compile_options)``; if a call of the compiled version raises, warn naming
    ``what`` and the error, then compile ``fn`` again with ``torch.compile(fn, **fallback)`` where
    given (settings that a torch release may not handle, left out), and at a second failure run
    ``fn`` itself for this call and every later one. An error that is not the compiler's raises
    again from the eager call."""
    compile_settings.apply()
    # Passing dynamo's recompile limit (raised there) is made an error, so that it falls back below
    # with a warning instead of running eager unannounced.
    strict = {"fail_on_recompile_limit_hit": True}
    if not hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):  # a torch release without it
        strict = {}
    attempts = [compile_options] + ([fallback] if fallback is not None else [])
    compiled = torch.compile(fn, **attempts.pop(0))

    def run(*args, **kwargs):
        nonlocal compiled
        while compiled is not None:
            try:
                with torch._dynamo.config.patch(**strict):
                    return compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, say so
                then = f"compiling it again with {attempts[0]}" if attempts else "running it eager"
                logger.warning(f"torch.compile of {what} failed, {then}: {type(e).__name__}: {str(e)[:2000]}")
                compiled = torch.compile(fn, **attempts.pop(0)) if attempts else None
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
