"""The mask of a call: lengths, segments and topology, the block lists and their builders, the mask types."""
