"""What an adapter does when kvcore itself fails during an engine call.

An engine call kvcore cannot finish goes to the engine's stock copy, counted under
``internal_error:<ExceptionType>`` and logged once per kind, so that a bug in kvcore
costs speed, not the engine's scheduler. One failure is different: a CUDA error raised
after a launch leaves the device in doubt; stock would run on a device in an unknown
state and a retry would hide the fault, so that one is re-raised.
"""

from __future__ import annotations

import logging

import torch


def device_in_doubt(exc: BaseException) -> bool:
    """Whether ``exc`` says the device's state is unknown (an error reported by CUDA)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


class InternalErrors:
    """Turns a failure inside one adapter's hook into the reason its call passes to stock."""

    def __init__(self, engine: str, logger: logging.Logger) -> None:
        self._engine = engine
        self._logger = logger
        self._logged: dict[str, str] = {}

    def reason(self, exc: Exception) -> str:
        """``internal_error:<type>`` for ``exc``, logged the first time that type is seen;
        re-raises ``exc`` when the device is in doubt."""
        if device_in_doubt(exc):
            raise exc
        reason = f"internal_error:{type(exc).__name__}"
        if reason not in self._logged:
            first_line = str(exc).splitlines()[0][:200] if str(exc) else "no message"
            self._logged[reason] = first_line
            self._logger.warning(
                "kvcore: %s inside a %s transfer hook (%s); that call and later ones like it "
                "run %s's stock copy",
                type(exc).__name__,
                self._engine,
                first_line,
                self._engine,
            )
        return reason

    def seen(self) -> dict[str, str]:
        """Each reason seen since the last :meth:`forget`, with its first failure's message."""
        return dict(self._logged)

    def forget(self) -> None:
        """Log every kind again (a new engine instance, or a test)."""
        self._logged.clear()
