"""The Triton kernels for CPU tensors: interpreted twins, made on first use.

Triton decides between compiling and interpreting a function when `@triton.jit`
decorates it (it reads TRITON_INTERPRET then), so a process that imported triton
without TRITON_INTERPRET=1 holds only compiled kernels, and so does triton.language
for its own jit helpers (`tl.zeros`, `tl.cumsum`, the reductions' combine functions).
For CPU tensors this module loads a kernels module (`stage_kernels.py`, a backend's own) a
second time, as a separate module decorated under the interpreter (the device functions it
imports from another kernels module rebound to that module's interpreted twin), and runs
each launch of it with
triton.language's jit helpers swapped for interpreted twins (restored afterwards, so
CUDA launches in the same process are unaffected: `triton_shim.interpreted_language`). With TRITON_INTERPRET=1 set before
triton was imported (the tests' conftest), everything is interpreted already and the
package's own module is used as is.

The interpreter runs each program of the grid in numpy: right results, slowly. It is
meant for tests and small checks; the first CPU call warns once per process.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
import warnings

import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .triton_shim import interpreted_language


INTERPRETER_WARNING = ("vsa: {arrays} run the Triton kernels under Triton's interpreter. This path is for "
                       "testing and is slow (seconds to minutes for what a GPU does in milliseconds); use {gpu} "
                       "for real work.")

_warned = False


def _library_dirs():
    """Directories of the code between the user's call and the warning: ours and the frameworks'."""
    import os
    dirs = []
    for name in ("vsa_core", "vsa_torch", "vsa_jax", "torch", "jax", "jaxlib", "triton", "contextlib", "functools"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep if path.endswith("__init__.py") else path)
    return tuple(dirs)


def warn_interpreted(arrays: str = "CPU tensors", gpu: str = "CUDA tensors") -> None:
    """Once per process: the interpreter's warning, attributed to the first frame of the
    caller's own code (not to a line of vsa or of the framework that called it)."""
    global _warned
    if _warned:
        return
    _warned = True
    skip = _library_dirs()
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(INTERPRETER_WARNING.format(arrays=arrays, gpu=gpu), stacklevel=level if frame is not None else 2)

_LOCK = threading.RLock()  # one interpreted launch at a time: the language swap is process-wide


class _InterpretedLaunch:
    """An interpreted kernel whose launches run with triton.language interpreted too."""

    def __init__(self, kernel: InterpretedFunction):
        self.kernel = kernel
        self.fn = kernel.fn
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _LOCK, interpreted_language():
                return self.kernel[grid](*args, **kwargs)
        return launch

    def __call__(self, *args, **kwargs):  # a device-function call from another kernel
        return self.kernel(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def interpreted_kernels(kernels):
    """`kernels` (a module of Triton kernels) with every kernel interpreted (a second module object)."""
    if any(isinstance(value, InterpretedFunction) for value in vars(kernels).values()):
        return kernels  # TRITON_INTERPRET=1 was set before triton was imported
    warn_interpreted()  # a no-op when a frontend has warned already, with its own words
    package, _, leaf = kernels.__name__.rpartition(".")
    spec = importlib.util.spec_from_file_location(f"{package}._{leaf}_interpreted", kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    with triton.knobs.runtime.scope():  # restores the knob and TRITON_INTERPRET afterwards
        triton.knobs.runtime.interpret = True
        spec.loader.exec_module(module)
    # device functions imported from another kernels module were decorated compiled there, and an
    # interpreted kernel cannot call a compiled one: the twin reads that module's twin instead
    # (interpreted functions look their callees up in the module's globals at call time)
    for name, value in list(vars(module).items()):
        owner = sys.modules.get(getattr(getattr(value, "fn", None), "__module__", None) or "")
        if isinstance(value, JITFunction) and owner is not None and owner.__name__.startswith("vsa_core."):
            setattr(module, name, getattr(interpreted_kernels(owner), name))
    for name, value in list(vars(module).items()):
        if isinstance(value, InterpretedFunction) and name.endswith("_kernel"):
            setattr(module, name, _InterpretedLaunch(value))
    return module
