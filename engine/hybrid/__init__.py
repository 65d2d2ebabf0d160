"""Hybrid models (recurrent SSM / linear-attention layers beside attention layers): their recurrent state, kept in
a pool of slots, snapshotted at block boundaries and restored exactly (docs/hybrid.md)."""
