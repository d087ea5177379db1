"""Capture: the model as an aten-level fx graph whose inputs accept any batch and length.

export.py runs torch.export (non-strict, every input dim Dim.AUTO) and returns `Captured`;
signature.py gives forwards with *args / **kwargs an explicit signature for the export;
model_state.py leaves the user's model as it was found; input_dims.py finds the input dims
the capture fixed and the autocast state it assumed, which the rank graphs check on every call.
"""
from tpcompile.capture.export import Captured, auto_dynamic_shapes, capture, infer_example_inputs

__all__ = ["Captured", "auto_dynamic_shapes", "capture", "infer_example_inputs"]
