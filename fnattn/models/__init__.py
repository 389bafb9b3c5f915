"""Model adapters: a Hugging Face config dict -> LayerSpecs, weight names, model steps.

The modules live in the repository's top-level models/ folder; an install copies them beside this file.
"""

from ..checkout import checkout_folder

__path__ += checkout_folder("models")  # noqa: F821 - the package's own search path
