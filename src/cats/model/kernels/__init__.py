"""CPU kernels for the target's forward: row-invariant AVX-512 linears and attention in C (`avx512`, built on first
use by `native`), packing a model's linears for them (`packing`), and the lean decoder-layer forward that groups a
layer's work into few large calls (`layer_forward`)."""
