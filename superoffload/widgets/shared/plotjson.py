"""A plotly figure as plain data, and the two ways it travels.

The dashboard's figure is a dict, `{"data": [trace dicts], "layout": {...}}`, its arrays numpy
arrays: no plotly object is built on a refresh (plotly's graph objects validated and deep-
copied every assignment and took most of a refresh's time). It leaves the kernel as

* `pack(fig)` for the live view: the figure's JSON without its arrays, encoded once by the C
  encoder, and each numeric array as its own binary frame (ipywidgets sends memoryviews as
  buffers), referenced in the JSON as `{"$a": k, "dtype", "shape"}`: no JSON of numbers, no
  base64, and no walk over the figure in Python (ipywidgets looks for buffers in the few
  keys of the packed value, not in a thousand-node figure);
* `plotly_json(fig)` for a static output (the plotly mime bundle a saved notebook keeps, an
  exported page): each array becomes plotly.js's typed-array spec `{"dtype": "f8", "bdata":
  <base64>}` (plotly.js decodes it since 2.28; plotly's own JSON writes the same).
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

_SHORT = {"float64": "f8", "float32": "f4", "int32": "i4", "int64": "f8"}


def pack(fig: Any, *, dtype: str = "f4") -> dict[str, Any]:
    """`fig` as `{"json": <bytes>, "arrays": [<memoryview>, ...]}` (module docstring); arrays
    float32 by default (a figure's numbers: iterations up to 2^24 are exact)."""
    arrays: list[memoryview] = []
    np_dtype = "<f4" if dtype == "f4" else "<f8"

    def encode(value: Any) -> Any:
        if isinstance(value, np.ndarray) and value.dtype.kind in "fiu":
            arrays.append(memoryview(np.ascontiguousarray(value, dtype=np_dtype).tobytes()))
            return {"$a": len(arrays) - 1, "dtype": dtype, "shape": list(value.shape)}
        if isinstance(value, np.ndarray):
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"{type(value).__name__} in a figure")

    try:
        text = json.dumps(fig, default=encode, allow_nan=False, separators=(",", ":"))
    except ValueError:
        # a NaN or an infinity outside the arrays: null, as plotly reads it
        arrays.clear()
        text = json.dumps(_finite(fig), default=encode, allow_nan=False,
                          separators=(",", ":"))
    return {"json": memoryview(text.encode("utf-8")), "arrays": arrays}


def unpack(packed: dict[str, Any]) -> Any:
    """The figure `pack` packed (its arrays back as numpy arrays): what the browser reads."""
    arrays = packed["arrays"]

    def hook(obj: dict[str, Any]) -> Any:
        if "$a" not in obj:
            return obj
        dt = "<f4" if obj["dtype"] == "f4" else "<f8"
        return np.frombuffer(bytes(arrays[obj["$a"]]), dtype=dt).reshape(obj["shape"])

    return json.loads(bytes(packed["json"]).decode("utf-8"), object_hook=hook)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plotly_json(value: Any) -> Any:
    """`value` as JSON-ready data for plotly.js: numeric arrays as typed-array specs, NaN
    scalars as null (JSON has no NaN)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "fiu":
            return [plotly_json(v) for v in value.tolist()]
        if value.size == 0:
            return []
        arr = np.ascontiguousarray(value, dtype="<f8")
        spec: dict[str, Any] = {"dtype": _SHORT["float64"],
                                "bdata": base64.b64encode(arr.tobytes()).decode("ascii")}
        if arr.ndim > 1:
            spec["shape"] = ", ".join(str(n) for n in arr.shape)
        return spec
    if isinstance(value, dict):
        return {k: plotly_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plotly_json(v) for v in value]
    return _scalar(value)


def _scalar(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def to_html(fig: dict[str, Any], *, config: dict[str, Any], include_plotlyjs: bool | str,
            full_html: bool = False, default_width: str = "100%") -> str:
    """The figure as an HTML fragment (or page) drawn by plotly.js (plotly.io.to_html)."""
    import plotly.io as pio

    return str(pio.to_html(plotly_json(fig), config=config, include_plotlyjs=include_plotlyjs,
                           full_html=full_html, default_width=default_width, validate=False))
