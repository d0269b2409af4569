"""Recovery: where a training process starts, first or replacement (:func:`.start.start`: memory, then the
newest commit, then ``train.resume_from``, then the warm start), and the in-memory tier that serves the first
of these (its packing, its transport, the tier, and a worker's in-place side)."""
