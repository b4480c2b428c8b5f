"""GPU check run by tests/test_jax_native.py in a fresh process: the default launch (native
custom calls) under XLA command buffers (CUDA graphs), replayed with new inputs, against the
callback path, both with the process's launch configuration (by default autotuned tiles, the
native path tuning them when it is traced, and TMA).

XLA reads XLA_FLAGS once, at backend start, hence a process of its own. Prints one line
per replay and "ALL EQUAL" at the end when every result matched bit for bit; exits nonzero
unless every result matched and XLA's optimized HLO shows the native custom calls inside a
command buffer (the point of the check: a run without command buffers proves nothing).

VSA_CMDBUF_BACKEND=sm90 runs the sm90 backend, VSA_CMDBUF_BACKEND=cudnn the cudnn one,
VSA_CMDBUF_BACKEND=cute the cute one at 128-token blocks (their CuTe DSL custom calls with the Triton
ones: the cute forward's and backward's FA4 kernels; the gradients their kernels reduce with fp32
atomics, in a varying order (sm90: dq; cudnn and cute: dq, dk, dv), compared within the reference
tolerance, the rest bit for bit).
"""

import glob
import os
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="vsa_cmdbuf_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                           " --xla_gpu_graph_min_graph_size=1 --xla_dump_to=" + DUMP).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import vsa_jax  # noqa: E402
from common import Case, assert_close, make_inputs, reference  # noqa: E402
from vsa_core.config import LaunchConfig  # noqa: E402
from vsa_jax import native  # noqa: E402

MODES = {"native": LaunchConfig().jax_launch, "callback": "callback"}  # the default launch first: it tunes

BACKEND = os.environ.get("VSA_CMDBUF_BACKEND", "triton")
case = {"triton": Case(batch=1), "cute": Case(batch=1, head_dim=128, block=128)}.get(BACKEND, Case(batch=1, head_dim=128))
CUTE_BACKENDS = ("sm90", "cudnn", "cute")
NATIVE_TARGETS = (native.FFI_TARGET,) + (("CuteDSLRT_NvJaxCutlassCall_v2",) if BACKEND in CUTE_BACKENDS else ())
REDUCED = {"sm90": ("dq",), "cudnn": ("dq", "dk", "dv"), "cute": ("dq", "dk", "dv")}.get(BACKEND, ())  # fp32 atomics


def loss(q, k, v, gate, dout, kv_counts, q_counts):
    out = vsa_jax.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate, backend=BACKEND)
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out


def arguments(inputs):
    return ([jnp.asarray(inputs[n], jnp.bfloat16) for n in ("q", "k", "v", "gate", "dout")]
            + [jnp.asarray(inputs[n], jnp.int32) for n in ("kv_counts", "q_counts")])


fns = {}
for mode in MODES:
    native.set_launch(MODES[mode])  # read when tracing: trace now
    fns[mode] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    fns[mode].lower(*arguments(make_inputs(case, seed=3))).compile()
    text = fns[mode].lower(*arguments(make_inputs(case, seed=3))).as_text()
    assert (native.FFI_TARGET in text) == (mode == "native"), mode

ok = True
for replay in range(3):
    inputs = make_inputs(case, seed=100 + replay)  # new values (and counts) on every replay
    res = {}
    for mode in MODES:
        native.set_launch(MODES[mode])  # in case jit traces again
        (dq, dk, dv, dgate), out = fns[mode](*arguments(inputs))
        res[mode] = {n: np.asarray(x, np.float32) for n, x in
                     {"out": out, "dq": dq, "dk": dk, "dv": dv, "dgate": dgate}.items()}
    assert_close(case, res["native"], reference(case, inputs))
    exact = [n for n in res["native"] if n not in REDUCED]
    equal = {n: bool(np.array_equal(res["native"][n], res["callback"][n])) for n in exact}
    if REDUCED:
        assert_close(case, {n: res["native"][n] for n in REDUCED},
                     {n: res["callback"][n].astype(np.float64) for n in REDUCED})
    ok &= all(equal.values())
    print(f"replay {replay}: native == callback: {equal}")


def custom_calls_in_command_buffers(thunks: str) -> int:
    """How many custom-call thunks XLA runs inside a command buffer (CUDA graph), from a module's
    thunk_sequence_after_thunk_passes dump: XLA wraps what it records into a kCommandBuffer
    thunk, whose thunks are listed indented under it."""
    count, inside = 0, False
    for line in thunks.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            inside = "kCommandBuffer" in line
        elif inside and "kCustomCall" in line:
            count += 1
    return count


# per module that holds native custom calls: how many it has, and how many run in a command buffer
captured = {}
for f in glob.glob(os.path.join(DUMP, "*after_optimizations.txt")):
    hlo = open(f, errors="ignore").read()
    native_calls = sum(hlo.count(f'custom_call_target="{target}"') for target in NATIVE_TARGETS)
    if native_calls:
        module = os.path.basename(f).split(".")[0]  # module_NNNN
        thunk_files = glob.glob(os.path.join(DUMP, module + ".*thunk_sequence_after_thunk_passes.txt"))
        in_buffers = sum(custom_calls_in_command_buffers(open(t, errors="ignore").read()) for t in thunk_files)
        captured[os.path.basename(f)] = (native_calls, in_buffers)
print("XLA dump: native custom calls / of them inside command buffers, per module: "
      + (", ".join(f"{name}: {n} / {m}" for name, (n, m) in captured.items()) or "no module with native calls"))
print("ALL EQUAL" if ok else "MISMATCH")
all_captured = bool(captured) and all(m >= n for n, m in captured.values())
if not all_captured:
    print(f"NO COMMAND BUFFER: some native custom calls run outside command buffers (dump kept in {DUMP})")
sys.exit(0 if ok and all_captured else 1)
