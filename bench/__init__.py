"""Benchmarks: ``bench_propose`` ships in the wheel for ``mtpdraft bench``; the others run from a
checkout (``python bench/<name>.py``). Siblings import each other as ``bench.<name>``."""
