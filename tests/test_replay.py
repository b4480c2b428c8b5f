"""The thin eager path (`vsa_core.replay`, `vsa_torch.ops._run_stage`): a stage's launches
captured once per key and replayed on new buffers, and the frontend's memo of a call's
checked problem (`FrontendAdapter.known_problem`).

On the GPU: the replayed calls equal the first (plain) call bit for bit (the Triton
backend's kernels are deterministic) and the float64 reference, on new buffers, on inputs
whose alignment differs (another key), and the replay is really used (the tests look it up).
On the CPU: where a capture refuses (interpreted kernels, memory outside the call's buffers,
overlapping or aliased buffers), and that the memo never serves a call another call's
problem nor skips a value check."""

import numpy as np
import pytest
import torch

import vsa_torch
from common import Case, assert_close, make_inputs, reference
from vsa_core.backends._torch_views import viewer
from vsa_core.launch import Launcher
from vsa_core.replay import CapturingLauncher, Replay
from vsa_core.runtime import DeviceBuffer, DeviceInfo
from vsa_torch import ops as torch_ops

FAKE = DeviceInfo("cuda", 0, (9, 0))


def fake(ptr: int, n: int, dtype="float32") -> DeviceBuffer:
    return DeviceBuffer(ptr, dtype, (n,), FAKE)  # an address only: nothing reads it here


# ---- CPU: what a capture maps and what it refuses ----------------------------------------------
def test_capture_places_buffers_and_views_and_refuses_ambiguity():
    a, b = fake(0x10000, 64), fake(0x20000, 64)
    shared = fake(0x30000, 16)
    cap = CapturingLauncher({"a": a, "b": b, "s1": shared, "s2": shared, "gone": None})
    assert cap._place(shared) == ("s1", 0)  # one object under two names: its first (the key says which share)
    assert cap._place(a) == ("a", 0)
    assert cap._place(b) == ("b", 0)
    assert cap._place(fake(0x20000 + 64, 8)) == ("b", 64)      # a view inside b
    assert cap._place(fake(0x20000 + 200, 32)) is None          # runs past b's end
    assert cap._place(fake(0x40000, 4)) is None                 # nobody's memory
    assert cap._place(fake(0x30000 + 4, 2)) is None             # a view of the shared object: inside both names


def test_capture_keeps_cute_steps_and_workspaces_and_replays_them_on_views(monkeypatch):
    """A CuTe DSL launch is run (the eager launcher's work) and kept as a step: each buffer as
    (name, byte offset, geometry), a scratch buffer from `launcher.workspace` placed in the
    replay's workspace allocation. The replay calls the step's function again on views of
    the new buffers: the buffer itself where the capture saw it whole, else a view at the
    same offset, with the captured statics."""
    from vsa_core.backends import sm90_backend
    seen = []

    def step(buffers, **statics):
        seen.append(({n: t if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t)
                      for n, t in buffers.items()}, statics))
    monkeypatch.setitem(sm90_backend.CUTE_STEPS, "sm90_fwd64", step)
    a, b = torch.randn(64), torch.randn(4, 16)
    cap = CapturingLauncher({"a": a, "b": b, "gone": None})
    w = cap.workspace("w", (4, 8), "float32", a)
    cap.cute("sm90_fwd64", {"x": a, "y": b[1:3, ::2], "ws": w, "absent": None}, head_dim=64, config={"k_stages": 1})
    assert len(seen) == 1
    replay, why = cap.replay()
    assert why is None and replay.needs_views
    assert replay.buffers == ("a", "b") and replay.workspace == (("w", 0),) and replay.workspace_bytes == 128
    with pytest.raises(ValueError, match="needs a view"):
        replay.run({"a": a, "b": b}, stream=0)

    new_a, new_b = torch.randn(64), torch.randn(4, 16)
    space = torch.empty(replay.workspace_bytes, dtype=torch.uint8)
    view = viewer({"a": (new_a, 0), "b": (new_b, 0), "w": (space, 0)})
    replay.run({"a": new_a, "b": new_b}, stream=0, workspace=space.data_ptr(), view=view)
    got, statics = seen[1]
    assert statics == {"head_dim": 64, "config": {"k_stages": 1}}
    assert set(got) == {"x", "y", "ws", "absent"} and got["absent"] is None
    assert got["x"][4] is new_a
    assert got["y"][:4] == (new_b.data_ptr() + 16 * 4, (2, 8), (16, 2), torch.float32)
    assert torch.equal(got["y"][4], new_b[1:3, ::2])
    assert got["ws"][:4] == (space.data_ptr(), (4, 8), (8, 1), torch.float32)


