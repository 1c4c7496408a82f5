"""The mask of a call, in one of two representations: per-token bits (``token_bits``, ``bit_lists``; 0/1
topologies of up to 32 segments) or per-token segment codes (``segment_codes``, ``code_blocks``, ``code_lists``; any
topology, packs); the lengths, the topology, the mask kinds (``info``) and their cache, and a call's mask
(``build``)."""
