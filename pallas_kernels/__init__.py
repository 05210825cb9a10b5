"""Pallas Mosaic GPU kernels for DeepSeek-V3 inference, each beside its plain-`jnp` reference.

Arrays in, arrays out; nothing here knows about the model. The package-level names are the public
contract (`pallas_kernels.mla_decode(...)`, `pallas_kernels.fp8_grouped_gemm(...)`,
`pallas_kernels.grouped_gemm(...)` for bf16/fp16 experts); note that `mla_decode`, `mla_prefill` and
`grouped_gemm` name the functions here, so import their modules' other members with
`from pallas_kernels.grouped_gemm import ...`. `pallas_kernels.fp8_gemm` stays the module (its dense
block-scaled GEMM is `pallas_kernels.fp8_gemm.fp8_gemm`; `fp8_linear` wraps it for [out, in] weights).
"""

from pallas_kernels.fp8_gemm import fp8_grouped_gemm
from pallas_kernels.fp8_quant import dequantize_act, dequantize_weight, quantize_act, quantize_weight
from pallas_kernels.fp8_reference import fp8_gemm_reference, fp8_grouped_gemm_reference
from pallas_kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_prefill import mla_prefill
from pallas_kernels.mla_reference import mla_decode_reference, mla_prefill_reference

__all__ = [
    "dequantize_act", "dequantize_weight", "fp8_gemm_reference", "fp8_grouped_gemm",
    "fp8_grouped_gemm_reference", "grouped_gemm", "grouped_gemm_reference", "mla_decode",
    "mla_decode_reference", "mla_prefill", "mla_prefill_reference", "quantize_act", "quantize_weight",
]
