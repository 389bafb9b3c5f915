"""A griffe extension: read fnattn.models from the repository's top-level models/ folder.

In a checkout the modules of ``fnattn.models`` live in ``models/`` beside ``fnattn/``, and the
package adds that folder to its search path when it is imported. Griffe reads source without
importing it, so it would find an empty ``fnattn.models``; this extension parses the folder's
modules as members of that package, as an install (which copies them beside the package file)
would present them.
"""

from __future__ import annotations

from pathlib import Path

import griffe

CHECKOUT_FOLDERS = ("models",)


class CheckoutFolders(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "fnattn":
            return
        repository = Path(pkg.filepath).parent.parent
        for folder in CHECKOUT_FOLDERS:
            package = pkg.get_member(folder)
            for path in sorted((repository / folder).glob("*.py")):
                if path.stem in package.members:  # an install's copy beside the package file wins
                    continue
                module = griffe.visit(
                    path.stem, path, path.read_text(encoding="utf-8"), parent=package,
                    extensions=loader.extensions, docstring_parser=loader.docstring_parser,
                    docstring_options=loader.docstring_options, lines_collection=loader.lines_collection,
                    modules_collection=loader.modules_collection,
                )
                package.set_member(path.stem, module)
