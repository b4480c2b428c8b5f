"""First contact (issue 15, section 2): what a new user meets around the operator: the
token-order helpers' length checks, the metadata's repr, errors that say what disagrees,
the CPU warning's location and wording, the docstrings, FastVideo's error wording, demo.py."""

import numpy as np
import pytest

import jax.numpy as jnp
import torch

import vsa_jax
import vsa_torch
from vsa_core import build_vsa_metadata
from common import skip_if_interpreter_broken

FRONTENDS = {"torch": (vsa_torch, lambda a: torch.from_numpy(np.ascontiguousarray(a))),
             "jax": (vsa_jax, jnp.asarray)}


# ---- 1. to_tiled / from_tiled check the token count -------------------------------------------------
@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("delta", [-284, -1, 1, 64])
def test_tiling_helpers_check_the_token_count(frontend, delta):
    """Too short (a bare IndexError in torch, silent NaN in JAX before) or too long (silently
    truncated before): a ValueError naming the argument and the expected length."""
    fe, make = FRONTENDS[frontend]
    meta = build_vsa_metadata((6, 8, 8), (4, 4, 4))  # 384 raw tokens, 8 tiles -> 512 tiled
    raw = make(np.ones((1, 2, meta.num_tokens + delta, 64), np.float32))
    with pytest.raises(ValueError, match=rf"x must have 384 tokens along dim 2 .*got {384 + delta}"):
        fe.to_tiled(raw, meta)
    tiled = make(np.ones((1, 2, meta.padded_len + delta, 64), np.float32))
    with pytest.raises(ValueError, match=rf"x must have 512 tokens along dim 2 .*got {512 + delta}"):
        fe.from_tiled(tiled, meta)
    with pytest.raises(ValueError, match=r"x must have 512 tokens along dim 2 .*got 384 .*the raw length"):
        fe.from_tiled(make(np.ones((1, 2, meta.num_tokens, 64), np.float32)), meta)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_tiling_helpers_suggest_dim_1_for_bshd(frontend):
    fe, make = FRONTENDS[frontend]
    meta = build_vsa_metadata((6, 8, 8), (4, 4, 4))
    bshd = make(np.ones((1, meta.num_tokens, 2, 64), np.float32))
    with pytest.raises(ValueError, match=r"BSHD arrays: pass dim=1"):
        fe.to_tiled(bshd, meta)
    tiled = fe.to_tiled(bshd, meta, dim=1)
    assert tuple(tiled.shape) == (1, meta.padded_len, 2, 64)
    np.testing.assert_array_equal(np.asarray(fe.from_tiled(tiled, meta, dim=1)), np.asarray(bshd))


def test_tiling_check_is_free_under_jit():
    """JAX: the check reads static shapes only, so it runs at trace time inside jit."""
    import jax
    meta = build_vsa_metadata((6, 8, 8), (4, 4, 4))
    f = jax.jit(lambda x: vsa_jax.from_tiled(vsa_jax.to_tiled(x, meta), meta))
    x = jnp.arange(2 * meta.num_tokens * 64, dtype=jnp.float32).reshape(1, 2, meta.num_tokens, 64)
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    with pytest.raises(ValueError, match="x must have 384 tokens"):
        f(x[:, :, :100])


def test_numpy_tiling_checks_too():
    meta = build_vsa_metadata((5, 6, 7), (4, 4, 4))
    with pytest.raises(ValueError, match=r"x must have 210 tokens along dim 1"):
        meta.to_tiled(np.zeros((2, 211, 3)), axis=1)
    with pytest.raises(ValueError, match=rf"x must have {meta.padded_len} tokens along dim 1"):
        meta.from_tiled(np.zeros((2, 210, 3)), axis=1)


# ---- 7. a short repr ---------------------------------------------------------------------------------
def test_metadata_repr_is_short():
    meta = build_vsa_metadata((5, 6, 7), (4, 4, 4))
    text = repr(meta)
    assert "\n" not in text and len(text) < 240, text
    for fact in ("video_shape=(5, 6, 7)", "tile_size=(4, 4, 4)", "num_tiles=(2, 2, 2)", "8 blocks of 64 tokens",
                 "7 partial", "num_tokens=210", "padded_len=512"):
        assert fact in text, (fact, text)
    assert str(meta) == text