def test_capture_refuses_a_cute_step_on_memory_outside_the_buffers(monkeypatch):
    from vsa_core.backends import sm90_backend
    monkeypatch.setitem(sm90_backend.CUTE_STEPS, "sm90_fwd64", lambda buffers, **statics: None)
    a, elsewhere = torch.randn(8), torch.randn(8)
    cap = CapturingLauncher({"a": a})
    cap.cute("sm90_fwd64", {"x": elsewhere}, head_dim=64)
    replay, why = cap.replay()
    assert replay is None and "sm90_fwd64's x" in why


def test_capture_refuses_overlapping_buffers():
    outer, inner = fake(0x10000, 64), fake(0x10000 + 16, 8)
    cap = CapturingLauncher({"outer": outer, "inner": inner})
    assert cap._place(inner) == ("inner", 0)                    # the object itself: unambiguous
    assert cap._place(fake(0x10000 + 20, 2)) is None            # a view inside both


def test_replay_launches_each_step_on_the_new_addresses_and_the_workspace():
    """Replay.run with a stand-in for the compiled kernel's runner: every pointer argument is
    the new buffer's address plus the captured offset, workspaces sit in the one allocation at
    aligned offsets, constants pass unchanged, a descriptor is rebuilt on its new base."""
    from dataclasses import dataclass
    from vsa_core.replay import TritonStep

    @dataclass
    class Desc:  # what the replay reads of a TMA descriptor
        base: object
        shape: list
        block_shape: list

    seen = []
    runner = lambda *args, stream: seen.append((args, stream))  # noqa: E731
    a, b, w1, w2 = fake(0x10000, 64), fake(0x20000, 64), fake(0x30000, 10), fake(0x40000, 3, "int32")
    cap = CapturingLauncher({"a": a, "b": b, "w1": w1, "w2": w2}, workspaces=["w1", "w2"])
    place = cap._place
    steps = (TritonStep("k1", runner, (None, 7, None, None), ((0, *place(a)), (2, *place(w1)), (3, *place(w2))), ()),
             TritonStep("k2", runner, (None, 2.5), ((0, *place(fake(0x20000 + 32, 4))),),
                        ((1, "a", 0, Desc(a, [64], [16])),)))
    cap._steps = list(steps)
    replay, why = cap.replay()
    assert why is None and replay.buffers == ("a", "b")
    assert dict(replay.workspace) == {"w1": 0, "w2": 256} and replay.workspace_bytes == 256 + 12
    new_a, new_b = fake(0x90000, 64), fake(0xA0000, 64)
    replay.run({"a": new_a, "b": new_b}, stream=5, workspace=0xF000)
    (args1, s1), (args2, s2) = seen
    assert args1 == (0x90000, 7, 0xF000, 0xF000 + 256) and s1 == 5
    assert args2[0] == 0xA0000 + 32
    assert args2[1].base.data_ptr() == 0x90000 and args2[1].shape == [64] and args2[1].block_shape == [16]
    assert steps[1].descriptors[0][3].base is a  # the captured descriptor is left as it was


def test_capture_keeps_no_buffer_of_the_captured_call():
    """A kept launch holds a TMA descriptor's geometry, not the descriptor's base: a replay
    outlives its call, and a buffer it kept alive would be a leak (under CUDA-graph trees, an
    allocation the recording's pool does not account for)."""
    import gc
    import weakref

    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def kernel(desc, ptr, n):
        pass

    class Compiled:  # what Triton's launch returns: indexed by the grid for its runner
        function = object()

        def __getitem__(self, grid):
            return lambda *args, stream: None

    base, other = torch.randn(64, 32), torch.randn(16)
    cap = CapturingLauncher({"base": base, "other": other})
    cap._keep(kernel, Compiled(), (4,), (TensorDescriptor(base, [64, 32], [32, 1], [16, 32]), other, 16), {})
    replay, why = cap.replay()
    assert why is None and replay.buffers == ("base", "other")
    (step,) = replay.steps
    assert step.pointers == ((1, "other", 0),) and step.constants[2] == 16
    (i, name, offset, desc), = step.descriptors
    assert (i, name, offset) == (0, "base", 0) and desc.shape == [64, 32] and desc.block_shape == [16, 32]
    assert desc.base.dtype == base.dtype
    alive = weakref.ref(base)
    del cap, base
    gc.collect()
    assert alive() is None, "the replay keeps the captured call's buffer alive"


