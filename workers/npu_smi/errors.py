"""npu-smi's errors: the tool could not be run, or its text could not be parsed."""


class NpuSmiError(Exception):
    """Base class for npu-smi problems."""


class NpuSmiParseError(NpuSmiError, ValueError):
    """The text is not npu-smi output of the expected kind."""


class NpuSmiUnavailable(NpuSmiError):
    """npu-smi could not be run: missing, timed out, or exited non-zero."""