# ---- 9. FastVideo's wording for an unsupported tile --------------------------------------------------
@pytest.mark.parametrize("tile,volume", [((3, 3, 3), 27), ((2, 4, 4), 32), ((8, 8, 8), 512)])
def test_unsupported_tile_volume_uses_fastvideo_wording(tile, volume):
    with pytest.raises(ValueError, match=rf"Unsupported VSA tile volume {volume}\b"):
        build_vsa_metadata((8, 8, 8), tile)


# ---- 3. errors that say what disagrees -------------------------------------------------------------
def _vsa_args(frontend, layout="bhsd", S=512, dtype=np.float16):
    _, make = FRONTENDS[frontend]
    shape = (1, 2, S, 64) if layout == "bhsd" else (1, S, 2, 64)
    q = make(np.zeros(shape, dtype))
    return q, q, q


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_block_size_that_disagrees_with_the_counts_is_named(frontend):
    """Counts built for (4, 4, 4) tiles (8 blocks of 64) but block_size (4, 4, 8): the
    message gives the counts' expected length, how it follows from S and block_size, and
    the block size the counts' length makes."""
    fe, _ = FRONTENDS[frontend]
    q, k, v = _vsa_args(frontend)
    counts = build_vsa_metadata((8, 8, 8), (4, 4, 4)).variable_block_sizes
    with pytest.raises(ValueError, match=r"variable_block_sizes must have shape \(4,\) \(one count per block: k's 512 "
                                         r"tokens in 128-token blocks \(block_size=\(4, 4, 8\)\) are 4 blocks\), got "
                                         r"\(8,\): 8 counts make 64-token blocks of k, so if the counts are right, "
                                         r"block_size is not: pass the block_size the counts were built for"):
        fe.video_sparse_attn(q, k, v, counts, counts, 2, (4, 4, 8))
    with pytest.raises(ValueError, match=r"variable_block_sizes must have shape \(2,\) \(one count per block: k's 512 "
                                         r"tokens in 256-token blocks \(block_size=256\) are 2 blocks\), got \(8,\): "
                                         r"8 counts make 64-token blocks"):
        fe.block_sparse_attn(q, k, v, FRONTENDS[frontend][1](np.ones((1, 2, 2, 2), bool)), counts, 256)


def _message(call) -> str:
    with pytest.raises(ValueError) as caught:
        call()
    return str(caught.value)


@pytest.mark.parametrize("which", ["q_variable_block_sizes", "variable_block_sizes"])
def test_wrong_length_counts_give_the_expected_length(which):
    """Either count array of the wrong length: the same kind of message for both (its expected
    length, from S and block_size), in identical words in both frontends. A wrong-length
    q_variable_block_sizes is checked after variable_block_sizes agreed with block_size, so it
    does not blame block_size, even where its length would fit another block size."""
    right = np.full(4, 64, np.int32)
    for wrong, block_size_blamed in ((np.full(2, 64, np.int32), which == "variable_block_sizes"),
                                     (np.full(3, 64, np.int32), False)):
        messages = []
        for frontend in FRONTENDS:
            fe, _ = FRONTENDS[frontend]
            q, k, v = _vsa_args(frontend, S=256)
            kv, qc = (wrong, right) if which == "variable_block_sizes" else (right, wrong)
            messages.append(_message(lambda: fe.video_sparse_attn(q, k, v, kv, qc, 2, (4, 4, 4))))
        assert messages[0] == messages[1], messages
        seq = "k" if which == "variable_block_sizes" else "q"
        assert messages[0].startswith(f"{which} must have shape (4,) (one count per block: {seq}'s 256 tokens in "
                                      f"64-token blocks (block_size=(4, 4, 4)) are 4 blocks), got ({len(wrong)},)"), \
            messages[0]
        assert ("block_size is not" in messages[0]) == block_size_blamed, messages[0]