class _Compiled:
    """What Triton's launch returns, as far as `triton_shim.compiled_launcher` reads it: indexed
    by the grid for its runner, and its launcher `run` with the kernel's function and metadata.
    Each records the launches it is given."""

    function, packed_metadata = object(), object()

    def __init__(self):
        self.launched, self.ran = [], []

    def __getitem__(self, grid):
        return lambda *args, stream: self.ran.append((grid, args, stream))

    def run(self, *args):
        self.launched.append(args)


def test_compiled_launcher_skips_the_runner_only_while_no_launch_hook_is_registered():
    """Replayed launches call the kernel's launcher directly, without launch metadata or hooks;
    with a hook registered (a profiler) they go through Triton's runner, which calls it."""
    from triton import knobs
    from vsa_core.triton_shim import compiled_launcher

    compiled = _Compiled()
    launch = compiled_launcher(compiled, (3, 2, 1))
    launch(10, 20, stream=7)
    assert compiled.launched == [(3, 2, 1, 7, compiled.function, compiled.packed_metadata, None, None, None, 10, 20)]
    assert compiled.ran == []
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(11, 21, stream=8)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert compiled.ran == [((3, 2, 1), (11, 21), 8)] and len(compiled.launched) == 1
    launch(12, 22, stream=9)  # the hook removed: direct again
    assert len(compiled.launched) == 2 and len(compiled.ran) == 1


def test_replay_keys_tell_apart_every_property_a_capture_depends_on():
    """The eager operator's replay keys (`vsa_torch.ops._described`, `_backward_key`): equal for
    other buffers of the same description, different for another shape, strides, dtype, 16-byte
    alignment, absent array or sharing of one object; and they keep no array alive."""
    import gc
    import weakref

    def arrays(**change):
        x = dict(q=torch.randn(2, 3, 64, 16), k=torch.randn(2, 3, 64, 16), counts=torch.zeros(4, dtype=torch.int32),
                 gate=None)
        x.update(change)
        return list(x.values())

    key = torch_ops._described
    base = key(arrays())
    assert key(arrays()) == base  # new buffers, same description: the capture serves them
    flat = torch.empty(2 * 3 * 64 * 16 + 2)
    others = {
        "shape": arrays(k=torch.randn(2, 3, 32, 16)),
        "strides": arrays(k=torch.randn(2, 64, 3, 16).transpose(1, 2)),
        "dtype": arrays(k=torch.randn(2, 3, 64, 16, dtype=torch.float64)),
        "alignment": arrays(k=flat[2:].view(2, 3, 64, 16)),  # 8 bytes in: not 16-byte aligned
        "absent": arrays(gate=torch.randn(2, 3, 64, 16)),
    }
    for what, changed in others.items():
        assert key(changed) != base, what
    q = torch.randn(2, 3, 64, 16)
    assert key(arrays(q=q, k=q)) != key(arrays(q=q, k=q.clone())), "sharing"
    shared = torch.zeros(4, dtype=torch.int32)
    assert key([shared, shared]) != key([shared, shared.clone()]), "sharing"

    dout, kept, out, lse = torch.randn(2, 3, 64, 16), arrays()[:2], torch.randn(2, 3, 64, 16), torch.randn(2, 3, 64)
    backward = torch_ops._backward_key(("forward", base), (dout, *kept, out, lse))
    assert torch_ops._backward_key(("forward", base), (dout.clone(), *kept, out, lse)) == backward
    assert torch_ops._backward_key(("forward", base), (out, *kept, out, lse)) != backward, "dout is out"
    assert torch_ops._backward_key(("forward", base), (flat[2:].view(2, 3, 64, 16), *kept, out, lse)) != backward
    assert torch_ops._backward_key(("forward", key(arrays(q=q, k=q))), (dout, *kept, out, lse)) != backward

    alive = weakref.ref(q)
    kept_keys = (key(arrays(q=q)), torch_ops._backward_key(("forward", base), (q, *kept, out, lse)))
    del q
    gc.collect()
    assert alive() is None and kept_keys, "a replay key keeps an array alive"


