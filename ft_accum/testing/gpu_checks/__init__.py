"""The GPU checks of benchmarks/gpu_check.py, one module per check (see that script's docstring), and what
they share (`common`). Test and benchmark support: the product never imports it."""
