"""Graph passes, one per file, pure (no torch.distributed, no rank, no I/O); each
docstring states what the pass requires and ensures, and ``verify.py`` checks the Ensures
after each pass when FXMEG_VERIFY=1. ``fxmeg/frontend/pass_driver.py`` holds the order and calls
each as ``run(gm, **what_it_reads) -> gm`` on the graph of its scope (model, chunk, parent:
docs/architecture.md §1); the pass's parameters after ``gm`` name the EngineConfig sections
it reads (``parallel``, ``data_parallel``, ``recomputation`` ...; ``pass_driver.inputs``). The
sharding passes read one registry of op rules, ``passes/op_rules.py``.
tests/frontend/test_pass_list.py holds this table to ``PASSES``:

  loss             model   mean loss -> (loss_sum, num_tokens)                  passes/loss.py
  analyse          model   whole-model FLOPs, value checks, position tables     passes/analyse.py
  context_parallel model   sequences split over cp ranks, K/V all-gathered      passes/context_parallel.py
  tensor_parallel  model   column / row / vocab-parallel, sequence parallel     passes/tensor_parallel.py
  partition        model   balanced cut: every node tagged with its chunk       passes/partition.py
  pipeline         model   chunk graphs under a parent, recv / send markers     passes/pipeline.py
  expert_parallel  chunk   routed experts over ep ranks; expert-load marks      passes/expert_parallel.py
  recompute        chunk   activation-recompute regions                         passes/recompute.py
  buckets          parent  grad-ready order, buffers, buckets; one slot per rank passes/buckets.py
  param_gather     chunk   param all-gather waits; zero=3 gathers, releases     passes/param_gather.py
  split_backward   chunk   zero bubble: forward, input-, weight-grad graphs     passes/split_backward.py

The metadata the passes write under ``node.meta["fxmeg"]`` and ``gm.meta["fxmeg"]``, who
writes and who reads each key: docs/architecture.md §2 (held to the code by
tests/frontend/test_pass_list.py). Higher-order ops (regions) in the passes:
docs/architecture.md §8.9.
"""  # noqa: E501 (the pass table: rows read whole by tests/frontend/test_pass_list.py)
