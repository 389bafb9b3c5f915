"""Where fnattn.kernels and fnattn.models find their modules in a source checkout (no torch imported here)."""

import os


def checkout_folder(name: str) -> list[str]:
    """``[<repository>/<name>]`` when fnattn runs from a source checkout, else ``[]``.

    The repository's kernels/ and models/ folders sit beside fnattn/ with no ``__init__.py``: Python
    started in the repository root then never takes them for installed packages of those names (the
    ``kernels`` that transformers imports). They are the modules of fnattn.kernels / fnattn.models,
    whose ``__init__.py`` files are fnattn/kernels/ and fnattn/models/ and add this folder to their path;
    an install copies the modules beside those files instead.
    """
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
    in_checkout = os.path.isfile(os.path.join(os.path.dirname(folder), "pyproject.toml"))
    plain_folder = os.path.isdir(folder) and not os.path.exists(os.path.join(folder, "__init__.py"))
    return [folder] if in_checkout and plain_folder else []
