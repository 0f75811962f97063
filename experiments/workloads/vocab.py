"""The characters a language model of the bundled corpus reads: its token ids."""

# Fixed, corpus-independent vocabulary, so a model's shape never depends on the text read.
VOCAB = "\n\t" + "".join(chr(c) for c in range(32, 127))
"""Characters with their own id; every other character maps to the extra id len(VOCAB)."""
VOCAB_SIZE = len(VOCAB) + 1
"""Number of token ids: the VOCAB characters plus one id for anything else."""
