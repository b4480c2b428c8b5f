"""The launch configuration (`vsa_core.config`): read from the environment once, changed
only through `configure` / `overridden`, with errors that name the field or variable."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from vsa_core import config as C
from vsa_core.config import LaunchConfig, config, configure, from_environment, overridden

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_defaults_without_variables():
    assert from_environment({}) == LaunchConfig()
    assert LaunchConfig() == LaunchConfig(autotune=True, tma=True, coarse_precision="ieee", backend="auto",
                                          ulysses_chunks=None, jax_launch="auto", forced_tiles=())


def test_every_variable_is_read():
    got = from_environment({"VSA_AUTOTUNE": "0", "VSA_TMA": "0", "VSA_COARSE_PRECISION": "tf32",
                            "VSA_BACKEND": "triton", "VSA_ULYSSES_CHUNKS": "2", "VSA_JAX_LAUNCH": "native"})
    assert got == LaunchConfig(autotune=False, tma=False, coarse_precision="tf32", backend="triton",
                               ulysses_chunks=2, jax_launch="native")
    assert set(C.ENVIRONMENT) == {f.name for f in dataclasses.fields(LaunchConfig)} - {"forced_tiles", "replay"}


def test_the_environment_is_read_once(monkeypatch):
    monkeypatch.setattr(C, "_current", None)  # as in a fresh process (restored afterwards)
    monkeypatch.setenv("VSA_TMA", "0")
    first = config()
    assert first.tma is False
    monkeypatch.setenv("VSA_TMA", "1")
    assert config() is first


@pytest.mark.parametrize("variable, value", [("VSA_ULYSSES_CHUNKS", "two"), ("VSA_ULYSSES_CHUNKS", "0"),
                                             ("VSA_BACKEND", "fastest"), ("VSA_COARSE_PRECISION", "fp8"),
                                             ("VSA_JAX_LAUNCH", "graph")])
def test_a_bad_variable_is_named(variable, value):
    with pytest.raises((TypeError, ValueError), match=variable):
        from_environment({variable: value})


@pytest.mark.parametrize("field, value", [("autotune", "yes"), ("tma", 1), ("coarse_precision", "fp8"),
                                          ("backend", "fastest"), ("ulysses_chunks", 0), ("ulysses_chunks", True),
                                          ("jax_launch", "graph"), ("forced_tiles", {"k": (64, 64, 4, 3)})])
def test_configure_names_the_bad_field_and_changes_nothing(field, value):
    before = config()
    with pytest.raises((TypeError, ValueError), match=field):
        configure(**{field: value})
    assert config() is before


def test_configure_refuses_an_unknown_field():
    with pytest.raises(TypeError, match="colour"):
        configure(colour="blue")


def test_overridden_restores_the_configuration_even_on_error():
    before = config()
    with overridden(tma=not before.tma, forced_tiles=(("sparse_attn_fwd_kernel", (64, 64, 4, 3)),)) as inside:
        assert config() is inside and inside.tma is not before.tma
        assert inside.forced_tile("sparse_attn_fwd_kernel") == (64, 64, 4, 3)
        assert inside.forced_tile("other_kernel") is None
    assert config() is before
    with pytest.raises(RuntimeError):
        with overridden(autotune=False):
            raise RuntimeError
    assert config() is before


def test_configure_is_process_wide(launch_config):
    launch_config(backend="triton")  # restored at teardown
    assert configure(ulysses_chunks=3).backend == "triton"
    assert config().ulysses_chunks == 3


def test_only_config_reads_vsa_variables():
    """Every VSA_* variable is read in vsa_core/config.py alone (TRITON_INTERPRET is Triton's)."""
    readers = []
    for package in ("vsa_core", "vsa_torch", "vsa_jax", "vsa"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "config.py" and path.parent.name == "vsa_core":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if ("os.environ" in line or "getenv" in line) and "TRITON_INTERPRET" not in line:
                    readers.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not readers, "\n".join(readers)
