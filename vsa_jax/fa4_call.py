"""The cute backend's forward and backward (FlashAttention-4's sm_90 block-sparse kernels) as XLA
custom calls: no Python per call (issue 23).

The cute backend's forward (`cute_backend.sparse_forward`) runs FA4's forward as the step "fa4_fwd"
(`cute_backend.launch_fa4_forward`), between Triton launches that build FA4's lists (and the
valid-rows copies of padding="ignore") and the coarse mix; its backward runs FA4's backward as the
step "fa4_bwd" (`launch_fa4_backward`) between the Triton launches of its KV-owned lists, dlse and the
pooling gradients. Under JAX the stage's launch plan (`vsa_core.plan`) names that step as a
`CuteLaunch`, and `call` turns it into one `cutlass.jax.cutlass_call` (nvidia-cutlass-dsl's public JAX
bridge, as `vsa_jax.sm90_call` and `vsa_jax.cudnn_call`) of an adapter that calls FA4's own configured
kernel objects:

- The kernel: FA4's interface (`flash_attn.cute.interface._flash_attn_fwd`) chooses the kernel
  class and its configuration from the problem's shapes (tile sizes, q subtiling, intra-warpgroup
  overlap, the mask_mod, pack-GQA: its own selectors, which change between FA4 releases), builds
  the object and hands it, with its compile arguments, to `cute.compile`, then launches the compiled
  function through TVM-FFI on torch tensors. No API of FA4 returns the object or its configuration,
  and a cutlass_call needs the object itself (it traces the kernel's `__call__` into its own
  program; a compiled TVM-FFI function cannot be embedded). So `configured_forward` calls the
  interface exactly as the torch launch does (`cute_backend.fa4_forward_call`, the one function
  both use), on torch fake tensors of the stage's buffers (`FakeTensorMode`: FA4's own way to
  prepare compiles without allocating; it skips the launch), and takes the object and its
  arguments where the interface calls `cute.compile`: for that call only, the interface module's
  `cute` is a view of cutlass.cute whose `compile` records instead of compiling, and its compile
  caches are empty ones (FA4 configures only on a cache miss). Both are put back after, under the
  backend's FA4 lock (no FA4 call of ours runs meanwhile); cutlass.cute itself and FA4's caches
  are not changed. FA4 is asked for its sm_90 kernel (`_arch=90`), the kernel
  the eager launch gets on an H100 / H200 and the arch this call compiles for.
- The arguments: the adapter calls the object with the arguments FA4 compiled it with, by name
  (the kernel's signature), the tensors replaced by cutlass_call's: q, k, v, out as [B, S, H, D]
  (BHSD arrays through `TensorSpec.mode`: the torch launch's `.transpose(1, 2)` views, no copy) at
  16-byte alignment, lse at 4; the full / mask lists and counts (four buffers of the plan) as
  FA4's `BlockSparseTensors`; the KV sub-block counts as the mask_mod's aux tensor; the scale as
  an fp32 run-time value (so scale * log2(e) is the same fp32 product). An argument FA4 compiled
  with that the adapter has no tensor for is an error at trace time, not a silent difference.
  Torch and JAX so run one kernel, configured alike, and are to agree bit for bit (the `gpu`
  tests of tests/test_jax_fa4_call.py check it).
- The backward, the same way: `configured_backward` calls FA4's backward interface as the torch
  launch does (`cute_backend.fa4_backward_call`) on fake tensors and takes the three objects it
  compiles, in its launch order: the preprocess (dPsum = rowsum(O * dO) - dlse, the log2 lse, the
  fp32 dQ accumulator zeroed), `FlashAttentionBackwardSm90` (dK and dV written directly, dQ
  accumulated with fp32 atomics: so dq is not bit-reproducible, in torch either) and the dQ
  postprocess (dQ = scale * accumulator). One adapter runs the three in that order on the call's
  stream, each with the arguments FA4 compiled it with and the run-time scalar the interface
  launches it with (the postprocess is compiled with a placeholder scale). FA4's interface
  allocates its scratch per call (log2 lse, dPsum, dQ accumulator, the shapes read from the main
  kernel's compile arguments); here they are extra outputs of the call, XLA buffers born there and
  dropped after it: the preprocess writes all three before anything reads them, so nothing needs
  zeroing. (In torch FA4 keeps allocating them itself, so they are not workspaces of the plan:
  torch would hold them twice.) FA4's backward interface has no arch argument: it reads the
  device's (FLASH_ATTENTION_ARCH when compiling without one), and anything but its sm_90 family is
  refused at trace time.
- Compiled at lowering, once per configuration and shapes (`compile_key`); `allow_cuda_graph=True`
  (XLA may capture it in a command buffer). Torch is imported at trace time only (FA4's interface
  needs it; the cute extra brings it), never per call.

What keeps the buffer callback (`native_reason`): a device other than sm_90 (FA4's sm_100 kernels
are other classes, and their block-sparse layout differs); blocks or head dims the backend refuses.

Compiling on a host with no GPU (tests, `benchmarks/fa4_jax_lower_cpu.py`) needs FA4's
cross-compilation settings `FLASH_ATTENTION_NUM_SMS` (its interface reads the SM count from the
device otherwise) and, for the backward, `FLASH_ATTENTION_ARCH=sm_90`, and `CUTE_DSL_ARCH=sm_90a`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
from typing import Dict, Optional

import jax
import jax.numpy as jnp

from .cutlass_common import arrange, versions

STEPS = ("fa4_fwd", "fa4_bwd")
ARCH = 90                 # FA4's kernel family asked for (its `_arch`)
GPU_ARCH = "sm_90a"       # what the call compiles for, whatever the host has
BLOCK_ELEMS = (128, 256)  # the cute backend's blocks (FA4's sparse KV tile is 128 tokens)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16")
TOKENS = ("q", "k", "v", "out")
# FA4's forward signature -> the step's argument (the tensors the adapter hands it)
_TENSOR_ARGS = {"mQ": "q", "mK": "k", "mV": "v", "mO": "out", "mLSE": "lse"}
_HANDLED = frozenset(_TENSOR_ARGS) | {"softmax_scale", "blocksparse_tensors", "aux_data", "stream"}


def library_error() -> Optional[str]:
    """None when FA4's interface, our mask_mod and the JAX bridge import, else why not."""
    try:
        import cutlass.jax
        if not cutlass.jax.is_available():
            return "cutlass.jax (nvidia-cutlass-dsl's JAX bridge) is not available with this jax"
        from vsa_core.backends import cute_backend
        why = cute_backend.library_error()  # FA4's interface and our mask_mod
        if why is not None:
            return why
        importlib.import_module("torch._subclasses.fake_tensor")
    except Exception as e:  # ImportError, or a CUDA-python / DSL setup that fails at import
        return f"{type(e).__name__}: {e}"
    return None


