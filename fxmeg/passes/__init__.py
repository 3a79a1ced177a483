"""Graph passes. Each is ``(gm, config) -> gm``, one per file, pure (no torch.distributed,
no rank, no I/O), and its docstring states what it requires and ensures;
``verify.py`` checks the Ensures after each pass when FXMEG_VERIFY=1 (the tests set it).
``fxmeg/transform.py`` holds the order (``PASSES``) and the driver:

  loss             mean loss -> (loss_sum, num_tokens)                   passes/loss.py
  analyse          whole-model FLOPs and input value checks              passes/analyse.py
  context_parallel sequences split over cp ranks, K/V all-gathered        passes/context_parallel.py
                   (padding-mask inputs it keeps whole: passes/cp_masks.py)
  tensor_parallel  column / row / vocab-parallel, sequence parallelism   passes/tensor_parallel.py
                   (its propagation rules by kind of op: passes/tp_rules.py)
  partition        balanced cut: every node tagged with its chunk        passes/partition.py
  pipeline         chunk graphs with recv / send / deallocate markers    passes/pipeline.py
  recompute        activation-recompute regions in every chunk           passes/recompute.py
  buckets          gradient-ready order, buffer layout, buckets          passes/buckets.py
  param_gather     waits for parameter all-gathers (overlap_param_gather) passes/param_gather.py

Higher-order ops (autocast and no-grad regions, ``wrap``) are single call_function nodes
whose bodies are GraphModules under ``_fxmeg_hop``, read by get_attr operands
(``graph_utils.is_hop`` / ``is_subgraph`` / ``subgraphs`` / ``body_call``); every pass
keeps each body next to the nodes that call it.

Metadata the passes keep under ``node.meta["fxmeg"]``:
  module     FQN of the module that created the node ('' = the model's own forward); capture
  pass       name of the pass that inserted the node (absent: from capture); the driver
             (fxmeg/transform.py) sets it by diffing node names around each pass
  loss       "sum" | "count" on the two loss outputs; loss pass
  tp         layouts.Shard(dim, parts) | layouts.Replicate(reduce_grad) on a parameter's get_attr;
             tensor_parallel pass (the runtime materialises shards from it)
  chunk      pipeline chunk index of a call_function node; partition
  bucket     (home chunk, grad dtype, bucket index) on a trainable parameter's get_attr; buckets

and under ``gm.meta["fxmeg"]`` (read through ``fxmeg.program``): on the whole graph
"capture" (CaptureInfo), "facts" (ModelFacts; analyse), "cp" (CPLayout; context_parallel, cp > 1), "partition" (Partition; partition),
carried onto the pipelined parent; on a chunk graph "spec" (ChunkSpec; pipeline) and
"buffers" (BufferLayout per gradient dtype; buckets).
"""
