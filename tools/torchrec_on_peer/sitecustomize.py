"""Lets TorchRec import over the GPU machine's FBGEMM peer (``.peers/fbgemm``), for the NCCL runs of
``tests/distributed/test_torchrec_dmp.py``: put this folder on ``PYTHONPATH`` (``tools/gpu_check.sh
--dist`` does).

The peer leaves FBGEMM's inference libraries out to fit a device call, and importing TorchRec
registers a shape function for one of their operators, ``fbgemm::pruned_array_lookup``, which then
does not exist. Its schema is declared here so the import goes through; nothing calls the operator
(it serves quantized inference tables only). Where the operator exists, nothing is changed.
"""

try:
    import fbgemm_gpu  # noqa: F401 - loads the operator libraries that are there
    import torch

    if not hasattr(torch.ops.fbgemm, "pruned_array_lookup"):
        torch.library.define("fbgemm::pruned_array_lookup", "(Tensor indices, Tensor offsets, "
                             "Tensor index_remappings, Tensor index_remappings_offsets) -> Tensor")
except ImportError:
    pass
