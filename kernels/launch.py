"""Launchers bound once: after a Triton kernel's first launch in one form, its compiled kernel launched directly.

`triton.JITFunction.run` spends tens of microseconds of host time on every launch: it binds the kernel's
arguments (our GEMV takes ~60), specializes each of them, builds and hashes its cache key, looks the compiled
kernel up and builds the launch's metadata before it calls the driver's launcher. An eager decode step of the
Qwen3.5-0.8B shape launches ~160 kernels, and that work was about a third of its 19.7 ms on an H100's host
(`benchmarks/host_profile.py`, the `eager-host` suite at a183f02). `launch` does it once per form of a call:
the first call goes through Triton, which hands back the compiled kernel; a later call of the same form calls
that kernel's launcher with the arguments in the kernel's order.

A form is what Triton specializes on, or finer: the keyword arguments (constexprs and launch options), each int
and bool argument's value, each tensor's dtype and whether its address is a multiple of 16, which arguments are
None, and the current device. A float's value is not part of it (Triton passes floats as they are). Anything
else goes through Triton every time: the switch off, the interpreter, no CUDA, a launch hook installed (a
profiler's), an argument of another type, a Triton whose compiled kernels lack the launcher this calls. What a
bound launch skips besides: Triton's options read from the environment at each launch (debug, instrumentation)
stay those of the form's first launch (`forget` drops the forms), and its check that the globals a kernel reads
kept their values (fnattn's kernels read module constants only).
"""

from __future__ import annotations

import torch

from ._switch import declare, switched
from ._triton import HAS_TRITON, interpreted

_BOUND = declare(
    "bound_launches", False, __name__,
    on="fnattn's decode-step kernels, after their first launch in a form, launch their compiled kernel directly "
       "(`fnattn.kernels.launch`): no argument binding, specialization or cache key a call",
    off="every launch goes through Triton's `JITFunction.run`",
    why="off until a GPU run has timed it and held its launches to the plain ones' bits: Triton's own launch "
        "path took about a third of an eager Qwen3.5-0.8B decode step's 19.7 ms on an H100's host (a183f02)")


def bound_launches(enabled: bool):
    """Within this block (off by default) the kernels here that launch through `launch` launch their compiled
    kernel directly after the first launch of each form."""
    return switched(_BOUND, "bound_launches", enabled)


_FORMS: dict = {}  # (kernel, device, keywords, argument form) -> (compiled kernel, the arguments after the caller's)
_MAX_FORMS = 4096  # a step has a few hundred forms; past this many something varies per call: stop remembering
_UNBOUND = object()  # a form that goes through Triton every time (its compiled kernel has no launcher to call)


def launch(kernel, grid, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, or under `bound_launches` its compiled kernel's launcher, called
    directly for a form launched before (see the module). ``grid``: a tuple of one to three ints."""
    if not _BOUND[-1] or not _usable(kernel):
        return kernel[grid](*args, **kwargs)
    form = _form(args)
    if form is None:
        return kernel[grid](*args, **kwargs)
    device = _device()
    key = (kernel, device, tuple(kwargs.items()), form)
    bound = _FORMS.get(key)
    if bound is None:
        compiled = kernel[grid](*args, **kwargs)
        # a key never holds a tensor (one among the keywords): it would keep the tensor and never meet it again
        if len(_FORMS) < _MAX_FORMS and not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            _FORMS[key] = _bind(kernel, compiled, len(args), kwargs)
        return compiled
    if bound is _UNBOUND:
        return kernel[grid](*args, **kwargs)
    compiled, tail = bound
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, _stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)
    return compiled


def forget() -> None:
    """Drops every remembered form (their compiled kernels stay in Triton's own cache)."""
    _FORMS.clear()


def _form(args: tuple):
    """What Triton specializes ``args`` on, or finer; None for an argument of another type."""
    form = []
    append = form.append
    for a in args:  # the most frequent types first: a launch has a few dozen arguments
        t = type(a)
        if t is int or a is None:
            append(a)
        elif t is float:
            append(float)
        elif t is bool:
            append((bool, a))  # True == 1 as a key, but Triton compiles a bool apart from an int 1
        elif isinstance(a, torch.Tensor):
            append((a.dtype, not a.data_ptr() & 15))
        else:
            return None
    return tuple(form)


def _bind(kernel, compiled, positional: int, kwargs: dict):
    """``-> (compiled, the values of the kernel's parameters after the first ``positional``, in its order)``, or
    `_UNBOUND` where the compiled kernel or the parameters do not allow a direct launch."""
    if hasattr(compiled, "result"):  # compiled in the background: a future
        compiled = compiled.result()
    if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")) \
            or compiled.function is None:
        return _UNBOUND
    params = getattr(kernel, "params", None)
    if params is None or any(p.name in kwargs for p in params[:positional]):
        return _UNBOUND
    tail = []
    for p in params[positional:]:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif getattr(p, "has_default", False):
            tail.append(p.default)
        else:
            return _UNBOUND  # a required parameter left out: Triton's own error on the next call
    return compiled, tuple(tail)


_COMPILED: dict = {}  # kernel -> whether it is compiled for CUDA here (not interpreted), asked once a kernel
_RUNTIME: list = []  # Triton's runtime knobs, looked up once


def _usable(kernel) -> bool:
    """Whether ``kernel``'s launches may be bound here: compiled for CUDA (not interpreted), and no launch hook
    installed (a profiler's hooks see each launch through Triton's path)."""
    compiled = _COMPILED.get(kernel)
    if compiled is None:
        compiled = _COMPILED[kernel] = HAS_TRITON and not interpreted(kernel) and torch.cuda.is_available()
    if not compiled:
        return False
    if not _RUNTIME:
        import triton

        _RUNTIME.append(getattr(getattr(triton, "knobs", None), "runtime", None))
    for name in ("launch_enter_hook", "launch_exit_hook"):
        hook = getattr(_RUNTIME[0], name, None)
        if hook is not None and getattr(hook, "calls", True):  # a HookChain with hooks in it, or a bare hook
            return False
    return True


def _device() -> int:
    return torch.cuda.current_device()  # where Triton launches: the current device's current stream


def _stream(device: int):
    return torch._C._cuda_getCurrentRawStream(device)
