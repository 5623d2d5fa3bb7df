"""Warnings attributed to the user's line.

A fixed ``stacklevel`` names whichever odegrad frame happens to sit that deep, and that depth
differs between an eager ``og.solve``, one under ``jax.jit`` and an adjoint's trace: Rodas5's
warning named ``_loop.py``. Attributing a warning to the frame that called into odegrad names the
user's line, and Python's default filter then shows it once per such line, however
often that line is traced again.
"""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(os.sep + name + os.sep for name in ("jax", "jaxlib", "equinox"))


def warn_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the line that called into odegrad.

    Example:
        >>> warn_user("og.solve: ... ; pass events=...")  # names the caller's og.solve line
    """
    # frames[i] is warnings.warn's stacklevel i + 2; JAX's tracing frames sit between
    # odegrad's, so the user's line is past the outermost odegrad frame, and past JAX's own
    # frames above it (a backward pass is traced from the user's jax.grad call)
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame.f_code.co_filename)
        frame = frame.f_back
    ours = [i for i, name in enumerate(frames) if name.startswith(_PACKAGE)]
    i = ours[-1] + 1 if ours else 0
    while i < len(frames) - 1 and any(part in frames[i] for part in _LIBRARIES):
        i += 1
    warnings.warn(message, category, stacklevel=i + 2)
