"""Triton kernels (CUDA; on CPU tensors through the interpreter, ``TRITON_INTERPRET=1``).

``TritonKernels`` implements ``tieredemb.ops.reference.TorchKernels``' interface and
``TritonKeyIndex`` the ``KeyIndex``; both are tested equal to the references. Importing this package
imports triton: ``tieredemb.ops.select_kernels`` falls back to the torch kernels when it is missing.
"""

from tieredemb.ops.triton.embedding import TritonKernels
from tieredemb.ops.triton.index import TritonKeyIndex

__all__ = ["TritonKernels", "TritonKeyIndex"]