def native_reason(p, capability: Optional[int] = None, stage: str = "forward") -> Optional[str]:
    """Why `stage` ("forward" / "backward") of the cute backend on problem `p` cannot run as this
    module's custom call (on a CUDA device of `capability`, when given), or None."""
    if stage not in ("forward", "backward"):
        raise ValueError(f"stage must be 'forward' or 'backward', got {stage!r}")
    if capability is not None and capability != ARCH:
        return f"FA4's {stage} is taken as its sm_90 kernels, compiled for {GPU_ARCH} (the device is sm_{capability})"
    if p.block_elems not in BLOCK_ELEMS:
        return f"{p.block_elems}-token blocks: the cute backend takes {BLOCK_ELEMS}"
    if p.head_dim not in HEAD_DIMS or p.dtype not in DTYPES:
        return f"the cute backend takes head dim {HEAD_DIMS} in {DTYPES} (got {p.head_dim}, {p.dtype})"
    return library_error()


def check(launch) -> None:
    """NotImplementedError for a CuTe DSL launch this module cannot replay."""
    if launch.step not in STEPS:
        raise NotImplementedError(f"no native replay of CuTe DSL launch {launch.step!r}")


@dataclasses.dataclass(frozen=True)
class _Fa4Shapes:
    """The problem's shapes, which the forward and the backward configure FA4 from alike."""
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    layout: str
    block_elems: int

    def tokens(self, s: int) -> tuple:
        """A [tokens, head dim] buffer's shape in the problem's layout, `s` tokens long."""
        B, H, D = self.batch, self.heads, self.head_dim
        return (B, H, s, D) if self.layout == "bhsd" else (B, s, H, D)


