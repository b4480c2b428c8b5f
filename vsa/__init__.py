"""`vsa` is the name of the distribution (`pip install vsa`), not of a module to import: the
frontends are `vsa_torch` (PyTorch) and `vsa_jax` (JAX), the same functions in each, over
the framework-neutral core `vsa_core`. Importing `vsa` raises an ImportError that says so."""

raise ImportError(
    "vsa is the distribution's name, not a module: import the frontend for your framework, "
    "vsa_torch (PyTorch) or vsa_jax (JAX), e.g. `from vsa_torch import video_sparse_attn` "
    "(the same names in both)", name="vsa")
