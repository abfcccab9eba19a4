"""Shared unit-test fixtures: every simulator/search test runs against both kernels."""

import pytest


@pytest.fixture(params=["compiled", "pure-python"])
def pure_python(request):
    """``False`` for the compiled kernel, ``True`` for the pure-Python reference."""
    if request.param == "compiled":
        try:
            import poseidon_plugin._core._dag  # noqa: F401
        except ImportError:
            pytest.fail("the compiled core is not built: run `pip install -e .` "
                        "(or `python setup.py build_ext --inplace`) first")
        return False
    return True
