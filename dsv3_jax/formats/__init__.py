"""Bytes on disk: safetensors, Orbax, Hugging Face names, the FP8 block format, checkpoint loading.

`safetensors_io` (streaming reads and writes), `orbax_io` (chunked Orbax trees), `hf_names` (HF tensor
names <-> our parameter tree), `fp8_blocks` (DeepSeek's 128x128 FP8 blocks), `tree_to_hf` (our tree
back to HF files), `checkpoint` (what `dsv3_jax.load` reads), `quantize` (bf16 -> FP8 parameters),
`paths` (path containment), `compact` (the embedded default model's part files).
The converter (`python -m convert`) and `load` both use these.
Must not run the model.
"""
