"""What is trained: the models, the generated or shipped data sets and their shards, the
tasks (loss and evaluation), and which embedding tables travel as rows."""
