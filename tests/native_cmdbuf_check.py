"""GPU check run by tests/test_jax_native.py in a fresh process: the native path under XLA
command buffers (CUDA graphs), replayed with new inputs, against the callback path.

XLA reads XLA_FLAGS once, at backend start, hence a process of its own. Prints one line
per replay and "ALL EQUAL" at the end when every result matched bit for bit; exits nonzero
unless every result matched and XLA's optimized HLO shows the native custom calls inside a
command buffer (the point of the check: a run without command buffers proves nothing).
"""

import glob
import os
import re
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
from vsa_core.backends import triton_backend as T  # noqa: E402
from vsa_jax import native  # noqa: E402

for kernel in (T._sparse_fwd, T._sparse_bwd_dq, T._sparse_bwd_dkdv):
    kernel.tuned = None  # the default config everywhere, as the plan runs
T.USE_TMA = False

case = Case(batch=1)


def loss(q, k, v, gate, dout, kv_counts, q_counts):
    out = vsa_jax.video_sparse_attn(q, k, v, kv_counts, q_counts, case.topk, case.block, gate, backend="triton")
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out


def arguments(inputs):
    return ([jnp.asarray(inputs[n], jnp.bfloat16) for n in ("q", "k", "v", "gate", "dout")]
            + [jnp.asarray(inputs[n], jnp.int32) for n in ("kv_counts", "q_counts")])


fns = {}
for mode in ("native", "callback"):
    native.set_launch(mode)  # read when tracing: trace now
    fns[mode] = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    fns[mode].lower(*arguments(make_inputs(case, seed=3))).compile()
    text = fns[mode].lower(*arguments(make_inputs(case, seed=3))).as_text()
    assert (native.FFI_TARGET in text) == (mode == "native"), mode

ok = True
for replay in range(3):
    inputs = make_inputs(case, seed=100 + replay)  # new values (and counts) on every replay
    res = {}
    for mode in ("native", "callback"):
        native.set_launch(mode)  # in case jit traces again
        (dq, dk, dv, dgate), out = fns[mode](*arguments(inputs))
        res[mode] = {n: np.asarray(x, np.float32) for n, x in
                     {"out": out, "dq": dq, "dk": dk, "dv": dv, "dgate": dgate}.items()}
    assert_close(case, res["native"], reference(case, inputs))
    equal = {n: bool(np.array_equal(res["native"][n], res["callback"][n])) for n in res["native"]}
    ok &= all(equal.values())
    print(f"replay {replay}: native == callback: {equal}")


def captured_custom_calls(hlo: str) -> int:
    """How many FFI_TARGET custom calls sit inside a command-buffer computation of one HLO
    module's text (XLA outlines what it records into a CUDA graph into computations named
    command_buffer*, called from the entry computation)."""
    count, inside = 0, False
    for line in hlo.splitlines():
        head = re.match(r"\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            inside = "command_buffer" in head.group(2)
        elif line.strip() == "}":
            inside = False
        elif inside and f'custom_call_target="{native.FFI_TARGET}"' in line:
            count += 1
    return count


optimized = [f for f in glob.glob(os.path.join(DUMP, "*after_optimizations*.txt")) if os.path.isfile(f)]
captured = {os.path.basename(f): captured_custom_calls(open(f, errors="ignore").read()) for f in optimized}
captured = {name: n for name, n in captured.items() if n}
print(f"XLA dump: {len(optimized)} optimized modules; {native.FFI_TARGET} calls inside command buffers: "
      + (", ".join(f"{name}: {n}" for name, n in captured.items()) or "none"))
print("ALL EQUAL" if ok else "MISMATCH")
if not captured:
    mentions = [f for f in glob.glob(os.path.join(DUMP, "*")) if os.path.isfile(f)
                and "command_buffer" in open(f, errors="ignore").read()]
    print("NO COMMAND BUFFER: no native custom call inside a command_buffer computation; dump files that "
          f"mention command_buffer: {[os.path.basename(f) for f in mentions if 'jit_loss' in f]} (dump kept in {DUMP})")
    for f in sorted(glob.glob(os.path.join(DUMP, "*jit_loss*thunk*"))):  # what XLA did with the loss
        lines = [ln for ln in open(f, errors="ignore").read().splitlines()
                 if "ommand" in ln or native.FFI_TARGET in ln or "custom" in ln.lower()]
        print(f"--- {os.path.basename(f)}: {len(lines)} lines about command buffers / custom calls")
        print("\n".join(lines[:25]))
sys.exit(0 if ok and captured else 1)
