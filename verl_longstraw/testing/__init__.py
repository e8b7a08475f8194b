"""Test helpers: what the tests, the benchmarks, ``benchmarks/gpu_check.py`` and ``python -m verl_longstraw.profile``
compare and drive LongStraw with. Nothing here is used by training; import from the module:

- ``compare``: the standard path (one full forward and backward per ``prompt ++ response``), error measures, random
  groups, float64 and reference-kernel contexts (torch only);
- ``scripts``: a benchmark or recipe file loaded as a module, a benchmark run for its JSON report;
- ``fsdp_probe``: FSDP2's collectives and unsharded layers recorded (torch only; reads FSDP2's private state);
- ``verl_harness``: veRL engines on tiny saved models, veRL GRPO batches, a gloo process group (needs veRL).

Tiny random-init models of every family are in ``verl_longstraw.tiny``.
"""
