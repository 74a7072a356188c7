"""The parallel seam: one backend per parallelism over one job layout (docs/ARCHITECTURE.md)."""