def test_call_key_tells_apart_static_values_of_another_type_and_arrays_of_another_description():
    """The memo of checked problems (`TorchFrontend.call_key`): 2, 2.0 and True key apart (the
    checks tell them apart), tuples and float subclasses too; another stride or dtype is
    another key; equal arguments are one key."""
    from vsa_torch.adapter import TORCH

    q = torch.randn(1, 2, 64, 16)

    def key(topk, x=q, prefix=0):
        return TORCH.call_key(("vsa", topk, 64, "bhsd", "triton", prefix, "exempt", None, "zeros"), x, None)

    assert key(2) == key(2) and key(2) is not None
    assert len({key(2), key(2.0), key(True), key(1)}) == 4
    assert key(1, prefix=(1, 2)) == key(1, prefix=(1, 2)) != key(1, prefix=(1.0, 2))
    assert key(np.float64(2.0)) == key(np.float64(2.0)) != key(2.0)
    assert key(2, x=q.to(torch.float64)) != key(2)
    assert key(2, x=torch.randn(1, 64, 2, 16).transpose(1, 2)) != key(2)
    assert key(2, x=np.zeros((1, 2, 64, 16))) is None  # not a tensor: not memoized


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launches (CPU)")
def test_capture_of_interpreted_launches_is_refused_with_a_reason():
    from vsa_core import ops as core_ops
    from vsa_core.backends import backend_named
    from vsa_core.spec import forward_arguments
    case = Case()
    inputs = make_inputs(case, seed=0)
    x = {n: torch.from_numpy(inputs[n]).to(torch.bfloat16) for n in ("q", "k", "v", "gate")}
    counts = {n: torch.from_numpy(inputs[n]).to(torch.int32) for n in ("kv_counts", "q_counts")}
    statics, scale = torch_ops.statics_for(_problem(case, x, counts), "triton", {**x, **counts})
    s = torch_ops._statics(statics, scale)
    named_inputs = [{**x, **counts}[n] for n in torch_ops._input_names(statics)]
    p, named = forward_arguments(s, named_inputs)
    buffers = {**named, **torch_ops._alloc(p.forward_buffers(), named["q"])}
    cap = CapturingLauncher(buffers)
    core_ops.forward(p, backend_named("triton"), buffers, adapter=torch_ops.TORCH_BUFFERS, launcher=cap)
    replay, why = cap.replay()
    assert replay is None and "compiled kernel" in why


def _problem(case, x, counts):
    from vsa_core.api import prepare_vsa
    return prepare_vsa(x["q"], x["k"], x["v"], counts["kv_counts"], counts["q_counts"], case.topk, case.block,
                       x["gate"]).problem


# ---- CPU and GPU: the memo of checked problems ----------------------------------------------------
def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _call(case, inputs, **kw):
    dtype = getattr(torch, case.dtype)
    x = {n: torch.from_numpy(inputs[n]).to(_device(), dtype) for n in ("q", "k", "v", "gate")}
    counts = {n: torch.from_numpy(inputs[n]).to(_device(), torch.int32) for n in ("kv_counts", "q_counts")}
    out = vsa_torch.video_sparse_attn(x["q"], x["k"], x["v"], counts["kv_counts"], counts["q_counts"], case.topk,
                                      case.block, x["gate"], backend="triton", **kw)
    return out.float().cpu().numpy()


def test_memoized_problem_is_never_another_shapes():
    small, large = Case(n_q_blocks=2, n_kv_blocks=3), Case(n_q_blocks=3, n_kv_blocks=4)
    for case in (small, large, small):
        inputs = make_inputs(case, seed=5)
        assert_close(case, {"out": _call(case, inputs)}, {"out": reference(case, inputs)["out"]})


