"""Run by tests/test_jax_native.py in a process without TRITON_INTERPRET (needs jaxlib's CUDA
Triton module, `jax_cuda1x_plugin._triton`, which imports without a GPU): every launch of a
forward and backward plan compiled for sm_90 and wrapped into jaxlib's TritonKernelCall proto;
the proto, decoded here from its wire format, carries the launch's kernel, grid and parameters
(`native.kernel_params`: with TMA on, the attention kernels' host TMA descriptors). Prints
"PROTOS OK"; exits 3 when jaxlib has no CUDA Triton support.
"""

import sys
import zlib

from jax._src.lib import gpu_triton

if getattr(gpu_triton, "TritonKernel", None) is None:
    print("no CUDA Triton module in jaxlib")
    sys.exit(3)

import struct  # noqa: E402

from vsa_core import plan as P  # noqa: E402
from vsa_core.problem import AttnProblem  # noqa: E402
from vsa_jax import native  # noqa: E402


def fields(data: bytes):
    """(field number, wire type, value) of one protobuf message."""
    i, out = 0, []

    def varint():
        nonlocal i
        shift = value = 0
        while True:
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, wire, varint()))
        elif wire == 2:
            n = varint()
            out.append((number, wire, data[i:i + n]))
            i += n
        elif wire == 5:
            out.append((number, wire, data[i:i + 4]))
            i += 4
        elif wire == 1:
            out.append((number, wire, data[i:i + 8]))
            i += 8
        else:
            raise ValueError(f"wire type {wire}")
    return out


def one(msg, number, default=0):
    found = [v for n, _, v in fields(msg) if n == number]
    return found[-1] if found else default


def _varints(data: bytes):
    """The values of a packed repeated varint field."""
    out, value, shift = [], 0, 0
    for b in data:
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            out.append(value)
            value = shift = 0
    return tuple(out)


def decode_param(msg):
    (number, wire, value), = fields(msg)
    if number == 1:
        return ("buffer", one(value, 2))
    if number == 9:  # TensorDescriptor { nvidia: { elem_type, swizzle, shape, strides, block_shape, oob_fill } }
        nvidia = one(value, 1)
        return ("tma", one(nvidia, 1), one(nvidia, 2), _varints(one(nvidia, 3, b"")), _varints(one(nvidia, 4, b"")),
                _varints(one(nvidia, 5, b"")), one(nvidia, 6))
    kind = {2: "i1", 3: "i32", 4: "u32", 5: "i64", 6: "u64", 7: "fp32", 8: "fp64"}[number]
    if kind == "fp32":
        value = struct.unpack("<f", value)[0]
    elif kind == "fp64":
        value = struct.unpack("<d", value)[0]
    elif kind == "i32" and value >= 2 ** 31:
        value -= 2 ** 32 if value < 2 ** 32 else 2 ** 64
    return (kind, value)


if not native.jaxlib_takes_host_descriptors():  # jaxlib < 0.11.2: no host TMA descriptors
    from vsa_core.config import configure
    configure(tma=False)
    print(f"jaxlib {native.jaxlib_version()} takes no host TMA descriptors: pointer loads")

p = AttnProblem(batch=2, heads=3, q_len=384, kv_len=256, head_dim=64, block_elems=64, dtype="bfloat16", topk=2,
                has_gate=True)
count = tma_kernels = 0
for stage, inputs in (("forward", P.forward_inputs(p)), ("backward", P.backward_inputs(p))):
    plan = P.record_plan(stage, p, inputs)
    for launch in plan.launches:
        compiled = P.compile_launch(launch, plan, 90)
        any_call = zlib.decompress(native._kernel_call(compiled, 90))
        assert one(any_call, 4).decode() == launch.kernel_name
        call = one(any_call, 1)
        kernel = one(call, 1)
        assert one(kernel, 1).decode() == compiled.name
        assert one(kernel, 2) == compiled.num_warps and one(kernel, 3) == compiled.shared_mem_bytes
        assert one(kernel, 4).decode() == compiled.ptx and one(kernel, 6) == 90
        assert one(kernel, 12, None) is None, launch.kernel_name  # no global scratch
        assert (one(call, 2), one(call, 3), one(call, 4)) == launch.grid
        params = [decode_param(v) for n, _, v in fields(call) if n == 5]
        want = []
        for x in native.kernel_params(compiled):
            if x[0] == "array":
                want.append(("buffer", x[1]))
            elif x[0] == "tma":
                _, elem_type, _, swizzle, shape, strides, box, oob_fill = x
                want.append(("tma", elem_type, swizzle, shape, strides, box, oob_fill))
            else:
                want.append((x[2], struct.unpack("<f", struct.pack("<f", x[1]))[0] if x[2] == "fp32" else x[1]))
        assert params == want, (launch.kernel_name, params, want)
        tma_kernels += any(x[0] == "tma" for x in params)
        count += 1
        print(stage, launch.kernel_name, launch.grid, len(params), "parameters")
assert count == 10  # forward: pool (q, k, v in one), coarse, top-k, fine; backward: 6
# with TMA on: the fine forward, dQ and dK/dV kernels take two host descriptors each
assert tma_kernels == (3 if native.jaxlib_takes_host_descriptors() else 0), tma_kernels
print("PROTOS OK")
