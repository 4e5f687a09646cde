"""`python -m mok_jax.bench`: the MoE layer, forward and forward+backward, for each mok_jax
backend and the peers a JAX user would pick instead (jax.lax.ragged_dot, tokamax.ragged_dot,
torch._grouped_mm; at --precision fp8 their FP8 paths), against the dense-matmul peak of the run.

Imports point one way: __main__ -> report, runner; the workers' jobs -> torch_peer -> inputs,
timing; any of them -> shapes.
"""
