"""The kernels package's lazy exports."""


def test_every_package_export_is_a_function_or_class_whatever_was_imported_first():
    """`fnattn.kernels` loads its names on first use; none may be shadowed by a submodule of the same name
    (which the import system binds on the package once that submodule is imported)."""
    import importlib
    import inspect
    import pkgutil

    import fnattn.kernels as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    for name in package.__all__:
        value = getattr(package, name)
        assert not inspect.ismodule(value), f"fnattn.kernels.{name} is a module"


def test_shares_storage_finds_every_view_of_one_storage_and_nothing_else():
    """The aliasing check the kernels run before writing an output: any view of one storage (offset, strided,
    another dtype) shares it; separate tensors, empty ones and tensors on other devices do not."""
    import torch

    from fnattn.kernels._checks import shares_storage

    buf = torch.zeros(4, 16, dtype=torch.bfloat16)
    views = [buf, buf[:, :8], buf[:, 8:], buf[1:], buf.t(), buf[2:, 3:5], buf.view(torch.int16)[3:], buf.flatten()]
    for a in views:
        for b in views:
            assert shares_storage(a, b)
    other = torch.zeros(4, 16, dtype=torch.bfloat16)
    assert not shares_storage(buf, other) and not shares_storage(buf[1:], other[1:])
    assert not shares_storage(buf[:0], buf) and not shares_storage(buf, buf[2:2])
    assert not shares_storage(torch.zeros(3, device="meta"), torch.zeros(3, device="meta"))
