"""The one module of vsa that touches Triton's internals, where no public API does the job.

Each function names the upstream gap it works around. Everything else in vsa uses Triton's
public API only (`triton.jit`, `kernel[grid](...)`, `triton.runtime.driver.set_active`,
`triton.knobs`, `triton.testing.do_bench`, `TensorDescriptor`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

import triton.runtime.interpreter as interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_driver_lock = threading.Lock()
_driver_installed = False


def install_stream_driver(current_launch) -> None:
    """Makes Triton's active driver one that reads device, capability and stream from
    `current_launch()` ((index, capability, stream) or None: `runtime.raw_cuda_launches`).

    Triton's JITFunction launches on `driver.active.get_current_stream(
    driver.active.get_current_device())` and takes no stream argument (3.6 - 3.9), and its
    CUDA driver reads both from torch when torch is loaded (3.6: always; without torch, 3.6
    finds no active driver and 3.9 launches on the device's default stream). Upstream gap: no
    public API passes a stream per launch, so this subclasses Triton's CUDA driver and installs it with
    the public `triton.runtime.driver.set_active`: inside `raw_cuda_launches` it answers the
    scope's device, capability and stream; elsewhere (another thread, a torch launch) it
    defers to Triton's default driver, so torch's behaviour is unchanged. The CUDA context
    is the one current on the calling thread (XLA's, inside a buffer callback); Triton loads
    and launches its kernels there.
    """
    global _driver_installed
    with _driver_lock:
        if _driver_installed:
            return
        from triton.backends.nvidia.driver import CudaDriver, CudaLauncher, CudaUtils
        from triton.runtime import driver as driver_config

        class RawStreamDriver(CudaDriver):
            def __init__(self):  # not CudaDriver.__init__: Triton 3.6's imports torch
                # one CudaUtils per process: CudaUtils() is a singleton whose __init__ reloads
                # the helper module, and with it the PyCUtensorMap type the launchers check TMA
                # descriptors against ("object must be of type PyCUtensorMap" after a reload)
                existing = getattr(CudaUtils, "instance", None)
                self.utils = existing if hasattr(existing, "load_binary") else CudaUtils()
                self.launcher_cls = CudaLauncher

            @staticmethod
            def _default():
                return driver_config.default  # Triton's own driver (created on first use)

            def get_current_device(self):
                launch = current_launch()
                return launch[0] if launch is not None else self._default().get_current_device()

            def get_current_stream(self, device=None):
                launch = current_launch()
                if launch is not None:
                    return launch[2]
                return self._default().get_current_stream(device)

            def get_device_capability(self, device=None):
                launch = current_launch()
                return launch[1] if launch is not None else self._default().get_device_capability(device)

            def set_current_device(self, device):
                launch = current_launch()
                if launch is None:
                    return self._default().set_current_device(device)
                if device != launch[0]:
                    raise RuntimeError(f"Triton asked for device {device} inside a launch scope on device {launch[0]}")

        driver_config.set_active(RawStreamDriver())
        _driver_installed = True


# ---- the interpreter for CPU tensors in a process that compiles for the GPU -------------------
@functools.lru_cache(maxsize=None)
def language_twins():
    """(module, name, compiled, interpreted) for every jit function of triton.language.

    Upstream gap: triton.language's own jit helpers are compiled or interpreted once, at
    import, by TRITON_INTERPRET; there is no API to interpret them per launch, so
    `interpreted_language` swaps these module attributes for the duration of a launch."""
    try:  # imported lazily by Triton's argument specialisation; it must see the compiled helpers
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        pass
    twins = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == "triton.language" or mod_name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                twins.append((module, attr, value, InterpretedFunction(value.fn)))
    return twins


@contextlib.contextmanager
def language_patches_undone():
    """Undoes every patch the interpreter makes to triton.language during the block.

    Upstream gap: the interpreter's `_patch_lang` (private) leaves nested patches in place
    and has no public hook; this wraps it to record each patch's originals.

    The interpreter rebinds triton.language's builtins to its numpy builder for each
    launch and restores them afterwards, but a call of one jit function from another
    (`_dot`, `tl.zeros`, ...) patches them again and never restores: without this, every
    kernel compiled for the GPU later in the process would be built by the interpreter's
    builder and fail ("'value' object has no attribute 'dtype'"). So each patch's
    original values are recorded as it is made and put back, latest first, at the end.
    """
    made = []
    patch = interpreter._patch_lang

    def recording_patch(fn):
        scope = patch(fn)
        made.extend(scope._changes)  # (object, attribute, value before this patch)
        return scope

    interpreter._patch_lang = recording_patch
    try:
        yield
    finally:
        interpreter._patch_lang = patch
        for obj, name, original in reversed(made):
            if original is interpreter._MISSING:
                if name in vars(obj):
                    delattr(obj, name)
            else:
                setattr(obj, name, original)


@contextlib.contextmanager
def interpreted_language():
    """triton.language's jit helpers interpreted for the duration of the block (see
    `language_twins`), every patch the interpreter makes meanwhile undone afterwards."""
    with language_patches_undone():
        twins = language_twins()
        try:
            for module, attr, _, twin in twins:
                setattr(module, attr, twin)
            yield
        finally:
            for module, attr, original, _ in twins:
                setattr(module, attr, original)


# ---- compiling for a GPU target without one ---------------------------------------------------
class _TargetDriver:
    """Stands in for Triton's active driver while compiling for a target without running
    on it: device and stream are dummies (nothing is launched), the target is ours."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return ("vsa-plan", self.target.arch)  # its own entry in the kernel's per-device caches

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def __getattr__(self, name):
        raise AttributeError(f"compiling for {self.target} without a device: driver.{name} is not available")


_compile_lock = threading.Lock()


def compile_for_target(kernel, args, grid, options, target):
    """`kernel.warmup(*args, grid=grid, **options)` compiled for `target` (a GPUTarget)
    without a device.

    Upstream gap: `JITFunction.warmup` compiles for the active driver's target, and Triton
    has no public way to give it another one or to restore the previous driver
    (`set_active` takes a driver, the default is private `_active`): the driver is swapped
    for a stand-in for the duration, under a lock."""
    from triton.runtime import driver as driver_config

    with _compile_lock:
        saved = driver_config._active
        driver_config.set_active(_TargetDriver(target))
        try:
            return kernel.warmup(*args, grid=grid, **options)
        finally:
            driver_config._active = saved


def mock_pointer(dtype):
    """A stand-in pointer argument of `dtype` for `compile_for_target` (16-byte aligned, as an
    eager launch's buffers are). Upstream gap: `MockTensor` is not exported by `triton`."""
    from triton.runtime.jit import MockTensor
    return MockTensor(dtype)


def tma_host_dtype(elem_type: int) -> int:
    """The host `CUtensorMapDataType` of a compiled kernel's TMA descriptor, from the element
    type in its metadata (`tensordesc_meta`), which numbers a few types as the device code does.

    Upstream gap: the map is Triton's own launcher's (`TMA_DTYPE_DEVICE_TO_HOST` of its nvidia
    driver module, 3.6 - 3.9), not exported; a launcher of Triton kernels other than Triton's
    (jaxlib's Triton call) needs it to encode the same descriptor."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    return TMA_DTYPE_DEVICE_TO_HOST[elem_type]


# ---- a compiled kernel's launch without its per-launch runner ---------------------------------
def _hooked(hook) -> bool:
    """Whether a launch hook of `triton.knobs.runtime` would be called: anything but None or an
    empty HookChain (its `calls`)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def compiled_launcher(compiled, grid):
    """`compiled[grid]`'s runner, called as `launch(*args, stream=stream)`, for a launch kept to
    be replayed many times (`vsa_core.replay`).

    Upstream gap: the runner that `CompiledKernel.__getitem__` returns builds launch metadata
    (a LazyDict) and passes both launch hooks on every launch, because in 3.6 - 3.9
    `knobs.runtime.launch_enter_hook` is never None (an empty HookChain); there is no public way
    to launch a compiled kernel without that per-launch work. While no hook is registered this
    calls the kernel's launcher (`compiled.run`) as `JITFunction.run` does, with no metadata and
    no hooks (the C launcher skips a None hook); with a hook registered (a profiler), and for
    an object without the launcher's attributes, it is the runner itself."""
    runner = compiled[grid]  # loads the binary, as the runner's first launch would
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return runner
    from triton import knobs
    runtime = knobs.runtime
    grid_x, grid_y, grid_z = grid

    def launch(*args, stream):
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            return runner(*args, stream=stream)
        run(grid_x, grid_y, grid_z, stream, function, packed, None, None, None, *args)
    return launch
