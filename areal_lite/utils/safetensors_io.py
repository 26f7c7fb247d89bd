"""safetensors files written straight from tensor memory, over an existing file's pages: the weight sync.

Design decisions
- Why not `safetensors.torch.save_file`: it copies every tensor into a Python `bytes` and truncates the file it
  writes to. Here each tensor's memory goes to the file in one `write`, and a file already at the path is
  overwritten in place and cut to length, so the file system keeps its pages. That is what makes a recycled weight
  file cheap (`engine/fsdp_utils/weights.py`, "Recycled pages"; bench/vs_trl.py reports the weight_sync phase).
- The format is safetensors' own: an 8-byte little-endian header size, a JSON header (dtype, shape and byte offsets
  of each tensor, `__metadata__`) padded with spaces to 8 bytes, then the tensors' bytes back to back, the widest
  dtypes first so that each tensor starts aligned to its element size (as safetensors orders them). Reading stays
  with `safetensors` and `from_pretrained`; the tests read these files with the real package.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Mapping, Optional

import torch

# safetensors' dtype codes
_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A tensor's memory as bytes, without a copy (`t` contiguous on CPU)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write `tensors` to `path` as a safetensors file, each tensor's memory written once. A file already at `path`
    is overwritten in place (the file system keeps its pages: see `fsdp_utils.weights`, "Recycled pages")."""
    flat = {}
    for name, t in tensors.items():
        if t.dtype not in _CODES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors code here")
        flat[name] = t.detach().cpu().contiguous()
    order = sorted(flat, key=lambda n: (-flat[n].element_size(), n))
    header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = flat[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    # An existing file is overwritten in place and cut to length, not truncated first: its pages are reused.
    with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            if flat[name].numel():
                f.write(_bytes_of(flat[name]))
        f.truncate()
