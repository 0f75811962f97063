"""What a run writes to its directory, and how: files written atomically, metrics and
summary.json, checkpoints, the Chrome trace, TensorBoard files and the progress bar."""
