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
