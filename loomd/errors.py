"""Errors with a stable wire `code`; the server turns them into error replies."""


class LoomdError(Exception):
    code = "error"


class BadRequest(LoomdError):
    code = "bad_request"


class UnknownOp(LoomdError):
    code = "unknown_op"


class BadVersion(LoomdError):
    code = "bad_version"


class FrameTooLarge(LoomdError):
    code = "frame_too_large"


class NotFound(LoomdError):
    code = "not_found"


class Busy(LoomdError):
    code = "busy"


class StorageError(LoomdError):
    code = "storage"


class ExtensionError(LoomdError):
    code = "extension"


class EmbedderError(LoomdError):
    code = "embedder"


class ModelError(LoomdError):
    code = "model"


class TaskError(LoomdError):
    code = "task"


class DaemonNotRunning(LoomdError):
    code = "not_running"


class ChildDied(LoomdError):
    """The offload process exited while (or before) running a call; the supervisor starts a new one."""

    code = "internal"


class SharedError(LoomdError):
    """The shared-memory server (PostgreSQL) is unreachable, refused us, or holds a schema we cannot use."""

    code = "shared"
