"""What a request on the RAPID engine (`AsyncEngine`, engine/client.py) fails with: `EngineError` and its kinds."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The request could not be completed: a worker died, the engine is down, or it was refused."""


class RequestRejected(EngineError, ValueError):
    """The request cannot be served as given (an empty prompt, a token id outside the vocabulary...)."""


class ConstraintFailed(EngineError):
    """The request ended with an error because the grammar engine could not serve its structured-output
    constraint (`Finished.fault` "structured_outputs"): the request's fault, not the engine's; the
    message names the constraint and the engine's reason."""
