"""The exceptions xfer raises: every one is an ``xfer.Error``.

Where a builtin means the same thing, the class also derives from it, so ``except
TimeoutError`` and ``except ValueError`` catch what a Python user expects them to.
"""

import builtins


class Error(Exception):
    """Base class of every error the engine reports."""


class InvalidArgumentError(Error, ValueError):
    """Bad input: a wrong type, a zero length, an unknown handle, a handle of another engine."""


class OutOfBoundsError(InvalidArgumentError, IndexError):
    """A range past the end of a registered region."""


class ConfigError(Error, ValueError):
    """The configuration (file or dict) is malformed or inconsistent."""


class DecodeError(Error, ValueError):
    """Bytes that are not a valid ``NetAddr`` or ``MrDesc``."""


class TimeoutError(Error, builtins.TimeoutError):
    """An operation or expectation did not finish within its timeout."""


class NotListeningError(TimeoutError):
    """A transfer's data landed, but its peer took no notification (``notify=``) within the
    deadline: it has not called ``listen_notifications`` (or ``submit_recvs``)."""


class RemoteAccessError(Error):
    """The peer's NIC refused the access (wrong key, outside the region, not readable)."""


class PeerUnreachableError(Error, ConnectionError):
    """The peer could not be reached or stopped answering."""


class BusyError(Error):
    """Too many operations outstanding (``worker.max_outstanding``); wait and resubmit."""


class BackendError(Error):
    """The backend (NIC library) reported a failure."""


class PluginError(Error):
    """A backend plugin could not be found or loaded (the message names the missing library)."""


class WatcherError(Error):
    """A uvm watcher could not be allocated."""


class NotAvailableError(Error):
    """The backend or this machine does not offer the feature (e.g. RDMA READ, CUDA)."""


class WorkerFailedError(Error):
    """The engine's worker thread failed; the engine refuses further work."""


class RendezvousError(Error, ConnectionError):
    """The rendezvous service could not be reached or answered wrongly."""


class ShutdownError(Error):
    """The engine is closed."""


class CancelledError(Error):
    """The operation was cancelled (``Transfer.cancel()``) before it completed."""


__all__ = [name for name, value in globals().items() if isinstance(value, type) and issubclass(value, Error)]