def _hinted(message: str) -> str:
    import re
    found = re.search(r"data use (.*)\)$", message)
    assert found, message
    return found.group(1)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_bshd_data_in_the_bhsd_function_suggests_the_layout(frontend):
    """The hint names a function of this frontend that takes the data as they are (its
    signature binds the same call), or an argument the called function really has."""
    import inspect
    fe, _ = FRONTENDS[frontend]
    q, k, v = _vsa_args(frontend, layout="bshd")  # [1, 512, 2, 64] given to the BHSD function
    counts = np.full(8, 64, np.int32)
    message = _message(lambda: fe.video_sparse_attn(q, k, v, counts, counts, 2, 64))
    assert message.startswith("q sequence length must be a positive multiple of the block size 64, got 2 (shape "
                              "(1, 512, 2, 64): [B, H, S, D] is read here; for [B, S, H, D] data use "
                              "video_sparse_attn_bshd)"), message
    assert "layout" not in inspect.signature(fe.video_sparse_attn).parameters and "layout=" not in message
    assert _hinted(message) == "video_sparse_attn_bshd"
    inspect.signature(fe.video_sparse_attn_bshd).bind(q, k, v, counts, counts, 2, 64)
    q, k, v = _vsa_args(frontend)  # and the other way round
    message = _message(lambda: fe.video_sparse_attn_bshd(q, k, v, counts, counts, 2, 64))
    assert "[B, S, H, D] is read here; for [B, H, S, D] data use video_sparse_attn)" in message, message
    inspect.signature(getattr(fe, _hinted(message))).bind(q, k, v, counts, counts, 2, 64)
    # the block-sparse functions take both layouts through their `layout` argument
    q, k, v = _vsa_args(frontend, layout="bshd")
    block_map = FRONTENDS[frontend][1](np.ones((1, 2, 8, 8), bool))
    indices, num = (FRONTENDS[frontend][1](np.zeros(shape, np.int32)) for shape in ((1, 2, 8, 1), (1, 2, 8)))
    for name, call in (("block_sparse_attn", lambda: fe.block_sparse_attn(q, k, v, block_map, counts, 64)),
                       ("block_sparse_attn_from_indices",
                        lambda: fe.block_sparse_attn_from_indices(q, k, v, indices, num, counts, 64))):
        message = _message(call)
        assert _hinted(message) == "the same function with layout='bshd'", message
        assert inspect.signature(getattr(fe, name)).parameters["layout"].kind is inspect.Parameter.KEYWORD_ONLY


# ---- 4. the CPU warning points at the caller's line, in the frontend's words -------------------------
WARNING_SCRIPTS = {
    "torch": ("import torch, vsa_torch\n"
              "q = torch.randn(1, 1, 64, 64, dtype=torch.bfloat16)\n"
              "out = vsa_torch.video_sparse_attn(q, q, q, [64], [64], 1, 64)  # line 3\n"),
    "jax": ("import jax.numpy as jnp, vsa_jax\n"
            "q = jnp.ones((1, 1, 64, 64), jnp.bfloat16)\n"
            "out = vsa_jax.video_sparse_attn(q, q, q, [64], [64], 1, 64)  # line 3\n"),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path without TRITON_INTERPRET")
@pytest.mark.parametrize("frontend,words", [("torch", "CPU tensors"), ("jax", "JAX arrays on the CPU")])
def test_cpu_warning_points_at_the_callers_line(frontend, words, tmp_path):
    import os
    import pathlib
    import subprocess
    import sys
    skip_if_interpreter_broken()
    script = tmp_path / "user_script.py"
    script.write_text(WARNING_SCRIPTS[frontend])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-W", "default", str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if "interpreter" in line]
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith(f"{script}:3: UserWarning: vsa: {words} run the Triton kernels under Triton's "
                               "interpreter"), lines[0]


# ---- 6. demo.py: options, and a line saying what it computed ----------------------------------------
def _demo(*args):
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(root / "demo.py"), *args], env=env, capture_output=True, text=True,
                          timeout=600)


