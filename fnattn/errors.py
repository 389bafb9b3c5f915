"""The exceptions fnattn raises on purpose. All are ValueError or RuntimeError
subclasses so generic handlers still catch them."""


class StaleStateError(RuntimeError):
    """A State handle was used after a newer handle replaced it."""


class StaleDeltasError(ValueError):
    """Deltas were computed against a different State version than the one applying them."""


class DoubleApplyError(RuntimeError):
    """A step's deltas were applied a second time."""


class PoolExhaustedError(RuntimeError):
    """No free pages or recurrent slots are left for a request."""


class SessionClosedError(RuntimeError):
    """A layer was called through a session that has already exited."""


class LeaseError(RuntimeError):
    """A workspace lease was released twice, or a new lease found one never released."""


class NoBackendError(LookupError):
    """No registered backend accepts a (layer, phase)."""


class OutsideSessionError(RuntimeError):
    """A registered backend was called directly instead of through a session."""


class PurityError(RuntimeError):
    """A backend wrote into a view of the storage it was handed (checked with FNATTN_CHECKS=1)."""
