"""The model: DeepSeek-V3's math as Flax modules, and the kernels' dispatch point.

`transformer` (the decoder stack and the MTP head), `attention` (MLA, naive and absorbed), `moe`
(`noaux_tc` routing, shared + routed experts), `layers` (linears, RMSNorm, SwiGLU), `rope` (YaRN),
`kv_cache` (the paged latent cache's allocation and page writes), `layout` (every parameter and cache
leaf declared once: shape, dtype, logical axes; the leaf names), `kernel_dispatch` (Pallas kernel or its
`jnp` reference), `trace_options` (`TraceOptions`: every trace-time setting, one frozen value the model
carries), `probes` (read-only research views: routing, attention entropy, cache pages).
Must not schedule requests, sample, or know about processes (engine/, parallel/).
"""