@dataclasses.dataclass(frozen=True)
class Fa4Forward(_Fa4Shapes):
    """What FA4's interface configures the forward from: the buffers' shapes and the statics
    (`width`: the lists' columns)."""
    width: int
    softmax_scale: float

    def buffers(self) -> Dict[str, tuple]:
        """The "fa4_fwd" buffers as the cute backend lays them out: name -> (shape, dtype)."""
        B, H, dt, tokens = self.batch, self.heads, self.dtype, self.tokens
        n_q = self.q_len // self.block_elems
        lists = {}
        for kind in ("full", "mask"):
            lists[f"{kind}_idx"] = ((B, H, n_q, self.width), "int32")
            lists[f"{kind}_num"] = ((B, H, n_q), "int32")
        return {"q": (tokens(self.q_len), dt), "k": (tokens(self.kv_len), dt), "v": (tokens(self.kv_len), dt),
                "out": (tokens(self.q_len), dt), "lse": ((B, H, self.q_len), "float32"), **lists,
                "sub_counts": ((self.kv_len // 128,), "int32")}


@dataclasses.dataclass(frozen=True)
class Configured:
    """FA4's forward object as its interface configured it, with the arguments it compiled it
    with: `fixed` (name -> value) for those the adapter passes as recorded (None or Python values),
    `names` the signature's order; `options`: compile options beyond the TVM-FFI one."""
    kernel: object
    names: tuple
    fixed: tuple
    aux_scalars: object
    options: str


class _CompileRecorder:
    """A view of the cutlass.cute module whose `compile` records its arguments instead of compiling."""

    def __init__(self, real, into: list):
        self._real, self._into = real, into

    def __getattr__(self, name):
        return getattr(self._real, name)

    def compile(self, *args, **kwargs):
        self._into.append((args, kwargs))
        return _never_launched


def _never_launched(*args, **kwargs):
    raise RuntimeError("FA4's interface launched a kernel taken from cute.compile (it runs under FakeTensorMode)")


@contextlib.contextmanager
def compiles_taken(into: list):
    """For the duration: FA4's interface records its `cute.compile` calls in `into` as (args, kwargs)
    instead of compiling, with empty compile caches (it configures a kernel on a cache miss only).
    Only FA4's interface module sees the difference; everything is put back after. Hold the cute
    backend's FA4 lock around it (`configured_forward` does)."""
    from flash_attn.cute import interface
    real = interface.cute
    caches = {f: f.compile_cache for f in vars(interface).values() if hasattr(f, "compile_cache")}
    interface.cute = _CompileRecorder(real, into)
    for f in caches:
        f.compile_cache = {}
    try:
        yield
    finally:
        interface.cute = real
        for f, cache in caches.items():
            f.compile_cache = cache


@functools.lru_cache(maxsize=None)
def configured_forward(cfg: Fa4Forward) -> Configured:
    """FA4's forward object for `cfg`, configured by FA4's interface from the call the torch launch
    makes (`cute_backend.fa4_forward_call`) on fake tensors of the buffers (see the module doc)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vsa_core.backends import cute_backend
    taken = []
    with cute_backend._FA4_LOCK, compiles_taken(taken), FakeTensorMode():
        b = {n: torch.empty(shape, dtype=getattr(torch, dt), device="cuda") for n, (shape, dt) in cfg.buffers().items()}
        cute_backend.fa4_forward_call(b, layout=cfg.layout, softmax_scale=cfg.softmax_scale,
                                      block_elems=cfg.block_elems, _arch=ARCH)
    if len(taken) != 1:
        raise RuntimeError(f"FA4's forward interface compiled {len(taken)} kernels, expected 1")
    (kernel, *args), kwargs = taken[0]
    names = tuple(inspect.signature(type(kernel).__call__).parameters)[1:]
    if len(args) > len(names):
        raise NotImplementedError(f"{type(kernel).__name__} compiled with {len(args)} arguments, "
                                  f"its signature names {len(names)}")
    given = dict(zip(names, args))
    missing = [n for n in _HANDLED if n not in given]
    if missing:
        raise NotImplementedError(f"{type(kernel).__name__} was compiled without {missing}: not the forward "
                                  "this module replays")
    if float(given["softmax_scale"]) != cfg.softmax_scale:
        raise RuntimeError(f"FA4 compiled with scale {given['softmax_scale']}, asked {cfg.softmax_scale}")
    aux = _lists_and_aux(given, "forward")
    fixed = _fixed_args(given, _HANDLED, "FA4's forward")
    return Configured(kernel, names, fixed, aux.scalars, _options(kwargs))


def _lists_and_aux(given: dict, stage: str):
    """The aux data a kernel was compiled with, after checking that its block-sparse tensors are the
    full / mask lists and counts and its aux data the sub-block counts (what the adapters hand it)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensors
    from flash_attn.cute.utils import AuxData
    lists, aux = given["blocksparse_tensors"], given["aux_data"]
    if (not isinstance(lists, BlockSparseTensors) or any(t is None for t in lists[:4])
            or any(t is not None for t in lists[4:])):
        raise NotImplementedError(f"FA4's {stage} compiled with block-sparse tensors other than the full / mask "
                                  f"lists and counts: {[t is not None for t in lists or ()]}")
    if not isinstance(aux, AuxData) or len(aux.tensors or ()) != 1:
        raise NotImplementedError(f"FA4's {stage} compiled with aux data other than the sub-block counts: {aux}")
    return aux


def _fixed_args(given: dict, handled, what: str) -> tuple:
    """The compile arguments the adapter passes as recorded (those not in `handled`): None or Python
    values only, anything else is an argument the adapter would have to build."""
    fixed = {n: v for n, v in given.items() if n not in handled}
    for n, v in fixed.items():
        if v is not None and not isinstance(v, (bool, int, float)):
            raise NotImplementedError(f"{what} compiled with {n} = {type(v).__name__}, which this module does not "
                                      "hand it")
    return tuple(fixed.items())


def _options(kwargs: dict) -> str:
    """cute.compile's options beyond the TVM-FFI calling convention (a cutlass_call has its own)."""
    return " ".join(o for o in kwargs.get("options", "").split() if o != "--enable-tvm-ffi")


def _fp32_value(x: float):
    """`x` as an fp32 IR value, like the torch launch's run-time argument: the kernel's host code then
    forms scale * log2(e) as an fp32 product (on a Python constant the DSL multiplies in double)."""
    import cutlass
    return cutlass.Float32(cutlass.Float32(x).ir_value())


class _Adapter:
    """cutlass_call's calling convention (stream, *inputs, *outputs not aliased), the buffers named
    by `names`, -> FA4's forward object, called with the arguments its interface compiled it with.
    Runs inside cutlass.jax's traced wrapper."""

    def __init__(self, cfg: Fa4Forward, configured: Configured, names: tuple):
        self.cfg, self.configured, self.names = cfg, configured, names

    def __call__(self, stream, *tensors):
        from flash_attn.cute.block_sparsity import BlockSparseTensors
        from flash_attn.cute.utils import AuxData

        configured = self.configured
        t = dict(zip(self.names, tensors))
        given = dict(configured.fixed)
        given.update({arg: t[name] for arg, name in _TENSOR_ARGS.items()})
        given.update(softmax_scale=_fp32_value(self.cfg.softmax_scale),
                     blocksparse_tensors=BlockSparseTensors(t["mask_num"], t["mask_idx"], t["full_num"],
                                                            t["full_idx"]),
                     aux_data=AuxData([t["sub_counts"]], configured.aux_scalars), stream=stream)
        configured.kernel(*(given[n] for n in configured.names if n in given))


def _spec(arg: str, layout: str):
    """The TensorSpec of argument `arg`, with the alignment FA4's interface assumes for it."""
    from cutlass.jax import TensorSpec
    if arg in TOKENS:
        return TensorSpec(mode=(0, 2, 1, 3) if layout == "bhsd" else None, ptr_assumed_align=16)
    return TensorSpec(ptr_assumed_align=4)


def _versions() -> tuple:
    from importlib.metadata import version
    return versions() + (("flash-attn-4", version("flash-attn-4")),)


@functools.lru_cache(maxsize=None)
def _callable(cfg: Fa4Forward, in_args: tuple, out_args: tuple, result_args: tuple, result_types: tuple,
              aliases: tuple):
    """The cutlass_call callable of one configuration (cached: one trace of it per shape)."""
    import cutlass.jax
    configured = configured_forward(cfg)  # before the trace: FA4's interface runs outside cutlass_call's
    options = configured.options
    return cutlass.jax.cutlass_call(
        _Adapter(cfg, configured, in_args + out_args),
        output_shape_dtype=tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in result_types),
        input_spec=tuple(_spec(a, cfg.layout) for a in in_args),
        output_spec=tuple(_spec(a, cfg.layout) for a in result_args),
        input_output_aliases=dict(aliases),
        compile_options=f"--gpu-arch={GPU_ARCH}" + (f" {options}" if options else ""),
        # the adapter is fixed by these (cutlass_call adds the shapes, specs and environment): a
        # lowering that hits its cache skips re-tracing the adapter to MLIR
        compile_key=("vsa.fa4_fwd", cfg, in_args, out_args, aliases, _versions()),
        allow_cuda_graph=True,
    )


def call(launch, step, current: Dict[str, jax.Array], result_types: tuple) -> tuple:
    """The results of plan step `step` (a `vsa_core.plan.Step`) of the "fa4_fwd" or "fa4_bwd" launch
    `launch`, on the arrays `current` (buffer name -> array); result_types: a ShapeDtypeStruct per
    step result."""
    check(launch)
    if launch.step == "fa4_bwd":
        return _backward_call(launch, step, current, result_types)
    s = launch.statics_dict()
    q, k, idx = (current[launch.buffer(n)] for n in ("q", "k", "full_idx"))
    seq = 2 if s["layout"] == "bhsd" else 1
    cfg = Fa4Forward(q.shape[0], q.shape[3 - seq], q.shape[seq], k.shape[seq], q.shape[3], jnp.dtype(q.dtype).name,
                     s["layout"], s["block_elems"], idx.shape[-1], float(s["softmax_scale"]))
    args = arrange(launch, step, current, result_types)
    fn = _callable(cfg, tuple(args.in_args), tuple(args.out_args), args.result_args,
                   tuple((tuple(r.shape), jnp.dtype(r.dtype).name) for r in result_types), tuple(sorted(args.aliases)))
    return tuple(fn(*args.in_arrays))


# ---- the backward ---------------------------------------------------------------------------------
# FA4's backward interface (`_flash_attn_bwd`) compiles three objects for our problem and launches them
# in this order on one stream: its preprocess (dPsum = rowsum(O * dO) - dlse, the log2 lse, the fp32
# dQ accumulator zeroed), the main kernel (dK, dV, and dQ accumulated with fp32 atomics) and the dQ
# postprocess (dQ = scale * accumulator, in the input dtype). Per class: signature argument -> the
# step's buffer (or scratch) handed to it.
_BACKWARD_TENSORS = {
    "FlashAttentionBackwardPreprocess": {"mO": "out", "mdO": "dout", "mPdPsum": "dpsum", "mLSE": "lse",
                                         "mLSElog2": "lse_log2", "mdQaccum": "dq_accum", "mdLSE": "dlse"},
    "FlashAttentionBackwardSm90": {"mQ": "q", "mK": "k", "mV": "v", "mdO": "dout", "mLSE": "lse_log2",
                                   "mdPsum": "dpsum", "mdQaccum": "dq_accum", "mdK": "dk", "mdV": "dv"},
    "FlashAttentionBackwardPostprocess": {"mdQaccum": "dq_accum", "mdQ": "dq"},
}
# Per class: its fp32 run-time scalar and the value the interface launches it with ("scale": the
# problem's softmax scale). The preprocess's scale reaches only an output we do not ask for (scale_p)
# and is launched as 1.0; the postprocess is compiled with a placeholder and launched with the scale.
_BACKWARD_SCALARS = {"FlashAttentionBackwardPreprocess": ("softmax_scale", 1.0),
                     "FlashAttentionBackwardSm90": ("softmax_scale", "scale"),
                     "FlashAttentionBackwardPostprocess": ("scale", "scale")}
_BACKWARD_HANDLED = {"FlashAttentionBackwardSm90": {"aux_data", "blocksparse_tensors"}}
# FA4's own scratch, allocated by its interface per call: the buffers of the main kernel's arguments
SCRATCH = {"lse_log2": "mLSE", "dpsum": "mdPsum", "dq_accum": "mdQaccum"}
BACKWARD_TOKENS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Fa4Backward(_Fa4Shapes):
    """What FA4's interface configures the backward from: the "fa4_bwd" buffers' shapes and the
    statics (`has_dlse`: the coarse branch hands FA4 a dlse)."""
    softmax_scale: float
    has_dlse: bool
    config: tuple = ()  # overrides of FA4's own backward configuration, sorted items (`cute_backend.BACKWARD_CONFIG`)

    def buffers(self) -> Dict[str, tuple]:
        """The "fa4_bwd" buffers as the cute backend lays them out: name -> (shape, dtype)."""
        B, H, dt, tokens = self.batch, self.heads, self.dtype, self.tokens
        n_sub = self.kv_len // 128
        table = {n: (tokens(self.q_len), dt) for n in ("q", "out", "dout", "dq")}
        table.update({n: (tokens(self.kv_len), dt) for n in ("k", "v", "dk", "dv")})
        table.update(lse=((B, H, self.q_len), "float32"), idx=((B, H, n_sub, self.q_len // self.block_elems), "int32"),
                     full_num=((B, H, n_sub), "int32"), mask_num=((B, H, n_sub), "int32"),
                     sub_counts=((n_sub,), "int32"))
        if self.has_dlse:
            table["dlse"] = ((B, H, self.q_len), "float32")
        return table


@dataclasses.dataclass(frozen=True)
class BackwardKernel:
    """One object FA4's backward interface configured: its signature's names, `fixed` (name -> value)
    for the arguments passed as compiled (None or Python values), `tensors` (argument -> buffer) for
    those the adapter hands a buffer, `scalar` (argument, value) for its fp32 run-time scalar."""
    kernel: object
    names: tuple
    fixed: tuple
    tensors: tuple
    scalar: tuple
    options: str


@dataclasses.dataclass(frozen=True)
class ConfiguredBackward:
    """FA4's backward objects in launch order, FA4's scratch (name -> (shape, dtype)) and the mask_mod's
    aux scalars."""
    kernels: tuple
    scratch: tuple
    aux_scalars: object


def _require_sm90_family() -> None:
    from flash_attn.cute import interface
    try:
        arch = interface._get_device_arch()
    except Exception as e:  # no CUDA device and no FLASH_ATTENTION_ARCH
        raise RuntimeError("FA4's backward interface picks its kernel family from the device; compiling without "
                           f"one needs FLASH_ATTENTION_ARCH=sm_90 ({type(e).__name__}: {e})") from e
    if arch // 10 != ARCH // 10:
        raise NotImplementedError(f"FA4's backward interface configures its sm_{arch} kernels here, not the sm_90 "
                                  "ones this module replays")


def _backward_kernel(kernel, args, kwargs, cfg: Fa4Backward) -> BackwardKernel:
    cls = type(kernel).__name__
    if cls not in _BACKWARD_TENSORS:
        raise NotImplementedError(f"FA4's backward interface compiled a {cls}, which this module does not replay")
    names = tuple(inspect.signature(type(kernel).__call__).parameters)[1:]
    if len(args) > len(names):
        raise NotImplementedError(f"{cls} compiled with {len(args)} arguments, its signature names {len(names)}")
    given = dict(zip(names, args))
    tensors = {a: b for a, b in _BACKWARD_TENSORS[cls].items() if given.get(a) is not None}
    missing = [a for a in _BACKWARD_TENSORS[cls] if a not in tensors and (a != "mdLSE" or cfg.has_dlse)]
    if missing:
        raise NotImplementedError(f"{cls} was compiled without {missing}: not the backward this module replays")
    scalar, value = _BACKWARD_SCALARS[cls]
    handled = set(tensors) | {scalar, "stream"} | _BACKWARD_HANDLED.get(cls, set())
    fixed = _fixed_args(given, handled, cls)
    if value == "scale" and cls == "FlashAttentionBackwardSm90" and float(given[scalar]) != cfg.softmax_scale:
        raise RuntimeError(f"FA4 compiled with scale {given[scalar]}, asked {cfg.softmax_scale}")
    return BackwardKernel(kernel, names, fixed, tuple(tensors.items()),
                          (scalar, cfg.softmax_scale if value == "scale" else value), _options(kwargs))


@functools.lru_cache(maxsize=None)
def configured_backward(cfg: Fa4Backward) -> ConfiguredBackward:
    """FA4's backward objects for `cfg`, configured by FA4's interface from the call the torch launch
    makes (`cute_backend.fa4_backward_call`) on fake tensors of the buffers, taken where it compiles
    them (`compiles_taken`, as the forward's)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vsa_core.backends import cute_backend
    taken = []
    with cute_backend._FA4_LOCK:
        _require_sm90_family()
        with compiles_taken(taken), FakeTensorMode():
            b = {n: torch.empty(shape, dtype=getattr(torch, dt), device="cuda")
                 for n, (shape, dt) in cfg.buffers().items()}
            cute_backend.fa4_backward_call(b, layout=cfg.layout, softmax_scale=cfg.softmax_scale,
                                           block_elems=cfg.block_elems, config=dict(cfg.config))
    kernels = tuple(_backward_kernel(kernel, args, kwargs, cfg) for (kernel, *args), kwargs in taken)
    order = tuple(type(k.kernel).__name__ for k in kernels)
    if order != tuple(_BACKWARD_TENSORS):
        raise NotImplementedError(f"FA4's backward interface compiled {order}, expected {tuple(_BACKWARD_TENSORS)}")
    (_, *main_args), _ = taken[1]
    main = dict(zip(kernels[1].names, main_args))
    aux = _lists_and_aux(main, "backward")
    buffers = cfg.buffers()
    for arg, name in kernels[1].tensors:  # the main kernel writes dk / dv directly (no GQA accumulators)
        if name in buffers and tuple(main[arg].shape) != _bshd(buffers[name][0], cfg.layout):
            raise NotImplementedError(f"FA4's backward compiled {arg} as {tuple(main[arg].shape)}, not {name}")
    scratch = []
    for name, arg in SCRATCH.items():
        t = main[arg]
        if str(t.element_type) != "Float32":
            raise NotImplementedError(f"FA4's backward scratch {name} is {t.element_type}, not fp32")
        scratch.append((name, (tuple(int(n) for n in t.shape), "float32")))
    return ConfiguredBackward(kernels, tuple(scratch), aux.scalars)


def _bshd(shape: tuple, layout: str) -> tuple:
    """The shape FA4 sees of a buffer of `shape` (token arrays as [B, S, H, D])."""
    return (shape[0], shape[2], shape[1], shape[3]) if layout == "bhsd" and len(shape) == 4 else tuple(shape)


class _BackwardAdapter:
    """cutlass_call's calling convention (stream, *inputs, *outputs not aliased), the buffers and FA4's
    scratch named by `names`, -> FA4's three backward objects, called in the interface's order on the
    call's stream with the arguments it compiled them with. Runs inside cutlass.jax's traced wrapper."""

    def __init__(self, configured: ConfiguredBackward, names: tuple):
        self.configured, self.names = configured, names

    def __call__(self, stream, *tensors):
        from flash_attn.cute.block_sparsity import BlockSparseTensors
        from flash_attn.cute.utils import AuxData

        t = dict(zip(self.names, tensors))
        for k in self.configured.kernels:
            given = dict(k.fixed)
            given.update({arg: t[name] for arg, name in k.tensors})
            given[k.scalar[0]] = _fp32_value(k.scalar[1])
            given["stream"] = stream
            if type(k.kernel).__name__ == "FlashAttentionBackwardSm90":
                given.update(blocksparse_tensors=BlockSparseTensors(t["mask_num"], t["idx"], t["full_num"], t["idx"]),
                             aux_data=AuxData([t["sub_counts"]], self.configured.aux_scalars))
            k.kernel(*(given[n] for n in k.names if n in given))


def _backward_spec(arg: str, layout: str):
    """The TensorSpec of buffer `arg`, with the alignment FA4's interface assumes for it: 16 bytes on the
    token arrays and its fp32 scratch (`to_cute_tensor`'s default), 4 on lse, dlse and the lists."""
    from cutlass.jax import TensorSpec
    if arg in BACKWARD_TOKENS:
        return TensorSpec(mode=(0, 2, 1, 3) if layout == "bhsd" else None, ptr_assumed_align=16)
    return TensorSpec(ptr_assumed_align=16 if arg in SCRATCH else 4)


@functools.lru_cache(maxsize=None)
def _backward_callable(cfg: Fa4Backward, in_args: tuple, out_args: tuple, result_args: tuple, result_types: tuple,
                       aliases: tuple):
    """The cutlass_call callable of one backward configuration; FA4's scratch are its last outputs."""
    import cutlass.jax
    configured = configured_backward(cfg)  # before the trace: FA4's interface runs outside cutlass_call's
    scratch = dict(configured.scratch)
    options = {k.options for k in configured.kernels} - {""}
    if len(options) > 1:
        raise NotImplementedError(f"FA4's backward objects compiled with different options: {options}")
    results = result_types + tuple(scratch.values())
    return cutlass.jax.cutlass_call(
        _BackwardAdapter(configured, in_args + out_args + tuple(scratch)),
        output_shape_dtype=tuple(jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for shape, dt in results),
        input_spec=tuple(_backward_spec(a, cfg.layout) for a in in_args),
        output_spec=tuple(_backward_spec(a, cfg.layout) for a in result_args + tuple(scratch)),
        input_output_aliases=dict(aliases),
        compile_options=f"--gpu-arch={GPU_ARCH}" + "".join(f" {o}" for o in options),
        compile_key=("vsa.fa4_bwd", cfg, in_args, out_args, aliases, _versions()),
        allow_cuda_graph=True,
    )


def _backward_call(launch, step, current: Dict[str, jax.Array], result_types: tuple) -> tuple:
    s = launch.statics_dict()
    q, k = current[launch.buffer("q")], current[launch.buffer("k")]
    seq = 2 if s["layout"] == "bhsd" else 1
    has_dlse = "dlse" in dict(launch.args)
    cfg = Fa4Backward(q.shape[0], q.shape[3 - seq], q.shape[seq], k.shape[seq], q.shape[3], jnp.dtype(q.dtype).name,
                      s["layout"], s["block_elems"], float(s["softmax_scale"]), has_dlse,
                      tuple(sorted((s.get("config") or {}).items())))
    args = arrange(launch, step, current, result_types)
    fn = _backward_callable(cfg, tuple(args.in_args), tuple(args.out_args), args.result_args,
                            tuple((tuple(r.shape), jnp.dtype(r.dtype).name) for r in result_types),
                            tuple(sorted(args.aliases)))
    return tuple(fn(*args.in_arrays))[:len(result_types)]  # FA4's scratch ends with the call


def fa4_forward(q, k, v, full_idx, full_num, mask_idx, mask_num, sub_counts, *, block_elems: int,
                softmax_scale: Optional[float] = None, layout: str = "bhsd"):
    """FA4's block-sparse forward, configured as the cute backend configures it, as one XLA custom
    call; returns (out, lse). For tests and the probe.

    q, k, v: [B, H, S, D] ("bhsd") or [B, S, H, D] ("bshd"), Sq and Skv multiples of `block_elems`
    (128 or 256). full_idx, mask_idx [B, H, Sq/E, C] int32: FA4's query-owned lists of 128-token
    KV tiles, those with every token valid and the partly filled ones (`cute_backend.forward_lists`);
    full_num, mask_num [B, H, Sq/E] int32: their lengths; sub_counts [Skv/128] int32: valid tokens
    per KV tile (the mask_mod keeps those).
    out: q's shape and dtype; lse [B, H, Sq] fp32, natural log, -inf on rows that see nothing.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    seq = 2 if layout == "bhsd" else 1
    b, h, s, d = q.shape[0], q.shape[3 - seq], q.shape[seq], q.shape[3]
    dtype = jnp.dtype(q.dtype).name
    cfg = Fa4Forward(b, h, s, k.shape[seq], d, dtype, layout, block_elems, full_idx.shape[-1],
                     float(d ** -0.5 if softmax_scale is None else softmax_scale))
    want = cfg.buffers()
    names = ("q", "k", "v", "full_idx", "full_num", "mask_idx", "mask_num", "sub_counts")
    for name, x in zip(names, (q, k, v, full_idx, full_num, mask_idx, mask_num, sub_counts)):
        if tuple(x.shape) != want[name][0] or jnp.dtype(x.dtype).name != want[name][1]:
            raise ValueError(f"{name} must be {want[name][1]} {want[name][0]}, got {x.dtype} {tuple(x.shape)}")
    if block_elems not in BLOCK_ELEMS or d not in HEAD_DIMS or dtype not in DTYPES or s % block_elems:
        raise ValueError(f"blocks of {BLOCK_ELEMS} tokens, head dim {HEAD_DIMS} in {DTYPES}, Sq a multiple of the "
                         f"block: got E={block_elems}, D={d}, {dtype}, Sq={s}")
    results = ((want["out"][0], dtype), (want["lse"][0], "float32"))
    fn = _callable(cfg, names, ("out", "lse"), ("out", "lse"), results, ())
    out, lse = fn(q, k, v, full_idx, full_num, mask_idx, mask_num, sub_counts)
    return out, lse
