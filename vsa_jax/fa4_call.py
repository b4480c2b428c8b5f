"""The cute backend's forward (FlashAttention-4's sm_90 block-sparse kernel) as one XLA custom call:
no Python per call (issue 23).

The cute backend's forward (`cute_backend.sparse_forward`) runs FA4's forward as the step "fa4_fwd"
(`cute_backend.launch_fa4_forward`), between Triton launches that build FA4's lists (and the
valid-rows copies of padding="ignore") and the coarse mix. Under JAX the stage's launch plan
(`vsa_core.plan`) names that step as a `CuteLaunch`, and `call` turns it into one
`cutlass.jax.cutlass_call` (nvidia-cutlass-dsl's public JAX bridge, as `vsa_jax.sm90_call` and
`vsa_jax.cudnn_call`) of an adapter that calls FA4's own configured kernel object:

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
- Compiled at lowering, once per configuration and shapes (`compile_key`); `allow_cuda_graph=True`
  (XLA may capture it in a command buffer). Torch is imported at trace time only (FA4's interface
  needs it; the cute extra brings it), never per call.

What keeps the buffer callback (`native_reason`): the backward (FA4's preprocess, main kernel and
postprocess, with fp32 scratch FA4 allocates itself, not plan workspaces yet); a device other than
sm_90 (FA4's sm_100 kernel is another class, and its block-sparse layout differs).

Compiling on a host with no GPU (tests, `benchmarks/fa4_jax_lower_cpu.py`) needs FA4's
cross-compilation setting `FLASH_ATTENTION_NUM_SMS` (its interface reads the SM count from the
device otherwise) and `CUTE_DSL_ARCH=sm_90a`.
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

STEPS = ("fa4_fwd",)
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
    if stage != "forward":
        return ("FA4's backward (preprocess, main kernel, postprocess, with fp32 scratch it allocates itself) "
                "runs through the callback")
    if capability is not None and capability != ARCH:
        return f"FA4's forward is taken as its sm_90 kernel, compiled for {GPU_ARCH} (the device is sm_{capability})"
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
class Fa4Forward:
    """What FA4's interface configures the forward from: the buffers' shapes and the statics
    (`width`: the lists' columns)."""
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    layout: str
    block_elems: int
    width: int
    softmax_scale: float

    def buffers(self) -> Dict[str, tuple]:
        """The "fa4_fwd" buffers as the cute backend lays them out: name -> (shape, dtype)."""
        B, H, D, dt = self.batch, self.heads, self.head_dim, self.dtype

        def tokens(s):
            return (B, H, s, D) if self.layout == "bhsd" else (B, s, H, D)
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
    from flash_attn.cute.block_sparsity import BlockSparseTensors
    from flash_attn.cute.utils import AuxData
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
    lists, aux = given["blocksparse_tensors"], given["aux_data"]
    if (not isinstance(lists, BlockSparseTensors) or any(t is None for t in lists[:4])
            or any(t is not None for t in lists[4:])):
        raise NotImplementedError("FA4's forward compiled with block-sparse tensors other than the full / mask "
                                  f"lists and counts: {[t is not None for t in lists or ()]}")
    if not isinstance(aux, AuxData) or len(aux.tensors or ()) != 1:
        raise NotImplementedError(f"FA4's forward compiled with aux data other than the sub-block counts: {aux}")
    fixed = {n: v for n, v in given.items() if n not in _HANDLED}
    for n, v in fixed.items():
        if v is not None and not isinstance(v, (bool, int, float)):
            raise NotImplementedError(f"FA4's forward compiled with {n} = {type(v).__name__}, which this "
                                      "module does not hand it")
    options = " ".join(o for o in kwargs.get("options", "").split() if o != "--enable-tvm-ffi")
    return Configured(kernel, names, tuple(fixed.items()), aux.scalars, options)


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
    """The results of plan step `step` (a `vsa_core.plan.Step`) of the "fa4_fwd" launch `launch`, on
    the arrays `current` (buffer name -> array); result_types: a ShapeDtypeStruct per step result."""
    check(launch)
    s = launch.statics_dict()
    q, k, idx = (current[launch.buffer(n)] for n in ("q", "k", "full_idx"))
    seq = 2 if s["layout"] == "bhsd" else 1
    cfg = Fa4Forward(q.shape[0], q.shape[3 - seq], q.shape[seq], k.shape[seq], q.shape[3], jnp.dtype(q.dtype).name,
                     s["layout"], s["block_elems"], idx.shape[-1], float(s["softmax_scale"]))
    args = arrange(launch, step, current, result_types)
    fn = _callable(cfg, tuple(args.in_args), tuple(args.out_args), args.result_args,
                   tuple((tuple(r.shape), jnp.dtype(r.dtype).name) for r in result_types), tuple(sorted(args.aliases)))
    return tuple(fn(*args.in_arrays))


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
