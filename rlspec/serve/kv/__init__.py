"""The serving pool's K/V before it enters a slot (`rlspec.serve.pool.ServingPool` admits rows from them).

- `prefill.py`: each distinct prompt's K/V and last hidden state, computed once (packed and replayed from captured
  graphs on CUDA) and kept while more rows of it may start; a turn that extends a kept sequence prefilled from it.
- `prefix.py`: the K/V of rows that ended, kept by their token ids (prefix reuse across an agent's turns), and the
  eager forward that extends one.
"""
