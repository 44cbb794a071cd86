"""Planning: pure functions over small frozen objects. No torch.distributed, no I/O."""
