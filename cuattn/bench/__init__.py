"""Benchmarks beside the kernels: ``python -m cuattn bench`` and the pytest-benchmark suite share it.

    timing.py    CUDA-event and graph timers, FLOP and byte counts, the ceilings, naive CuPy
    cases.py     the benchmark cases (shapes, implementations, one measurement per case)
    report.py    Markdown tables and the JSON record
    plot.py      the throughput plot (matplotlib, optional)
    overhead.py  host time per call and eager throughput (``bench overhead``)
    cli.py       the command line
"""
