"""Triton Python model `preprocessing`: the logic is ouro_backend.serving.text_models.PreprocessingModel."""

import os
import sys

# From a source checkout, use the checkout's ouro_backend (three levels up); otherwise the installed one.
_root = os.path.abspath(os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", ".."))
if os.path.isfile(os.path.join(_root, "ouro_backend", "__init__.py")) and _root not in sys.path:
    sys.path.insert(0, _root)

from ouro_backend.serving.text_models import PreprocessingModel  # noqa: E402


class TritonPythonModel(PreprocessingModel):
    pass
