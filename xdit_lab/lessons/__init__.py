"""What the tutorials run on the engines and draw, by topic. Installed with the package, so that
ipyparallel engines can import it; nothing in the runtime imports it.

    sequence.py    tutorials 02-04: the Ulysses exchange and the Ring passes, traced on real ranks, drawn
    links.py       tutorial 04: when each split wins, bytes at a realistic size on stated link speeds
    tables.py      tutorials 05-07: result tables of the strategy lessons (batch rows, quality, bytes)
    tensor.py      tutorial 07: a block's rows and columns per tp rank, its collectives, tp beside ulysses and pf
    controls.py    deliberately wrong PipeFusion K/V buffers, which a staleness bound must catch
    schedules.py   tutorial 06: PipeFusion's drained and async schedules side by side, the bubble
    loading.py     tutorial 08: what a rank holds, mmap and plain reads
    timing.py      tutorial 09: warm-up and timed runs, medians per phase
    production.py  tutorial 10: `xdit-lab run` under torchrun from a notebook's arguments
    families.py    tutorial 11: call arguments for each family's tiny pipeline
    caching.py     tutorial 12: a StepCache's decisions per rank, and ranks that decide alone
    decoding.py    tutorial 13: the VAE decode's memory and work per rank
    fitting.py     tutorial 14: a real model planned from its headers; FSDP2's shards and gathers per rank
    exercises.py   every tutorial: an exercise's answer checked against what the ranks measured
"""
