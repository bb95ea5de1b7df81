"""Benchmarks of autotune's speed claims; docs/benchmarks.md maps each claim to its script and page.

- ``scripts/``: one script per question, each run as ``python benchmarks/scripts/<name>.py`` (the
  suite also as ``python -m benchmarks``).
- ``results/<name>/``: what the script ``<name>.py`` writes, and nothing else: its page ``<NAME>.md``
  and its figures ``<name>.json``. A ``--quick`` smoke run writes to a temporary folder instead.
- ``_common/``: what the scripts share (where they write, rounds and ratios, a busy core).
"""
