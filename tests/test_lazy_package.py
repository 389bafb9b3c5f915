"""`import fnattn` is cheap: the public names load on first use, as the same objects as before."""

import importlib
import os
import subprocess
import sys

import fnattn as fa


def run_python(code):
    done = subprocess.run([sys.executable, "-c", code], env=os.environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_package_imports_no_torch():
    assert run_python("import sys, fnattn; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))") == "[]"


def test_every_public_name_resolves_and_is_listed():
    for name in fa.__all__:
        assert getattr(fa, name) is not None, name
    from fnattn import State, probe
    from fnattn.state import State as defined_there

    assert State is defined_there and callable(probe)
    assert set(fa.__all__) <= set(dir(fa)) and "__version__" in dir(fa)


def test_a_public_name_that_is_also_a_module_stays_the_public_value():
    module = importlib.import_module("fnattn.probe")
    fa.probe = module  # what Python does to the package when it first imports the module
    assert fa.probe is module.probe


def test_an_unknown_name_is_an_attribute_error():
    try:
        fa.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("fa.no_such_name resolved")
