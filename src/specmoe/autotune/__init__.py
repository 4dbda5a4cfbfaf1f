"""Measuring this machine and learning from runs, for `--policy auto`.

- measure.py, probe.py, calibrate.py: `specmoe calibrate` (disk, memory, matmul rates; the
  engine's own per-operator, per-sequence and per-fetch costs) -> a hardware profile;
- history.py, speeds.py: what earlier runs measured (draft acceptance, tokens/s);
- choose.py: the plan for `auto`, which the API hands the engine before a policy is built;
- learn.py: what the API records after a run.
Never called from inside a policy.
"""
