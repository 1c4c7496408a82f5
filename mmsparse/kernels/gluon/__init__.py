"""Gluon kernels for Hopper (sm_90): ``common`` holds the helpers the three passes share. Importing this package
needs ``triton.experimental.gluon``; :mod:`mmsparse.attention.dispatch` decides whether it is used."""
