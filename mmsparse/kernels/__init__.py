"""Device code, and nothing of the host: the kernels take tensors, strides and constants.

- ``constants``: the mask modes, dot modes and never-specialised argument names that kernels and launchers share;
- ``rules``: which (query, key) pairs are allowed, written once for both dialects;
- ``tl/``: the Triton kernels (attention passes, block-list builders, dropout mask), run everywhere, the CPU
  interpreter included;
- ``gluon/``: the Hopper (sm_90) attention passes in Gluon, warp-specialised with TMA and wgmma.

The plan that chooses kernel and tile per pass is :mod:`mmsparse.attention.plan` (which kernels may run where:
:mod:`mmsparse.attention.dispatch`); the launchers are :mod:`mmsparse.attention.forward`, ``backward`` and
``gluon_launch``.
"""
