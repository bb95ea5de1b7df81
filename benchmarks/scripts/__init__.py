"""The benchmark scripts, one question each; each writes only ``benchmarks/results/<its name>/``."""
