"""torch == JAX bit for bit with autotuning on, in one fresh process (GPU only).

Run by tests/test_shared_tiles.py::test_autotuned_torch_and_jax_agree_bitwise in a subprocess: the
tile store (`vsa_core.autotune.TILES`) starts empty, torch's call times the attention kernels'
candidates, and JAX's call of the same problem must run the tiles torch chose. The draw is the one
that once gave torch != JAX (out, lse, dq, dk, dv): block_sparse_attn_from_indices, B2 H2 D128 E128,
29 query blocks, 10 KV blocks, bf16, BSHD, backend "triton". Exits nonzero on any difference.

JAX runs its default launch (native custom calls on the GPU: the check fails if it does not) or,
with --callback, the buffer callback; --jax-first makes JAX's call the first of the problem (the
native launch then tunes it at trace time, and torch's call must run its choice).
"""

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU's memory to torch too

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import vsa_jax  # noqa: E402
import vsa_torch  # noqa: E402
from vsa_core.autotune import TILES  # noqa: E402
from vsa_core.config import configure  # noqa: E402
from vsa_jax import native  # noqa: E402

B, H, D, E, NQ, NKV = 2, 2, 128, 128, 29, 10
CAPACITY = 6


def draw(seed: int = 22):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, NQ * E, H, D), dtype=np.float32)
    k = rng.standard_normal((B, NKV * E, H, D), dtype=np.float32)
    v = rng.standard_normal((B, NKV * E, H, D), dtype=np.float32)
    dout = rng.standard_normal((B, NQ * E, H, D), dtype=np.float32)
    idx = np.stack([np.sort(rng.choice(NKV, CAPACITY, replace=False)) for _ in range(B * H * NQ)])
    idx = idx.reshape(B, H, NQ, CAPACITY).astype(np.int32)
    num = rng.integers(0, CAPACITY + 1, (B, H, NQ)).astype(np.int32)
    kv_counts = rng.integers(1, E + 1, NKV).astype(np.int32)
    kv_counts[-1] = E
    return dict(q=q, k=k, v=v, dout=dout, idx=idx, num=num, kv_counts=kv_counts)


def bits(x) -> np.ndarray:
    """The bits of x as fp32 (bf16 -> fp32 is exact, so equal bits here are equal bf16 bits)."""
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def run_torch(d, device: str = "cuda"):
    dev = torch.device(device)
    q, k, v = (torch.tensor(d[n], device=dev, dtype=torch.bfloat16, requires_grad=True) for n in ("q", "k", "v"))
    out, lse = vsa_torch.block_sparse_attn_from_indices(
        q, k, v, torch.tensor(d["idx"], device=dev), torch.tensor(d["num"], device=dev),
        torch.tensor(d["kv_counts"], device=dev), E, layout="bshd", backend="triton")
    out.backward(torch.tensor(d["dout"], device=dev, dtype=torch.bfloat16))
    got = {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {n: bits(t.detach().float().cpu().numpy()) for n, t in got.items()}


def run_jax(d):
    """The call traced once under jit (what the launch path decides at trace time), run once."""
    q, k, v = (jnp.asarray(d[n], jnp.bfloat16) for n in ("q", "k", "v"))

    def attn(q, k, v):
        return vsa_jax.block_sparse_attn_from_indices(q, k, v, jnp.asarray(d["idx"]), jnp.asarray(d["num"]),
                                                      jnp.asarray(d["kv_counts"]), E, layout="bshd",
                                                      backend="triton")

    def out_and_grads(q, k, v, dout):
        (out, lse), vjp = jax.vjp(attn, q, k, v)
        return (out, lse) + vjp((dout, jnp.zeros_like(lse)))

    fn = jax.jit(out_and_grads)
    dout = jnp.asarray(d["dout"], jnp.bfloat16)
    text = fn.lower(q, k, v, dout).as_text()
    launch = "native" if native.FFI_TARGET in text and "callback" not in text else "callback"
    out, lse, dq, dk, dv = fn(q, k, v, dout)
    print(f"JAX launch: {launch}")
    if launch != ("callback" if "--callback" in sys.argv else "native"):
        raise SystemExit(f"JAX ran the {launch} launch")
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    return {n: bits(np.asarray(x.astype(jnp.float32))) for n, x in got.items()}


def main() -> int:
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        print("SKIP: needs torch and JAX on a GPU")
        return 0
    configure(autotune=True)  # whatever VSA_AUTOTUNE says: this check is about tuned tiles
    if "--callback" in sys.argv:
        configure(jax_launch="callback")
    d = draw()
    first, second = (run_jax, run_torch) if "--jax-first" in sys.argv else (run_torch, run_jax)
    got = {first: first(d)}
    tuned = TILES.entries()
    got[second] = second(d)
    assert TILES.entries() == tuned, f"{second.__name__} chose tiles of its own for a problem already tuned"
    print(f"tile configs chosen ({first.__name__}; {second.__name__} reused them): {tuned}")
    torch_got, jax_got = got[run_torch], got[run_jax]
    bad = [n for n in torch_got if not np.array_equal(torch_got[n], jax_got[n])]
    for n in bad:
        print(f"{n}: {int((torch_got[n] != jax_got[n]).sum())} of {torch_got[n].size} elements differ")
    if bad:
        print("MISMATCH: " + ", ".join(bad))
        return 1
    print("ALL EQUAL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
