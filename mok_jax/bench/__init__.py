"""`python -m mok_jax.bench`: the MoE layer, forward and forward+backward, for each mok_jax
backend and the peers a JAX user would pick instead (jax.lax.ragged_dot, tokamax.ragged_dot,
torch._grouped_mm), against the dense-matmul peak measured in the same run.

Modules: shapes (what is timed, FLOPs), inputs (routing and tensors, identical in every
framework), peers (the implementations), torch_peer (the PyTorch layer), timing (the repetition
loop), jobs (one job; also the worker process), runner (plans and runs jobs), report (derived
figures, table, JSON lines, chart), env (machine, versions).
"""
