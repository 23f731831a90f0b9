"""Checkpoint I/O: safetensors without the safetensors package, the Hugging Face directory
layout (config.json + shards + index) in its flat and its published (GLM-5.3-Flash) naming,
validation against the expected tensor layout, FP8 block-scaled weights, and writers of
real-layout and random checkpoints. See docs/checkpoint.md.
"""

from .fp8 import dequantize as dequantize_fp8
from .fp8 import quantize as quantize_fp8
from .naming import NameLayout
from .random_init import random_checkpoint, random_tensors
from .reader import Checkpoint
from .safetensors_io import (
    DTYPES,
    CheckpointError,
    PendingTensor,
    SafetensorsFile,
    TensorInfo,
    load_safetensors,
    read_header,
    write_safetensors,
)
from .validate import TensorSet, mtp_tensors, target_tensors
from .writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

__all__ = [
    "DTYPES",
    "DEFAULT_MAX_SHARD_BYTES",
    "Checkpoint",
    "CheckpointError",
    "NameLayout",
    "PendingTensor",
    "SafetensorsFile",
    "TensorInfo",
    "TensorSet",
    "dequantize_fp8",
    "load_safetensors",
    "mtp_tensors",
    "quantize_fp8",
    "random_checkpoint",
    "random_tensors",
    "read_header",
    "target_tensors",
    "write_checkpoint",
    "write_safetensors",
]
