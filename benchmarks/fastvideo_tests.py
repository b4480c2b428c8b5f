"""Runs FastVideo's own VSA tests against vsa, through a name shim. Fetches nothing.

    PYTHONPATH=. python3 benchmarks/fastvideo_tests.py /path/to/FastVideo            # GPU
    PYTHONPATH=. python3 benchmarks/fastvideo_tests.py /path/to/FastVideo -- -k vsa256 -x

The first argument is a FastVideo checkout (the repository root, or its `fastvideo-kernel`
directory); arguments after `--` go to pytest. It runs the VSA test files of
`fastvideo-kernel/tests` (`--files` to choose others) in a subprocess whose
`fastvideo_kernel` is `benchmarks/fastvideo_shim/fastvideo_kernel`: FastVideo's attention entry
points (`video_sparse_attn`, `video_sparse_attn_bshd`, `block_sparse_attn`,
`block_sparse_attn_from_indices`, the 128/256-token and varlen variants, `_map_to_index`) mapped
onto vsa_torch with vsa's default padding="zeros", FastVideo's function. FastVideo's backend
switches pick vsa's backends (FASTVIDEO_VSA_TRITON=1: triton; FASTVIDEO_VSA_CUTEDSL=1: cute for
128/256-token blocks; else auto, which VSA_BACKEND replaces), as the tests set them.

Left out by default: test_vsa_utils.py (FastVideo's metadata helpers and their device caches,
not vsa's API; vsa's own metadata is tested in tests/test_metadata.py) and the tests of
FastVideo's other kernels (STA, attention QAT, TurboDiffusion, VMoBA, its fused top-k helper).

Nothing is written into the checkout (no bytecode, no pytest cache). FastVideo's tests need
CUDA (they skip or return without it); the 128/256-token CuTe tests skip unless flash-attn-4
is installed. The exit status is pytest's. Written against FastVideo 2f3d407
(fastvideo-kernel/tests at that commit).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHIM = os.path.join(HERE, "fastvideo_shim")

VSA_TESTS = ["test_vsa.py", "test_vsa_forward.py", "test_vsa_triton_backward_scale.py", "test_vsa_varlen.py",
             "test_vsa128_backward.py", "test_vsa256_backward.py", "test_vsa256_forward.py",
             "test_vsa256_forward_cross.py", "test_vsa256_forward_vbs.py", "test_vsa256_triton.py"]


def tests_dir(checkout: str) -> str:
    for candidate in (os.path.join(checkout, "fastvideo-kernel", "tests"), os.path.join(checkout, "tests")):
        if os.path.isfile(os.path.join(candidate, "test_vsa.py")):
            return candidate
    sys.exit(f"{checkout}: no fastvideo-kernel/tests/test_vsa.py there (give FastVideo's repository root)")


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", help="a FastVideo checkout (repository root)")
    parser.add_argument("--files", default=",".join(VSA_TESTS),
                        help="comma-separated test files of fastvideo-kernel/tests (default: the VSA ones)")
    args = parser.parse_args(argv)
    tests = tests_dir(os.path.abspath(args.checkout))
    files = [os.path.join(tests, f) for f in args.files.split(",") if f]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        sys.exit(f"not in {tests}: {', '.join(os.path.basename(f) for f in missing)}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SHIM, REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        # our own (empty) config, so that none of the checkout's pytest settings apply
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\nmarkers =\n    cuda: needs CUDA (FastVideo's marker)\n")
        cmd = [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", os.path.dirname(tests), "-p", "no:cacheprovider",
               "-rfEs", *files, *extra]
        check = [sys.executable, "-c", "import fastvideo_kernel, sys; sys.exit(0 if 'fastvideo_shim' in "
                 "fastvideo_kernel.__file__ else 'fastvideo_kernel resolves to ' + fastvideo_kernel.__file__)"]
        if subprocess.run(check, env=env, cwd=tmp).returncode:
            return 2
        if subprocess.run([sys.executable, "-c", "import tqdm"], env=env, cwd=tmp,
                          stderr=subprocess.DEVNULL).returncode:
            # test_vsa.py imports tqdm (a progress bar it never shows in these tests); without the
            # package (an offline GPU machine) an identity stand-in lets the tests import
            with open(os.path.join(tmp, "tqdm.py"), "w") as f:
                f.write("def tqdm(iterable=None, *args, **kwargs):\n    return iterable\n")
            env["PYTHONPATH"] = os.pathsep.join([tmp, env["PYTHONPATH"]])
            print("note: tqdm is not installed; FastVideo's tests import it: an identity tqdm() stands in",
                  flush=True)
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
