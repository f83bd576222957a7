"""What the tutorials run on the engines and draw, by topic. Installed with the package, so that
ipyparallel engines can import it; nothing in the runtime imports it.

    sequence.py    the Ulysses exchange and the Ring passes, traced on real ranks, and their drawings
    links.py       when each split wins: bytes at a realistic size on stated link speeds
    tables.py      result tables of the strategy lessons: batch rows, quality, bytes, timings
    loading.py     what a rank holds, mmap and plain reads
    timing.py      warm-up and timed runs, medians per phase
    production.py  `xdit-lab run` under torchrun from a notebook's arguments
    families.py    call arguments for each family's tiny pipeline
"""
