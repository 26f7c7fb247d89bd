"""The public API: every exported name resolves, from the package itself, to the object its module defines."""

import importlib
import subprocess
import sys

import areal_lite


def test_every_export_resolves():
    for name in areal_lite.__all__:
        obj = getattr(areal_lite, name)
        module = importlib.import_module(f"areal_lite.{areal_lite._EXPORTS[name]}")
        assert obj is getattr(module, name), name


def test_unknown_name_is_an_attribute_error():
    try:
        _ = areal_lite.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_light():
    """`import areal_lite` must not pull torch in: a notebook's first cell should be instant."""
    code = "import sys, areal_lite; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_export_named_like_its_module_is_the_function():
    """`from areal_lite import train` is the function even after `areal_lite.train` (the module) was imported."""
    code = (
        "import sys\nfrom areal_lite import TrainConfig\nfrom areal_lite import train\n"
        "print(callable(train) and train is sys.modules['areal_lite.train'].train)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
