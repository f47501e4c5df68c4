"""Lets TorchRec import over the GPU machine's FBGEMM peer (``.peers/fbgemm``), for the NCCL runs of
``tests/distributed/test_torchrec_dmp.py``: put this folder on ``PYTHONPATH`` (``tools/gpu_check.sh
--dist`` does).

The peer leaves FBGEMM's inference libraries out to fit a device call, and importing TorchRec
registers shape functions for two of their operators, which then do not exist. Their schemas (as
``fbgemm-gpu-cpu`` declares them) are declared here so the import goes through; nothing calls these
operators (they serve quantized inference tables only). Where an operator exists, nothing changes.
"""

SCHEMAS = {
    "pruned_array_lookup": "(Tensor indices, Tensor offsets, Tensor index_remappings, "
                           "Tensor index_remappings_offsets) -> Tensor",
    "int_nbit_split_embedding_codegen_lookup_function":
        "(Tensor dev_weights, Tensor uvm_weights, Tensor weights_placements, Tensor weights_offsets, "
        "Tensor weights_tys, Tensor D_offsets, SymInt total_D, int max_int2_D, int max_int4_D, "
        "int max_int8_D, int max_float16_D, int max_float32_D, Tensor indices, Tensor offsets, "
        "int pooling_mode, Tensor? indice_weights, int output_dtype=1, Tensor? lxu_cache_weights=None, "
        "Tensor? lxu_cache_locations=None, int? row_alignment=None, int? max_float8_D=0, "
        "int? fp8_exponent_bits=-1, int? fp8_exponent_bias=-1) -> Tensor",
}

try:
    import fbgemm_gpu  # noqa: F401 - loads the operator libraries that are there
    import torch

    for name, schema in SCHEMAS.items():
        if not hasattr(torch.ops.fbgemm, name):
            torch.library.define(f"fbgemm::{name}", schema)
except ImportError:
    pass
