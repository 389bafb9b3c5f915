"""Launchers bound once (`fnattn.kernels.launch`): which calls reuse a compiled kernel, with which arguments.

A stand-in kernel records what Triton's path and the direct path each received (this machine has no GPU; the
device records say whether the bound launches keep the plain ones' bits)."""

import inspect

import pytest
import torch

from fnattn.kernels import launch as bound


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default
        self.has_default = default is not inspect.Parameter.empty


class _Compiled:
    def __init__(self):
        self.function, self.packed_metadata, self.runs = "function", "metadata", []

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """``k(X, n, eps, Y=None, BLOCK: constexpr, FLAG: constexpr = True)``: Triton's path records the call and hands
    back one compiled kernel."""

    def __init__(self, params=("X", "n", "eps", ("Y", None), "BLOCK", ("FLAG", True)), compiled=None):
        self.params = [_Param(*p) if isinstance(p, tuple) else _Param(p) for p in params]
        self.compiled = _Compiled() if compiled is None else compiled
        self.through_triton = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.through_triton.append((grid, args, kwargs))
            return self.compiled
        return run


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(bound, "_usable", lambda kernel: True)
    monkeypatch.setattr(bound, "_device", lambda: 0)
    monkeypatch.setattr(bound, "_stream", lambda device: 77)
    bound.forget()
    with bound.bound_launches(True):
        yield
    bound.forget()


def _call(k, x, n=8, eps=1e-6, grid=(4,), **kwargs):
    return bound.launch(k, grid, (x, n, eps), {"BLOCK": 16, "num_warps": 4, **kwargs})


def test_off_every_launch_goes_through_triton(monkeypatch):
    monkeypatch.setattr(bound, "_usable", lambda kernel: True)
    k, x = _Kernel(), torch.zeros(8)
    for _ in range(3):
        _call(k, x)
    assert len(k.through_triton) == 3 and not k.compiled.runs


def test_a_form_launched_before_calls_the_compiled_kernel_with_every_parameter_in_order(on):
    k, x = _Kernel(), torch.zeros(8)
    assert _call(k, x) is k.compiled
    _call(k, x, eps=0.5, grid=(4, 2))  # a float's value is no part of the form: passed as it is
    assert len(k.through_triton) == 1
    # grid to three, the stream, the kernel's handle and metadata, no hooks, then X, n, eps, Y, BLOCK, FLAG
    assert k.compiled.runs == [(4, 2, 1, 77, "function", "metadata", None, None, None, x, 8, 0.5, None, 16, True)]


@pytest.mark.parametrize("change", [
    dict(n=9),  # an int's value (Triton specializes 1 and multiples of 16)
    dict(n=True),  # a bool where an int was (== 1 as a key, another kernel to Triton)
    dict(x=torch.zeros(9)[1:]),  # an address that is no multiple of 16
    dict(x=torch.zeros(8, dtype=torch.float16)),  # another dtype
    dict(BLOCK=32),  # a constexpr
    dict(num_warps=8),  # a launch option
])
def test_another_form_goes_through_triton_first(on, change):
    k, x = _Kernel(), torch.zeros(8)
    _call(k, x, n=1)
    args = dict(x=x, n=1, **{name: v for name, v in change.items() if name not in ("x", "n")})
    args.update({name: v for name, v in change.items() if name in ("x", "n")})
    _call(k, **args)
    assert len(k.through_triton) == 2 and not k.compiled.runs
    _call(k, **args)
    assert len(k.compiled.runs) == 1


@pytest.mark.parametrize("kernel, args, kwargs", [
    (_Kernel(), (torch.zeros(8), 8, 0.0), {"BLOCK": 16, "n": 8}),  # a positional parameter named again
    (_Kernel(), (torch.zeros(8), 8, 0.0), {}),  # a required constexpr left out
    (_Kernel(compiled=object()), (torch.zeros(8), 8, 0.0), {"BLOCK": 16}),  # no launcher to call
    (_Kernel(), (torch.zeros(8), "8", 0.0), {"BLOCK": 16}),  # an argument of another type
    (_Kernel(), (torch.zeros(8), 8, 0.0), {"BLOCK": 16, "Y": torch.zeros(8)}),  # a tensor among the keywords
])
def test_what_cannot_be_bound_goes_through_triton_every_time(on, kernel, args, kwargs):
    for _ in range(3):
        bound.launch(kernel, (1,), args, kwargs)
    assert len(kernel.through_triton) == 3


def test_a_launch_hook_an_interpreted_kernel_or_no_cuda_keeps_triton_s_path(monkeypatch):
    from fnattn.kernels.skinny_linear import _skinny_gemv_kernel

    bound._COMPILED.clear()
    assert not bound._usable(_Kernel()) or torch.cuda.is_available()  # this CPU: no CUDA
    if bound.interpreted(_skinny_gemv_kernel):
        assert not bound._usable(_skinny_gemv_kernel)

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    class Runtime:
        launch_enter_hook, launch_exit_hook = Chain([]), Chain([print])

    monkeypatch.setattr(bound, "_COMPILED", {"kernel": True})
    monkeypatch.setattr(bound, "_RUNTIME", [Runtime()])
    assert not bound._usable("kernel")  # a profiler's exit hook
    Runtime.launch_exit_hook = Chain([])
    assert bound._usable("kernel")
    Runtime.launch_enter_hook = None  # a Triton whose hooks are plain attributes
    assert bound._usable("kernel")


def test_the_remembered_forms_are_bounded(on, monkeypatch):
    monkeypatch.setattr(bound, "_MAX_FORMS", 2)
    k, x = _Kernel(), torch.zeros(8)
    for n in (1, 2, 3, 3):
        _call(k, x, n=n)
    assert len(bound._FORMS) == 2 and len(k.through_triton) == 4
