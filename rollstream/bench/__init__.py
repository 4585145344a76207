"""Benchmarks of rollstream's moving parts (the bus, the codec), each runnable as `rollstream bench …`."""
