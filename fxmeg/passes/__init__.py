"""Graph passes, in the order fxmeg runs them. Each is ``gm -> gm``, pure (no
torch.distributed, no I/O), and its docstring states what it requires and ensures.

  loss       mean loss -> (loss_sum, num_tokens)                      passes/loss.py
  tensor_parallel  column / row / vocab-parallel, sequence parallelism   passes/tensor_parallel.py
  (partition: fxmeg/partition.py tags every node with its chunk)
  pipeline   chunk graphs with recv / send / deallocate markers       passes/pipeline.py
  buckets    gradient-ready order, buffer layout, buckets              passes/buckets.py
  param_gather  waits for parameter all-gathers (overlap_param_gather)  passes/param_gather.py

Metadata the passes keep under ``node.meta["fxmeg"]``:
  module     FQN of the module that created the node ('' = the model's own forward); capture
  loss       "sum" | "count" on the two loss outputs; loss pass
  tp         ("shard", dim, parts) | ("replicate", reduce_grad) on a parameter's get_attr;
             tensor_parallel pass
  chunk      pipeline chunk index of a call_function node; partition
  bucket     (home chunk, grad dtype, bucket index) on a trainable parameter's get_attr; buckets

and on a chunk graph, ``gm.meta["fxmeg"]`` is its ``fxmeg.program.ChunkSpec`` and
``gm.meta["fxmeg_buffers"]`` its ``fxmeg.program.BufferLayout`` per gradient dtype.
"""
