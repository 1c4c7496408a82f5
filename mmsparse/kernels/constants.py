"""Values the kernels and their launchers agree on, as plain ints (launchers pass them as constexprs)."""

from __future__ import annotations

# Pair types of a topology: no key, every key, the keys at or before the query's position.
NONE, FULL, CAUSAL = 0, 1, 2
# A segment code's low bits hold the segment (k <= 4095, plus the padding segment k); the bits above, the sample of
# a pack (mmsparse.mask.segment_codes).
SEG_BITS = 12

# How a kernel reads the exact token mask of a partial tile (its ``MASK_MODE``).
MASK_BITS = 0  # 0/1 topology of <= 32 segments: per-token row bits & column bits
MASK_DENSE = 1  # arbitrary user mask, loaded only in partial tiles
# any topology, packed samples: per-token segment codes and the pair table (mmsparse.mask.segment_codes)
MASK_SEGMENTS = 2

# How the two consumer warpgroups of the Gluon forward take turns with ping-pong (its ``TURNS``; config.Tile.turns).
TURNS_MBARRIER = 0  # a turn mbarrier per warpgroup; each stage released apart through the ring's kv_empty
# a named hardware barrier per warpgroup for the turns (bar.sync / bar.arrive), and one per stage for its release:
# no mbarrier arrive in the consumer loop
TURNS_NAMED_RELEASE = 1

# How the tl kernels multiply tiles (their ``DOT_MODE``).
DOT_NATIVE = 0  # fp16/bf16 tensor cores with fp32 accumulation
DOT_UPCAST = 1  # fp32 operands in IEEE: the CPU interpreter mishandles bf16 dots; bf16 products are exact in fp32
DOT_TF32X3 = 2  # fp32 inputs on the GPU: three tf32 products give fp32 accuracy (plain tf32 gives ~1e-3)

# Words per row block in block lists' counts (mmsparse.mask.blocks.BlockLists): its full and partial blocks, where
# its list starts, and the row block that takes this row's slot in the launch order (longest list first:
# mmsparse.mask.list_order), which the kernels read in place of their program's own row.
COUNT_WORDS = 4

# What one launch of a block-list builder does (``PHASE``; mmsparse.mask.bit_lists.write_lists): LISTS_DENSE
# counts and writes each row's list at r * C; LISTS_COUNT only counts (full, partial); LISTS_WRITE writes each
# row's list at the start the host put in the counts.
LISTS_DENSE = 0
LISTS_COUNT = 1
LISTS_WRITE = 2

# Sequence lengths, offsets and batch/head strides change with every new length, and the sliding window with the
# model: the attention kernels never specialise on them, so a new length or window reuses the compiled kernel. (The
# tl kernels take q's, k's and v's strides in units of 8 elements: tl.common.element_strides.)
DYNAMIC_ARGS = ["stride_qb8", "stride_qh8", "stride_qm8", "stride_kb8", "stride_kh8", "stride_kn8", "stride_vb8",
                "stride_vh8", "stride_vn8", "stride_qbits_b", "stride_kbits_b", "stride_mask_b", "stride_mask_q",
                "stride_cnt_b", "stride_idx_b", "seq_q", "seq_k", "stride_qstart_b", "window", "arrival_epoch",
                "own_blocks", "query_blocks"]
# The tl kernels' output and dO strides, in units of 8 elements as q's, k's and v's (outputs follow their inputs'
# layout, dO is read as autograd hands it over; tl.common.element_strides): never specialised on either.
IO_STRIDE_ARGS = ["stride_ob8", "stride_oh8", "stride_om8", "stride_os8", "stride_dob8", "stride_doh8", "stride_dom8",
                  "stride_dqb8", "stride_dqh8", "stride_dqm8", "stride_dkb8", "stride_dkh8", "stride_dkn8",
                  "stride_dvb8", "stride_dvh8", "stride_dvn8"]
