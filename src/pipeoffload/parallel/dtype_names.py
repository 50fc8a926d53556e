"""The names of the dtypes training runs in and exports write, without torch, so that a
configuration checks them before torch is imported (parallel/precision.py DTYPES maps them)."""

from __future__ import annotations

DTYPE_NAMES = ("fp32", "bf16", "fp64")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}  # an element's bytes, by name
EXPORT_DTYPE_NAMES = ("fp32", "bf16")  # the command's; export_pretrained takes any dtype
