"""The helper layer of bench/, stress/ and tests/: what measuring and driving clef-serve from the
outside needs, in one place (bench/README.md lists the modules).

Not benchmarks, so no `--quick`; installed with the project, so `python bench/<script>.py`
imports it without touching `sys.path`. Nothing here imports tests/.
"""
