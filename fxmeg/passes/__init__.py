"""Graph passes, one per file, pure (no torch.distributed, no rank, no I/O); each
docstring states what the pass requires and ensures, and ``verify.py`` checks the Ensures
after each pass when FXMEG_VERIFY=1 (the tests set it). ``fxmeg/pass_driver.py`` holds the
order (``PASSES``, with each pass's scope and check) and the driver, which calls a pass
as ``run(gm, **what_it_reads) -> gm``: the pass's parameters after ``gm`` name the sections
of the EngineConfig it reads (``parallel``, ``data_parallel``, ``moe``, ``recomputation``,
...), or ``config`` for all of it (``pass_driver.inputs``). Its scope says what ``gm`` is: the whole-model graph
(model); one chunk graph, the call adding ``chunk=``, the chunk's
``fxmeg.program.ChunkInfo`` (chunk: the driver runs it on each chunk); or the pipelined
parent, for a pass that needs every chunk at once (parent).
The sharding passes (context_parallel, tensor_parallel) read one registry of op rules,
``passes/op_rules.py``: an op's family, found by kind, and each axis's rule for it; values'
and parameters' layouts are ``fxmeg.layouts`` records.
tests/test_pass_list.py holds this table to ``PASSES``:

  loss             model   mean loss -> (loss_sum, num_tokens)                  passes/loss.py
  analyse          model   whole-model FLOPs, input value checks, position      passes/analyse.py
                           tables
  context_parallel model   sequences split over cp ranks, K/V all-gathered      passes/context_parallel.py
                           (padding-mask inputs it keeps whole: passes/cp_masks.py)
  tensor_parallel  model   column / row / vocab-parallel, sequence parallelism  passes/tensor_parallel.py
                           (its rules by op family: passes/tp_rules.py, for
                           state-space layers passes/tp_channels.py; inside
                           autocast / no-grad regions: passes/tp_regions.py)
  partition        model   balanced cut: every node tagged with its chunk       passes/partition.py
  pipeline         model   chunk graphs under a parent (returned), with recv /  passes/pipeline.py
                           send / deallocate markers
  expert_parallel  chunk   routed experts split over ep ranks (all-to-all);    passes/expert_parallel.py
                           expert-load markers at every ep
  recompute        chunk   activation-recompute regions                         passes/recompute.py
  buckets          parent  gradient-ready order, buffer layout, buckets: one    passes/buckets.py
                           slot per parameter per pipeline rank
  param_gather     chunk   waits for parameter all-gathers (overlap_param_gather); passes/param_gather.py
                           zero=3: gathers and releases of each bucket
  split_backward   chunk   zero bubble: forward, input- and weight-gradient     passes/split_backward.py
                           graphs

Higher-order ops (autocast and no-grad regions, ``wrap``) are single call_function nodes
whose bodies are GraphModules under ``_fxmeg_hop``, read by get_attr operands
(``graph_utils.is_hop`` / ``is_subgraph`` / ``subgraphs`` / ``body_call``); every pass
keeps each body next to the nodes that call it; tensor parallelism rewrites the body of
a region that reads a split value (passes/tp_regions.py).

Metadata under ``node.meta["fxmeg"]`` (key: on which nodes, what; written by):
  module     every node: FQN of the module that created it ('' = the model's own forward);
             capture (passes copy it onto the nodes they derive; markers get '')
  pass       a node a pass inserted: that pass's name (absent: from capture); the driver,
             by diffing node names around each pass
  loss       the two loss outputs: "sum" | "count"; loss (tensor_parallel moves "sum" to
             its vocabulary-parallel loss)
  tp         a parameter's get_attr: layouts.Shard(dim, parts) | layouts.Replicate(reduce_grad);
             tensor_parallel (the runtime materialises shards from it)
  chunk      a call_function node: its pipeline chunk index; partition
  ep         a routed-experts bank's get_attr: layouts.ExpertShard(experts); expert_parallel
  bucket     a trainable parameter's get_attr: layouts.BucketSlot (home chunk, grad dtype,
             bucket index); buckets

and under ``gm.meta["fxmeg"]``, one record per key:
  capture    the captured graph: CaptureInfo; capture
  facts      ModelFacts; analyse
  cp         CPLayout (cp > 1 only); context_parallel
  partition  Partition, with the placement; partition
             (these four are carried onto the pipelined parent)
  spec       a chunk graph: ChunkSpec; pipeline (``fxmeg.program.chunks`` finds chunks by it)
  buffers    a chunk graph: BufferLayout per gradient dtype; buckets
  split      a chunk graph: SplitSpec (zero-bubble schedules only); split_backward
docs/design.md §2 says who reads each key.
"""