def test_memoized_call_still_checks_arguments_and_values():
    case = Case()
    inputs = make_inputs(case, seed=6)
    _call(case, inputs)
    _call(case, inputs)  # memoized from here on
    bad_dtype = dict(inputs, gate=inputs["gate"])
    with pytest.raises((TypeError, ValueError), match="compress_attn_weight"):
        dtype = getattr(torch, case.dtype)
        x = {n: torch.from_numpy(bad_dtype[n]).to(_device(), dtype) for n in ("q", "k", "v")}
        counts = torch.from_numpy(inputs["kv_counts"]).to(_device(), torch.int32)
        qc = torch.from_numpy(inputs["q_counts"]).to(_device(), torch.int32)
        gate = torch.from_numpy(bad_dtype["gate"]).to(_device(), torch.float32)  # not q's dtype
        vsa_torch.video_sparse_attn(x["q"], x["k"], x["v"], counts, qc, case.topk, case.block, gate, backend="triton")
    with pytest.raises(TypeError, match="topk"):  # equal to the memoized call's topk, not an int
        dtype = getattr(torch, case.dtype)
        x = {n: torch.from_numpy(inputs[n]).to(_device(), dtype) for n in ("q", "k", "v", "gate")}
        counts = torch.from_numpy(inputs["kv_counts"]).to(_device(), torch.int32)
        qc = torch.from_numpy(inputs["q_counts"]).to(_device(), torch.int32)
        vsa_torch.video_sparse_attn(x["q"], x["k"], x["v"], counts, qc, float(case.topk), case.block, x["gate"],
                                    backend="triton")
    too_many = dict(inputs, kv_counts=inputs["kv_counts"] + case.E)  # same shape and dtype, values > E
    with pytest.raises(ValueError, match="variable_block_sizes"):
        _call(case, too_many)


# ---- GPU: replays equal the plain call ------------------------------------------------------------
def _gpu_inputs(case, inputs, requires_grad=True, misalign=False, shared_counts=False):
    from common import to_layout
    dtype = getattr(torch, case.dtype)

    def tensor(name):
        t = torch.from_numpy(to_layout(inputs[name], case.layout)).to("cuda", dtype)
        if misalign:  # the same values 2 elements into a larger buffer: 4-byte, not 16-byte aligned
            flat = torch.empty(t.numel() + 2, device="cuda", dtype=dtype)
            flat[2:].copy_(t.reshape(-1))
            t = flat[2:].view(t.shape)
        return t.requires_grad_(requires_grad and name != "dout")
    x = {n: tensor(n) for n in ("q", "k", "v", "gate", "dout")}
    x.update({n: torch.from_numpy(inputs[n]).to("cuda", torch.int32) for n in ("kv_counts", "q_counts")})
    if shared_counts:  # one counts tensor for both, as self-attention callers often pass
        x["q_counts"] = x["kv_counts"]
    return x


def _step(case, x, layout="bhsd", padding="zeros", backend="triton"):
    fn = vsa_torch.video_sparse_attn if layout == "bhsd" else vsa_torch.video_sparse_attn_bshd
    q, k, v, gate = (x[n] for n in ("q", "k", "v", "gate"))
    out = fn(q, k, v, x["kv_counts"], x["q_counts"], case.topk, case.block, gate if case.gate else None,
             backend=backend, padding=padding)
    grads = torch.autograd.grad(out, (q, k, v, gate) if case.gate else (q, k, v), x["dout"])
    names = ("out", "dq", "dk", "dv", "dgate")
    from common import from_layout
    return {n: from_layout(t.detach().float().cpu().numpy(), case.layout) for n, t in zip(names, (out, *grads))}


def _replays():
    return [e for e in torch_ops._REPLAYS.values() if isinstance(e, Replay)]


