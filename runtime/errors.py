"""Exceptions raised by the runtime. Each names what was wrong; none leaves state half-changed."""


class RuntimeErrorBase(RuntimeError):
    """Base of every runtime error."""


class CudaError(RuntimeErrorBase):
    """A CUDA driver call returned something other than CUDA_SUCCESS."""


class OutOfMemoryError(RuntimeErrorBase):
    """An allocation larger than the memory that is free."""


class MemoryFault(RuntimeErrorBase):
    """An out-of-bounds pointer, a use after free, a double free or a free of an unknown pointer."""


class KernelNotFound(RuntimeErrorBase):
    """No kernel of that (module, function) exists on this backend."""


class LaunchError(RuntimeErrorBase):
    """A launch whose arguments do not match the kernel's declared signature."""


class GraphLifetimeError(RuntimeErrorBase):
    """Freeing memory that a live graph references, or replaying a destroyed graph."""


class CommError(RuntimeErrorBase):
    """A collective failed, timed out, or its ranks disagree."""
