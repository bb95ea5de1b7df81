"""What the benchmark scripts share; nothing here is a benchmark of its own.

- ``harness``: where a script writes (``benchmarks/results/<script>/``), its command-line defaults,
  and the machine and its load in a line.
- ``stats``: rounds measured side by side: their order, spread and paired ratio interval.
- ``hog``: one busy core beside a run (NOTE [ Loaded mode ]).
- ``output``: the suite's page, figures and plot.
"""