def _replays_equal_the_plain_call(run, case, padding, seed, unordered=(), captured=None):
    """run(inputs) -> results, called plain (it may tune), then captured (`captured()` then checks
    the capture), then twice replayed: on the same values, equal to the plain call (bitwise, except
    the gradients in `unordered`, which the kernels reduce in varying order: within bf16
    rounding), and on new values, close to the float64 reference."""
    inputs = make_inputs(case, seed=seed)
    first = run(inputs)
    run(inputs)
    if captured is not None:
        captured()
    for s in (seed, seed + 1):
        fresh = make_inputs(case, seed=s)
        got = run(fresh)
        if s == seed:
            for n in got:
                if n in unordered:
                    np.testing.assert_allclose(got[n], first[n], rtol=1e-2, atol=1e-2)
                else:
                    assert np.array_equal(got[n], first[n]), f"{n}: the replay differs from the plain call"
        ref = reference(case, fresh, padding=padding)
        assert_close(case, got, {n: ref[n] for n in got})


GPU_CASES = {
    "vsa-bhsd-gate": (Case(head_dim=128, n_q_blocks=5, n_kv_blocks=6, topk=3), "bhsd", "zeros"),
    "vsa-bshd-ignore": (Case(head_dim=64, n_q_blocks=4, n_kv_blocks=5, gate=False, layout="bshd"), "bshd", "ignore"),
}


