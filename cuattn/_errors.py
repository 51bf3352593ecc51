"""Exception types of cuattn, importable without CuPy."""


class CompileError(RuntimeError):
    """NVRTC rejected a kernel: carries the kernel name, the options and the compiler log."""

    def __init__(self, kernel, options, log):
        self.kernel = kernel
        self.options = tuple(options)
        self.log = log
        super().__init__(
            f"NVRTC failed to compile {kernel} with options {' '.join(self.options)}:\n{log}"
        )


class OutOfBlocksError(RuntimeError):
    """The paged KV cache has too few free blocks for a request; nothing was changed."""


class NoDeviceError(RuntimeError):
    """A GPU entry point was called where no CUDA device or driver can be used; the message says
    what is missing and how to run on the CPU instead."""


class UnknownSequenceError(KeyError, ValueError):
    """A BlockManager method named a sequence it does not hold: a KeyError (the lookup failed) and
    a ValueError (a bad argument), so either catches it."""

    def __str__(self) -> str:
        # the message as given: KeyError's str() would quote it as a missing key
        return str(self.args[0]) if self.args else ""