def test_demo_help_lists_the_options():
    run = _demo("--help")
    assert run.returncode == 0, run.stderr
    for option in ("--video T,H,W", "--topk", "--backend", "--frontend {torch,jax}", "--dtype", "--tile"):
        assert option in run.stdout, (option, run.stdout)
    bad = _demo("--video", "4,4")
    assert bad.returncode == 2 and "--video: expected three positive ints T,H,W" in bad.stderr


@pytest.mark.parametrize("args,summary", [
    ((), r"vsa demo \(torch, backend auto, (GPU|CPU, Triton interpreter)\): video 5x8x8 \(320 tokens\) in 4x4x4 "
         r"tiles = 8 blocks of 64 tokens \(4 partial\), B1 H2 D64, top-2 of 8, bfloat16, gate on: forward \+ "
         r"backward in [0-9.]+ s, largest error [0-9.e-]+ \(pass < 2e-02\): PASS"),
    (("--frontend", "jax", "--video", "4,4,8", "--topk", "1", "--dtype", "float16", "--heads", "1",
      "--head-dim", "128", "--backend", "triton"),
     r"vsa demo \(jax, backend triton, .*\): video 4x4x8 \(128 tokens\) .* B1 H1 D128, top-1 of 2, float16, "
     r"gate on: .* \(pass < 3e-03\): PASS"),
])
def test_demo_says_what_it_computed(args, summary):
    import re
    run = _demo(*args, "--no-bench")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert re.search(summary, run.stdout), run.stdout


@pytest.mark.parametrize("args,message", [
    (("--topk", "0"), "argument --topk: topk must be >= 1, got 0"),
    (("--tile", "4,4,3"), "argument --tile: Unsupported VSA tile volume 48: tile_size must hold (64, 128, 256) tokens"),
    (("--heads", "0"), "argument --heads: expected a positive int, got 0"),
    (("--backend", "cute"), "argument --backend: backend='cute' cannot run this call: it runs on NVIDIA GPUs only"),
    (("--backend", "cudnn", "--frontend", "jax"),
     "argument --backend: backend='cudnn' cannot run this call: it runs on NVIDIA GPUs only"),
], ids=["topk", "tile", "heads", "cute-cpu", "cudnn-cpu-jax"])
def test_demo_bad_options_are_usage_errors(args, message):
    """What the library refuses is refused by the demo's parser: exit 2, no traceback, one
    error line carrying the library's message, before any input is drawn."""
    if "--backend" in args and torch.cuda.is_available():
        pytest.skip("the backend is refused for CPU tensors")
    run = _demo(*args, "--no-bench")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stdout + run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == [run.stderr.splitlines()[-1]] and errors[0].startswith("demo.py: error: " + message), run.stderr
    assert run.stdout == "", run.stdout


# ---- 8. the docstrings are enough without the README ---------------------------------------------------
@pytest.mark.parametrize("frontend", FRONTENDS)
def test_help_states_the_contract(frontend):
    import pydoc
    fe, _ = FRONTENDS[frontend]
    text = " ".join(pydoc.render_doc(fe.video_sparse_attn, renderer=pydoc.plaintext).split())
    for fact in ("bf16 or fp16", "head dim D 64 or 128", "multiples of the block's token count E",
                 "tile order", "Returns out: q's shape and dtype, `[B, H, Sq, D]`",
                 "`variable_block_sizes` counts the valid tokens of each KV block",
                 "`q_variable_block_sizes` those of each query block", "FastVideo's function exactly",
                 "must hold zeros (`to_tiled` writes them)", "never read, whatever they hold",
                 "clamped", "coarse scores rounded to the input dtype"):
        assert fact in text, (frontend, fact)
    for helper in (fe.to_tiled, fe.from_tiled):
        doc = " ".join(helper.__doc__.split())
        assert "dim=1 for `[B, S, H, D]`" in doc and "ValueError" in doc, (frontend, helper.__name__)