@pytest.mark.gpu
def test_gpu_one_counts_tensor_for_both_and_then_two():
    """Captured with q_counts and kv_counts one tensor, replayed only for calls that pass one
    tensor too: a call with two distinct tensors (different values) gets its own replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    full = Case(head_dim=128, n_q_blocks=4, n_kv_blocks=4, topk=2, partial_q=False, partial_kv=False)
    partial = Case(head_dim=128, n_q_blocks=4, n_kv_blocks=4, topk=2)  # same shapes, other counts
    torch_ops._REPLAYS.clear()
    same = make_inputs(full, seed=14)
    assert np.array_equal(same["q_counts"], same["kv_counts"])
    for _ in range(3):
        got = _step(full, _gpu_inputs(full, same, shared_counts=True))
    ref = reference(full, same)
    assert_close(full, got, {n: ref[n] for n in got})
    two = make_inputs(partial, seed=15)
    assert not np.array_equal(two["q_counts"], two["kv_counts"])
    for _ in range(3):
        got = _step(partial, _gpu_inputs(partial, two))
    ref = reference(partial, two)
    assert_close(partial, got, {n: ref[n] for n in got})
    assert len(_replays()) == 4  # forward and backward of each


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_replay_equals_the_plain_call_bitwise(name):
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    case, layout, padding = GPU_CASES[name]
    torch_ops._REPLAYS.clear()

    def captured():
        assert len(_replays()) == 2, torch_ops._REPLAYS  # forward and backward
    _replays_equal_the_plain_call(lambda x: _step(case, _gpu_inputs(case, x), layout, padding), case, padding, 11,
                                  captured=captured)
    assert len(_replays()) == 2  # replayed, not captured again


@pytest.mark.gpu
def test_gpu_misaligned_inputs_get_their_own_replay():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    case = Case(head_dim=128, n_q_blocks=4, n_kv_blocks=5, topk=2)
    torch_ops._REPLAYS.clear()
    inputs = make_inputs(case, seed=13)
    for _ in range(3):
        aligned = _step(case, _gpu_inputs(case, inputs))
    for _ in range(3):
        shifted = _step(case, _gpu_inputs(case, inputs, misalign=True))
    ref = reference(case, inputs)
    assert_close(case, shifted, {n: ref[n] for n in shifted})
    assert_close(case, aligned, {n: ref[n] for n in aligned})
    keys = [k for k, e in torch_ops._REPLAYS.items() if isinstance(e, Replay) and k[0] == "forward"]
    assert len(keys) == 2, "aligned and misaligned inputs share a replay"


@pytest.mark.gpu
def test_gpu_replay_off_runs_every_call_through_the_stages(monkeypatch):
    """With `replay=False` (benchmarks timing the stages' launch functions) no call is captured
    and every call reaches the stages: one block_mean_pool_qkv per forward."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from vsa_core import stages
    from vsa_core.config import overridden
    case, layout, padding = GPU_CASES["vsa-bhsd-gate"]
    torch_ops._REPLAYS.clear()
    pooled = []
    pool = stages.block_mean_pool_qkv
    monkeypatch.setattr(stages, "block_mean_pool_qkv", lambda *a, **kw: pooled.append(1) or pool(*a, **kw))
    inputs = make_inputs(case, seed=16)
    with overridden(replay=False):
        for _ in range(3):
            got = _step(case, _gpu_inputs(case, inputs), layout, padding)
    assert not _replays() and len(pooled) == 3
    ref = reference(case, inputs, padding=padding)
    assert_close(case, got, {n: ref[n] for n in got})


# backends whose own launches are steps (`vsa_core.replay.CuteStep`): a case that keeps the default
# padding and one of padding="ignore" (its copies are workspaces), and the gradients their kernels do
# not form bitwise the same run to run (fp32 reductions in varying order)
STEP_BACKENDS = {
    "sm90": ((Case(head_dim=128, n_q_blocks=5, n_kv_blocks=6, topk=3), "bhsd", "zeros"),
             (Case(head_dim=64, n_q_blocks=4, n_kv_blocks=5, gate=False, layout="bshd"), "bshd", "ignore"), ("dq",)),
    "cudnn": ((Case(head_dim=128, n_q_blocks=5, n_kv_blocks=6, topk=3), "bhsd", "zeros"),
              (Case(head_dim=128, n_q_blocks=4, n_kv_blocks=5, gate=False, layout="bshd"), "bshd", "ignore"),
              ("dq", "dk", "dv")),
    "cute": ((Case(block=128, head_dim=128, n_q_blocks=3, n_kv_blocks=4, batch=1), "bhsd", "zeros"),
             (Case(block=256, head_dim=64, n_q_blocks=2, n_kv_blocks=3, batch=1, gate=False, layout="bshd"), "bshd",
              "ignore"), ("dq",)),
}
STEP_CASES = {f"{b}-{i}": (b, *cases[i], cases[2]) for b, cases in STEP_BACKENDS.items() for i in (0, 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(STEP_CASES))
def test_gpu_step_backend_replay_equals_the_plain_call(name):
    """A backend with steps and workspaces (padding="ignore"'s copies, its lists and
    accumulators) is captured and replayed like the Triton backend: the replay equals the
    plain call (bitwise where the kernels are deterministic) and float64 on new values."""
    from common import missing, skip_unavailable
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the step backends' kernels here are sm_90 code")
    backend, case, layout, padding, unordered = STEP_CASES[name]
    skip_unavailable(backend, missing(backend))
    torch_ops._REPLAYS.clear()

    def captured():
        assert len(_replays()) == 2, torch_ops._REPLAYS  # forward and backward
        assert all(r.needs_views for r in _replays())
    _replays_equal_the_plain_call(lambda x: _step(case, _gpu_inputs(case, x), layout, padding, backend), case, padding,
                                  21, unordered, captured)
    assert len(_replays()) == 2  # replayed, not captured again


# ---- CPU: what the step backends ask of the launcher -------------------------------------------
class _Recorder(Launcher):  # records, runs nothing
    def __init__(self):
        self.asked, self.steps = {}, []

    @property
    def runs_kernels(self) -> bool:
        return False

    def triton(self, kernel, grid, *args, **meta) -> None:
        pass

    def cute(self, step, buffers, **statics) -> None:
        self.steps.append((step, {n for n, b in buffers.items() if b is not None}))

    def workspace(self, name, shape, dtype, like):
        assert name not in self.asked, f"workspace {name} asked for twice"
        self.asked[name] = (tuple(shape), dtype)
        return torch.empty(shape, dtype=like.dtype if dtype == "input" else getattr(torch, dtype))


STEP_PROBLEMS = {"sm90": dict(block_elems=64, head_dim=128), "cudnn": dict(block_elems=64, head_dim=128),
                 "cute": dict(block_elems=256, head_dim=64)}


@pytest.mark.parametrize("padding", ["zeros", "ignore"])
@pytest.mark.parametrize("backend", list(STEP_PROBLEMS))
def test_step_backends_ask_for_their_declared_workspaces_and_run_two_steps(backend, padding):
    """Each stage of a step backend asks `launcher.workspace` only for what its `workspaces(stage,
    problem)` table declares, in the declared shape and dtype (the copies of padding="ignore" only
    under "ignore"), and hands its library one step per stage."""
    from vsa_core import ops as core_ops
    from vsa_core.backends import backend_named
    from vsa_core.problem import AttnProblem
    impl = backend_named(backend)
    E = STEP_PROBLEMS[backend]["block_elems"]
    p = AttnProblem(batch=1, heads=2, q_len=3 * E, kv_len=4 * E, dtype="bfloat16", topk=2, has_gate=True,
                    padding=padding, **STEP_PROBLEMS[backend])
    inputs = {n: torch.randn(p.token_shape(p.q_len if n in ("q", "gate") else p.kv_len)).to(torch.bfloat16)
              for n in ("q", "k", "v", "gate")}
    inputs["q_counts"] = torch.full((p.n_q_blocks,), E, dtype=torch.int32)
    inputs["kv_counts"] = torch.full((p.n_kv_blocks,), E, dtype=torch.int32)
    fwd = {**inputs, **torch_ops._alloc(p.forward_buffers(), inputs["q"])}
    rec = _Recorder()
    core_ops.forward(p, impl, fwd, adapter=torch_ops.TORCH_BUFFERS, launcher=rec)
    bwd = {**fwd, "dout": torch.randn_like(inputs["q"]), **torch_ops._alloc(p.backward_buffers(), inputs["q"])}
    rec_b = _Recorder()
    core_ops.backward(p, impl, bwd, adapter=torch_ops.TORCH_BUFFERS, launcher=rec_b)
    for stage, r in (("forward", rec), ("backward", rec_b)):
        table = impl.workspaces(stage, p)
        assert r.asked == {n: table[n] for n in r.asked}, stage
        copies = {n for n in r.asked if n.endswith("_valid")}
        want = {"k_valid", "v_valid"} | ({"q_valid", "dout_valid"} if stage == "backward" else set())
        assert copies == (want if padding == "ignore" else set()), (stage, copies)
        assert len(r.steps) == 1, r.steps
        step, names = r.steps[0]
        assert names >= {"q", "k", "v", "lse"}, names


# ---- GPU: JAX's callback replays too ------------------------------------------------------------
JAX_CALLBACK_BACKENDS = {"triton": STEP_BACKENDS["sm90"][:2] + ((),), **STEP_BACKENDS}


@pytest.mark.gpu
@pytest.mark.parametrize("name", [f"{b}-{i}" for b in JAX_CALLBACK_BACKENDS for i in (0, 1)])
def test_gpu_jax_callback_replay_equals_the_plain_call(name):
    """Under JAX's buffer callback (forced for triton and sm90, which launch natively by default)
    a stage is run, then captured, then replayed: the replays equal the plain call (bitwise where
    the kernels are deterministic) and float64 on new values, and are really used."""
    from common import missing, require_jax_gpu, skip_unavailable
    from frontends import run_jax_vjp
    from vsa_core.config import overridden
    from vsa_jax import ops as jax_ops
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    require_jax_gpu()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the step backends' kernels here are sm_90 code")
    backend, index = name.rsplit("-", 1)
    case, layout, padding = JAX_CALLBACK_BACKENDS[backend][int(index)][:3]
    unordered = JAX_CALLBACK_BACKENDS[backend][2]
    skip_unavailable(backend, missing(backend))
    with overridden(jax_launch="callback"):
        _replays_equal_the_plain_call(lambda x: run_jax_vjp(case, x, backend, padding=padding), case, padding, 31,
                                      unordered)
    used = [e for stage, p, impl, entries in jax_ops.callback_replays() if impl == backend
            and p.padding == padding and p.layout == layout for e in entries.values()]
    assert sum(isinstance(e, Replay) for e in used) >= 2, used  # forward and backward


def test_views_of_device_buffers_name_their_dtype_by_string():
    """A capture of JAX's callback keeps DeviceBuffer dtypes (strings); the views are torch tensors
    of the same memory at the same offset."""
    base = torch.arange(64, dtype=torch.float32)
    buf = DeviceBuffer(base.data_ptr(), "float32", (64,), DeviceInfo("cpu"), owner=base)
    view = viewer({"a": (buf, 0)})
    got = view("a", 8, (2, 4), (8, 1), "float32")
    assert got.data_ptr() == base.data_ptr() + 8 and torch.equal(got, base[2:18].view(2, 8)[:, :4])
